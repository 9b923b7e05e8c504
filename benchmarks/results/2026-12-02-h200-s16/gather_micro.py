import torch, json, os
from lightning_ft.kernels.moe.routing import _gather_rows, row_padded
T, K, D = 8192, 8, 2048
x = torch.randn(T, D, device="cuda", dtype=torch.bfloat16)
idx = torch.randint(0, T, (T * K,), device="cuda")
def t(fn, reps=20):
    fn(); torch.cuda.synchronize(); torch.cuda._sleep(10_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); e.synchronize(); return s.elapsed_time(e) / reps * 1e3
r = {"index_select_contig": t(lambda: x.index_select(0, idx)),
     "index_select_strided_out": t(lambda: torch.index_select(x, 0, idx, out=row_padded(T * K, D, 16, x))),
     "triton_gather_padded": t(lambda: _gather_rows(x, idx, 16))}
assert torch.equal(_gather_rows(x, idx, 16), x[idx])
print(json.dumps(r))
