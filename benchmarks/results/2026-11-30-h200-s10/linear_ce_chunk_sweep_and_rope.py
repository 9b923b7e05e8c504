"""Session 10 scratch: linear CE chunk/block sweep, and RoPE fwd+bwd kernel list + host time, on the H200."""
import json, os, sys, time
import torch, triton, triton.testing
import lightning_ft.kernels.linear_cross_entropy as lce
from lightning_ft.kernels.rope import apply_rope, rope_reference

OUT = os.environ.get("OUT", "/tmp")
res = {"ce": [], "rope": {}}
dev = torch.device("cuda")
bf16 = torch.bfloat16

def graph_ms(step):
    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3): step()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g): step()
    ms = triton.testing.do_bench(g.replay, warmup=25, rep=200, return_mode="median")
    del g
    return ms

def ce_step(fn, h, w, y):
    def step():
        loss = fn(h, w, y)
        loss.backward()
        h.grad = None
    return step

try:
    from liger_kernel.transformers import functional as liger
except ImportError:
    liger = None

for T in (16384, 8192):
    H, V = 2048, 151936
    torch.manual_seed(0)
    y = torch.randint(0, V, (T,), device=dev); y[torch.rand(T, device=dev) < 0.1] = -100
    h = torch.randn(T, H, device=dev, dtype=bf16, requires_grad=True)
    w = (torch.randn(V, H, device=dev) / H**0.5).to(bf16)
    impls = {"reference": lambda h, w, y: lce.linear_cross_entropy_reference(h, w, y)[0]}
    if liger:
        impls["liger"] = lambda h, w, y: liger.liger_fused_linear_cross_entropy(h, w, y, reduction="sum")
    for C in (256, 512, 1024, 2048, 4096):
        for bv, nw in ((16384, 32), (8192, 16), (4096, 8), (2048, 8)):
            impls[f"ours C={C} BV={bv} W={nw}"] = (lambda C, bv, nw: (lambda h, w, y: (
                setattr(lce, "_MAX_BLOCK_V", bv), setattr(lce, "num_warps_for", lambda _b, nw=nw: nw),
                lce.fused_linear_cross_entropy(h, w, y, chunk_size=C)[0])[-1]))(C, bv, nw)
            if C not in (256, 2048) and bv != 16384:
                impls.pop(f"ours C={C} BV={bv} W={nw}")
    for name, fn in impls.items():
        step = ce_step(fn, h, w, y)
        torch.cuda.synchronize(); torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
        step(); torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
        ms = triton.testing.do_bench(step, warmup=10, rep=100, return_mode="median")
        try:
            dms = graph_ms(step)
        except RuntimeError as e:
            dms = None
        row = dict(T=T, impl=name, ms=ms, device_ms=dms, peak_mib=peak)
        print(json.dumps(row), flush=True)
        res["ce"].append(row)
    del h, w
    torch.cuda.empty_cache()

# RoPE
T, Hq, Hk, D = 8192, 32, 8, 128
inv = 1.0 / (1e6 ** (torch.arange(0, D, 2, device=dev).float() / D))
fr = torch.arange(T, device=dev).float()[:, None] * inv
emb = torch.cat((fr, fr), -1)[None]
cos, sin = emb.cos().to(bf16), emb.sin().to(bf16)
rimpls = {"ours": apply_rope, "reference": rope_reference}
if liger:
    rimpls["liger"] = liger.liger_rope
for name, fn in rimpls.items():
    qp = torch.randn(1, T, Hq * D, device=dev, dtype=bf16, requires_grad=True)
    kp = torch.randn(1, T, Hk * D, device=dev, dtype=bf16, requires_grad=True)
    def fwd():
        q = qp.view(1, T, Hq, D).transpose(1, 2); k = kp.view(1, T, Hk, D).transpose(1, 2)
        return fn(q, k, cos, sin)
    def step():
        q, k = fwd()
        torch.autograd.backward([q, k], [torch.ones_like(q), torch.ones_like(k)])
        qp.grad = None; kp.grad = None
    def fwd_ng():
        with torch.no_grad():
            return fwd()
    out = {}
    for label, s in (("fwd", fwd_ng), ("fwd+bwd", step)):
        out[label + "_ms"] = triton.testing.do_bench(s, warmup=25, rep=200, return_mode="median")
        out[label + "_device_ms"] = graph_ms(s)
        # host time per call (no sync inside)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for _ in range(200): s()
        t1 = time.perf_counter(); torch.cuda.synchronize()
        out[label + "_host_us"] = (t1 - t0) / 200 * 1e6
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA, torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(5): step()
        torch.cuda.synchronize()
    out["profile"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15)
    print(name, {k: v for k, v in out.items() if k != "profile"}); print(out["profile"], flush=True)
    res["rope"][name] = out
with open(os.path.join(OUT, "s10_ce_rope.json"), "w") as f:
    json.dump(res, f, indent=1)
