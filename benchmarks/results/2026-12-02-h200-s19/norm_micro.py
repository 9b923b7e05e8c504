"""µs per call: add + rms_norm vs residual_rms_norm (forward), and their backwards, [8192, 2048] bf16, H200."""
import torch, json, os
from lightning_ft.kernels.rms_norm import residual_rms_norm, rms_norm
T, D = 8192, 2048
x, r = (torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
w = torch.ones(D, device="cuda", dtype=torch.bfloat16)
dy, ds = (torch.randn(T, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
def t(fn, n=50):
    for _ in range(5): fn()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    torch.cuda.synchronize(); s.record()
    for _ in range(n): fn()
    e.record(); torch.cuda.synchronize(); return s.elapsed_time(e) / n * 1e3
out = {}
out["fwd_unfused_add_norm"] = t(lambda: rms_norm(r + x, w, 1e-6))
out["fwd_fused"] = t(lambda: residual_rms_norm(x, w, 1e-6, residual=r))
out["fwd_norm_only"] = t(lambda: rms_norm(x, w, 1e-6))
out["add_only"] = t(lambda: r + x)
xs = x.clone().requires_grad_(); rs = r.clone().requires_grad_()
def bwd_unfused():
    s = rs + xs; y = rms_norm(s, w, 1e-6); torch.autograd.backward([y, s], [dy, ds])
def bwd_fused():
    y, s = residual_rms_norm(xs, w, 1e-6, residual=rs); torch.autograd.backward([y, s], [dy, ds])
out["fwd+bwd_unfused"] = t(bwd_unfused)
out["fwd+bwd_fused"] = t(bwd_fused)
print(json.dumps(out, indent=1))
json.dump(out, open(os.environ.get("OUTF", "/tmp/o/norm_micro.json"), "w"), indent=1)
