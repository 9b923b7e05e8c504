"""Thin expert-LoRA GEMMs at S=65536 (8K tokens x top-8), E=128, R=16: grouped_mm vs our Triton kernels."""
import json, os, sys
import torch, triton
from lightning_ft.kernels.moe.grouped_gemm import grouped_gemm, grouped_wgrad, _GROUPED_MM
from lightning_ft.kernels.moe import sort_by_expert
torch.manual_seed(0)
dev = "cuda"; bf = torch.bfloat16
T, K, E, R = 8192, 8, 128, 16
logits = torch.randn(T, E, device=dev)
idx = logits.topk(K, dim=-1).indices
routing = sort_by_expert(idx, E)
off = routing.offsets_E
S = T * K
res = {}
def bench(name, fn):
    fn(); torch.cuda.synchronize()
    ms = triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")
    res[name] = ms * 1e3
    print(f"{name:40s} {ms*1e3:8.1f} us", flush=True)
def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
for proj, C, N in (("gate_up", 2048, 1536), ("down", 768, 2048)):
    x = torch.randn(S, C, device=dev, dtype=bf)
    dy = torch.randn(S, N, device=dev, dtype=bf)
    a = torch.randn(E, R, C, device=dev, dtype=bf) / C**0.5
    b = torch.randn(E, N, R, device=dev, dtype=bf) / R**0.5
    xa_ref = _GROUPED_MM(x, a.transpose(1, 2), offs=off)
    bench(f"{proj} xa grouped_mm", lambda: _GROUPED_MM(x, a.transpose(1, 2), offs=off))
    bench(f"{proj} xa triton", lambda: grouped_gemm(x, a.transpose(1, 2), off, S))
    print("  rel", rel(grouped_gemm(x, a.transpose(1, 2), off, S), xa_ref))
    bench(f"{proj} dyb grouped_mm", lambda: _GROUPED_MM(dy, b, offs=off))
    bench(f"{proj} dyb triton", lambda: grouped_gemm(dy, b, off, S))
    dyb = _GROUPED_MM(dy, b, offs=off)
    print("  rel", rel(grouped_gemm(dy, b, off, S), dyb))
    bench(f"{proj} dA grouped_mm", lambda: _GROUPED_MM(dyb.t(), x, offs=off))
    bench(f"{proj} dA triton", lambda: grouped_wgrad(dyb, x, off))
    print("  rel", rel(grouped_wgrad(dyb, x, off), _GROUPED_MM(dyb.t(), x, offs=off)))
    bench(f"{proj} dB grouped_mm", lambda: _GROUPED_MM(dy.t(), xa_ref, offs=off))
    bench(f"{proj} dB triton", lambda: grouped_wgrad(dy, xa_ref, off))
    print("  rel", rel(grouped_wgrad(dy, xa_ref, off), _GROUPED_MM(dy.t(), xa_ref, offs=off)))
    out = torch.randn(S, N, device=dev, dtype=bf)
    bench(f"{proj} add xa@B triton (accumulate)", lambda: grouped_gemm(xa_ref, b.transpose(1, 2), off, S, accumulate_into=out))
    bench(f"{proj} copy [S,C] (bandwidth ref)", lambda: x.clone())
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "thin_gemms.json"), "w"), indent=1)
