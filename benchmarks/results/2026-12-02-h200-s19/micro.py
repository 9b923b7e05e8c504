"""µs per call on the device (CUDA events, back to back): torch.topk vs routing.topk on a router's
[8192, 128] fp32 probabilities, K = 8; the residual-sum fusion's kernels at [8192, 2048] bf16."""
import json, os, torch
from lightning_ft.kernels.moe.routing import topk
from lightning_ft.kernels.rms_norm import residual_rms_norm, rms_norm, rms_norm_backward, rms_norm_forward

def t(fn, n=100):
    for _ in range(5): fn()
    torch.cuda.synchronize()
    torch.cuda._sleep(20_000_000)  # queue the runs behind a sleep: device time, not launch time
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1e3
out = {}
probs = torch.softmax((3 * torch.randn(8192, 128, device="cuda")).bfloat16().float(), -1)
out["torch.topk"] = t(lambda: torch.topk(probs, 8, dim=-1))
out["routing.topk"] = t(lambda: topk(probs, 8))
v, i = topk(probs, 8); tv, ti = torch.topk(probs, 8, dim=-1)
out["topk_values_equal"] = bool(torch.equal(v, tv)); out["topk_index_sets_equal"] = bool(torch.equal(i.sort(-1).values, ti.sort(-1).values))
out["topk_rows_with_ties"] = int((v[:, 1:] == v[:, :-1]).any(-1).sum())
T, D = 8192, 2048
x, r, dy, ds = (torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
out["add"] = t(lambda: r + x)
out["norm_fwd"] = t(lambda: rms_norm_forward(x, w, 1e-6))
out["norm_fwd_with_sum"] = t(lambda: rms_norm_forward(x, w, 1e-6, residual=r))
_, s2d, rstd = rms_norm_forward(x, w, 1e-6)
out["norm_bwd"] = t(lambda: rms_norm_backward(dy, s2d, w, rstd, False))
out["norm_bwd_with_sum"] = t(lambda: rms_norm_backward(dy, s2d, w, rstd, False, dres=ds))
print(json.dumps(out, indent=1))
