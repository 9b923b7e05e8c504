"""Session 10 scratch: RoPE backward variants (device time), and linear CE chunk sweep at the Llama-8B head."""
import json, os
import torch, triton, triton.testing, triton.language as tl
import lightning_ft.kernels.rope as R
import lightning_ft.kernels.linear_cross_entropy as lce

OUT = os.environ.get("OUT", "/tmp")
dev, bf16 = torch.device("cuda"), torch.bfloat16
res = {}

@triton.jit
def _rot(X, O, sx_h, sx_t, so_h, so_t, t, c1, c2, s1, s2, d, NH: tl.constexpr, BH: tl.constexpr, HALF: tl.constexpr,
         EVICT: tl.constexpr, CS: tl.constexpr):
    h = tl.arange(0, BH)[:, None]
    m = h < NH
    x = X + t * sx_t + h * sx_h + d
    o = O + t * so_t + h * so_h + d
    if EVICT:
        x1 = tl.load(x, mask=m, eviction_policy="evict_first").to(tl.float32)
        x2 = tl.load(x + HALF, mask=m, eviction_policy="evict_first").to(tl.float32)
    else:
        x1 = tl.load(x, mask=m).to(tl.float32)
        x2 = tl.load(x + HALF, mask=m).to(tl.float32)
    o1 = x1 * c1 + x2 * s2
    o2 = x2 * c2 - x1 * s1
    if CS:
        tl.store(o, o1.to(O.dtype.element_ty), mask=m, cache_modifier=".cs")
        tl.store(o + HALF, o2.to(O.dtype.element_ty), mask=m, cache_modifier=".cs")
    else:
        tl.store(o, o1.to(O.dtype.element_ty), mask=m)
        tl.store(o + HALF, o2.to(O.dtype.element_ty), mask=m)


@triton.jit
def _bwd(Q, K, QO, KO, COS, SIN, sq_h, sq_t, sk_h, sk_t, so_h, so_t, sko_h, sko_t,
         HQ: tl.constexpr, HK: tl.constexpr, HALF: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr,
         EVICT: tl.constexpr, CS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    c1 = tl.load(COS + t * 2 * HALF + d).to(tl.float32)
    c2 = tl.load(COS + t * 2 * HALF + HALF + d).to(tl.float32)
    s1 = tl.load(SIN + t * 2 * HALF + d).to(tl.float32)
    s2 = tl.load(SIN + t * 2 * HALF + HALF + d).to(tl.float32)
    _rot(Q, QO, sq_h, sq_t, so_h, so_t, t, c1, c2, s1, s2, d, HQ, BQ, HALF, EVICT, CS)
    _rot(K, KO, sk_h, sk_t, sko_h, sko_t, t, c1, c2, s1, s2, d, HK, BK, HALF, EVICT, CS)


def graph_ms(fn, n=20):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=300, return_mode="median") / n

T, Hq, Hk, D = 8192, 32, 8, 128
cos = torch.randn(1, T, D, device=dev, dtype=bf16); sin = torch.randn(1, T, D, device=dev, dtype=bf16)
dq = torch.randn(1, T, Hq, D, device=dev, dtype=bf16).transpose(1, 2)
dk = torch.randn(1, T, Hk, D, device=dev, dtype=bf16).transpose(1, 2)
rows = {}
rows["ours rope_backward (fresh out)"] = graph_ms(lambda: R.rope_backward(dq, dk, cos, sin))
rows["ours forward (in place)"] = graph_ms(lambda: R.rope_forward(dq, dk, cos, sin))
qo = torch.empty(1, T, Hq, D, device=dev, dtype=bf16); ko = torch.empty(1, T, Hk, D, device=dev, dtype=bf16)
for warps in (2, 4, 8):
    for evict in (0, 1):
        for cs in (0, 1):
            for inplace in (0, 1):
                QO, KO = (dq, dk) if inplace else (qo.transpose(1, 2), ko.transpose(1, 2))
                f = lambda: _bwd[(T,)](dq, dk, QO, KO, cos, sin, dq.stride(1), dq.stride(2), dk.stride(1), dk.stride(2),
                                       QO.stride(1), QO.stride(2), KO.stride(1), KO.stride(2),
                                       HQ=Hq, HK=Hk, HALF=D // 2, BQ=32, BK=8, EVICT=evict, CS=cs, num_warps=warps)
                rows[f"variant warps={warps} evict={evict} cs={cs} inplace={inplace}"] = graph_ms(f)
try:
    from liger_kernel.ops.rope import rope_backward as liger_bwd, rope_forward as liger_fwd
    rows["liger rope_backward"] = graph_ms(lambda: liger_bwd(dq, dk, cos, sin))
    rows["liger rope_forward"] = graph_ms(lambda: liger_fwd(dq, dk, cos, sin))
except Exception as e:
    rows["liger"] = repr(e)
for k, v in rows.items():
    print(f"{k:50s} {v if isinstance(v, str) else round(v * 1000, 2)} us", flush=True)
res["rope_bwd_us"] = {k: (v if isinstance(v, str) else v * 1000) for k, v in rows.items()}

# Linear CE at the Llama-3.1-8B head, and at the Qwen3 head with T=4096
res["ce"] = []
for T, H, V in ((8192, 4096, 128256), (4096, 2048, 151936), (2048, 4096, 128256)):
    torch.manual_seed(0)
    y = torch.randint(0, V, (T,), device=dev)
    h = torch.randn(T, H, device=dev, dtype=bf16, requires_grad=True)
    w = (torch.randn(V, H, device=dev) / H**0.5).to(bf16)
    for C in (None, 256, 512, 1024, 2048):
        if C is not None and C > T:
            continue
        def step():
            lce.fused_linear_cross_entropy(h, w, y, chunk_size=C)[0].backward(); h.grad = None
        step(); torch.cuda.synchronize(); torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats(); step(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = graph_ms(step, n=1)
        row = dict(T=T, H=H, V=V, C=C, device_ms=ms, peak_mib=peak)
        print(row, flush=True); res["ce"].append(row)
json.dump(res, open(os.path.join(OUT, "s10_rope_ce.json"), "w"), indent=1)
