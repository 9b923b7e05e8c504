"""Session 21 micro: dense LoRA projections' forward/backward variants under CUDA graph replay (device time),
at Qwen3-30B-A3B's q/k/o shapes, T=8192, r=16, bf16. Also host costs of the step's prologue pieces."""
import time, torch, json, sys
torch.manual_seed(0)
dev = "cuda"
T, r, s = 8192, 16, 2.0
bf = torch.bfloat16
out = {}

def graph_time(fn, reps=20, outer=5):
    st = torch.cuda.Stream()
    st.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(st):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(st)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = 1e9
    for _ in range(outer):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        best = min(best, a.elapsed_time(b) * 1e3 / reps)
    return best

for name, N, K in (("q", 4096, 2048), ("k", 512, 2048), ("o", 2048, 4096)):
    # forward: x [T, K], W [N, K], A [r, K], B [N, r]
    x = torch.randn(T, K, device=dev, dtype=bf); W = torch.randn(N, K, device=dev, dtype=bf) * 0.02
    A = torch.randn(r, K, device=dev, dtype=bf) * 0.02; B = torch.randn(N, r, device=dev, dtype=bf) * 0.02
    y = torch.empty(T, N, device=dev, dtype=bf); h = torch.empty(T, r, device=dev, dtype=bf)
    def f_cur():
        torch.mm(x, W.t(), out=y); torch.mm(x, A.t(), out=h); y.addmm_(h, B.t(), alpha=s)
    def f_lorafirst():
        torch.mm(x, A.t(), out=h); torch.addmm(y, h, B.t(), beta=0, alpha=s, out=y); y.addmm_(x, W.t())
    def f_base():
        torch.mm(x, W.t(), out=y)
    # backward: dy [T, N]; dx = dy W + s (dy B) A
    dy = torch.randn(T, N, device=dev, dtype=bf); dx = torch.empty(T, K, device=dev, dtype=bf)
    dh = torch.empty(T, r, device=dev, dtype=bf); tmp = torch.empty(T, K, device=dev, dtype=bf)
    def b_cur():
        torch.mm(dy, B, out=dh); dh.mul_(s); torch.mm(dy, W, out=dx); torch.mm(dh, A, out=tmp); dx.add_(tmp)
    def b_lorafirst():
        torch.mm(dy, B, out=dh); dh.mul_(s); torch.mm(dh, A, out=dx); dx.addmm_(dy, W)
    def b_baddthin():
        torch.mm(dy, B, out=dh); dh.mul_(s); torch.mm(dy, W, out=dx); dx.addmm_(dh, A)
    def b_base():
        torch.mm(dy, W, out=dx)
    for fn in (f_base, f_cur, f_lorafirst, b_base, b_cur, b_lorafirst, b_baddthin):
        out[f"{name}_{fn.__name__}"] = round(graph_time(fn), 1)
    # values: lorafirst vs cur, relative difference
    f_cur(); y1 = y.float().clone(); f_lorafirst(); y2 = y.float().clone()
    ref = (x.double() @ W.double().t() + s * (x.double() @ A.double().t()).to(bf).double() @ B.double().t())
    out[f"{name}_fwd_err_cur"] = float((y1.double() - ref).norm() / ref.norm()); out[f"{name}_fwd_err_lorafirst"] = float((y2.double() - ref).norm() / ref.norm())
    print(name, {k: v for k, v in out.items() if k.startswith(name)}, flush=True)

# q/k/v chained: the three projections' input gradients summed (autograd: 2 adds) vs one accumulator
N3 = (4096, 512, 512)
Ws = [torch.randn(n, 2048, device=dev, dtype=bf) * 0.02 for n in N3]; As = [torch.randn(r, 2048, device=dev, dtype=bf) * 0.02 for _ in N3]
Bs = [torch.randn(n, r, device=dev, dtype=bf) * 0.02 for n in N3]; dys = [torch.randn(T, n, device=dev, dtype=bf) for n in N3]
dhs = [torch.empty(T, r, device=dev, dtype=bf) for _ in N3]; parts = [torch.empty(T, 2048, device=dev, dtype=bf) for _ in N3]
tmp = torch.empty(T, 2048, device=dev, dtype=bf); acc = torch.empty(T, 2048, device=dev, dtype=bf)
def qkv_cur():
    for W, A, B, dy, dh, p in zip(Ws, As, Bs, dys, dhs, parts):
        torch.mm(dy, B, out=dh); dh.mul_(s); torch.mm(dy, W, out=p); torch.mm(dh, A, out=tmp); p.add_(tmp)
    torch.add(parts[0], parts[1], out=acc); acc.add_(parts[2])
def qkv_chain():
    for i, (W, A, B, dy, dh) in enumerate(zip(Ws, As, Bs, dys, dhs)):
        torch.mm(dy, B, out=dh); dh.mul_(s)
    torch.mm(dhs[0], As[0], out=acc)
    acc.addmm_(dhs[1], As[1]); acc.addmm_(dhs[2], As[2])
    for W, dy in zip(Ws, dys):
        acc.addmm_(dy, W)
def qkv_perproj_lorafirst():
    for W, A, B, dy, dh, p in zip(Ws, As, Bs, dys, dhs, parts):
        torch.mm(dy, B, out=dh); dh.mul_(s); torch.mm(dh, A, out=p); p.addmm_(dy, W)
    torch.add(parts[0], parts[1], out=acc); acc.add_(parts[2])
for fn in (qkv_cur, qkv_chain, qkv_perproj_lorafirst):
    out[f"qkv_{fn.__name__}"] = round(graph_time(fn, reps=10), 1)
print({k: v for k, v in out.items() if k.startswith("qkv")}, flush=True)

# host: HF rotary module call, untraced
from transformers import AutoConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRotaryEmbedding
cfg = AutoConfig.for_model("qwen3_moe", hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, max_position_embeddings=40960, rope_theta=1e6)
rot = Qwen3MoeRotaryEmbedding(cfg, device=dev)
pos = torch.arange(T, device=dev)[None]
hs = torch.empty(1, T, 2048, device=dev, dtype=bf)
with torch.autocast("cuda", dtype=bf):
    for _ in range(5): rot(hs, pos)
    torch.cuda.synchronize(); t0 = time.perf_counter()
    for _ in range(50): rot(hs, pos)
    t1 = time.perf_counter(); torch.cuda.synchronize()
out["host_rotary_us"] = round((t1 - t0) / 50 * 1e6, 1)
print("host rotary", out["host_rotary_us"], flush=True)
json.dump(out, open(sys.argv[1], "w"), indent=1)
