"""Microbench: LoRA B folded into the base grouped_mm along K (forward) / N (backward dX) vs today's separate thin add."""
import json, os, sys, torch
from lightning_ft.kernels.moe.grouped_gemm import _GROUPED_MM as gmm, grouped_gemm, _add_thin_grouped
from lightning_ft.kernels.moe.routing import sum_pairs
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
E, T, K, D, I, R = 128, 8192, 8, 2048, 768, 16
S = T * K
logits = torch.randn(T, E, device=dev)
idx = logits.topk(K, dim=-1).indices.reshape(-1)
counts = torch.bincount(idx, minlength=E)
offs = counts.cumsum(0).to(torch.int32)

def t(fn, reps=20):
    fn(); torch.cuda.synchronize()
    torch.cuda._sleep(10_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / reps * 1e3  # us

res = {}
for name, C, N in (("gate_up", D, 2 * I), ("down", I, D)):
    W = torch.randn(E, N, C, device=dev, dtype=dt) * 0.02
    Waug = torch.zeros(E, N, C + R, device=dev, dtype=dt)
    Waug[..., :C] = W
    A = torch.randn(E, R, C, device=dev, dtype=dt) * 0.02
    B = torch.randn(E, N, R, device=dev, dtype=dt) * 0.02
    Waug[..., C:] = B
    x = torch.randn(S, C, device=dev, dtype=dt)
    xaug = torch.empty(S, C + R, device=dev, dtype=dt); xaug[:, :C] = x
    xa = grouped_gemm(x, A.transpose(1, 2), offs, S).mul_(2.0)
    xaug[:, C:] = xa
    dy = torch.randn(S, N, device=dev, dtype=dt)
    BT = B.transpose(1, 2)
    # forward
    def f_cur():
        y = gmm(x, W.transpose(1, 2), offs=offs)
        return _add_thin_grouped(y, xa, BT, offs)
    def f_aug():
        return gmm(xaug, Waug.transpose(1, 2), offs=offs)
    def f_base():
        return gmm(x, W.transpose(1, 2), offs=offs)
    def xa_cur():
        return grouped_gemm(x, A.transpose(1, 2), offs, S)
    def xa_strided():
        return grouped_gemm(xaug[:, :C], A.transpose(1, 2), offs, S)
    # backward dX (+ dyb)
    def b_cur():
        dx = gmm(dy, W, offs=offs)
        dyb = grouped_gemm(dy, B, offs, S)
        return _add_thin_grouped(dx, dyb, A, offs)
    def b_aug():
        dxa = gmm(dy, Waug, offs=offs)
        return _add_thin_grouped(dxa[:, :C], dxa[:, C:], A, offs)
    def b_base():
        return gmm(dy, W, offs=offs)
    y1, y2 = f_cur(), f_aug()
    d1, d2 = b_cur(), b_aug()
    r = {k: t(v) for k, v in dict(f_cur=f_cur, f_aug=f_aug, f_base=f_base, xa_cur=xa_cur, xa_strided=xa_strided,
                                  b_cur=b_cur, b_aug=b_aug, b_base=b_base).items()}
    r["fwd_maxdiff"] = (y1.float() - y2.float()).abs().max().item()
    r["fwd_scale"] = y1.float().abs().max().item()
    r["bwd_maxdiff"] = (d1.float() - d2.float()).abs().max().item()
    r["bwd_scale"] = d1.float().abs().max().item()
    if name == "gate_up":
        inv = torch.argsort(torch.argsort(idx, stable=True))  # not exact routing, only timing
        dxa = gmm(dy, Waug, offs=offs)
        dxc = gmm(dy, W, offs=offs)
        r["sum_pairs_contig"] = t(lambda: sum_pairs(dxc, inv, K))
        r["sum_pairs_strided"] = t(lambda: sum_pairs(dxa[:, :C], inv, K))
    res[name] = r
    print(name, json.dumps(r, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "aug_micro.json"), "w"), indent=1)

# dense q/k/v: three projections (+ LoRA, as PEFT/ours run them) against one fused projection
Tq, H, Nq, Nkv = 8192, 2048, 4096, 512
x = torch.randn(Tq, H, device=dev, dtype=dt)
Ws = [torch.randn(n, H, device=dev, dtype=dt) * 0.02 for n in (Nq, Nkv, Nkv)]
As = [torch.randn(R, H, device=dev, dtype=dt) * 0.02 for _ in range(3)]
Bs = [torch.randn(n, R, device=dev, dtype=dt) * 0.02 for n in (Nq, Nkv, Nkv)]
Wf = torch.cat(Ws); Af = torch.cat(As)
dys = [torch.randn(Tq, n, device=dev, dtype=dt) for n in (Nq, Nkv, Nkv)]
dyf = torch.cat(dys, dim=1)
def q_sep():
    outs = []
    for W, A, B in zip(Ws, As, Bs):
        y = x @ W.T
        y.addmm_(x @ A.T, B.T, alpha=2.0)
        outs.append(y)
    return outs
def q_fused():
    y = x @ Wf.T
    xa = x @ Af.T
    for j, (B, lo, hi) in enumerate(((Bs[0], 0, Nq), (Bs[1], Nq, Nq + Nkv), (Bs[2], Nq + Nkv, Nq + 2 * Nkv))):
        y[:, lo:hi].addmm_(xa[:, j * R:(j + 1) * R], B.T, alpha=2.0)
    return y
def qb_sep():
    dx = None
    for W, A, B, dy in zip(Ws, As, Bs, dys):
        d = dy @ W
        d.addmm_(dy @ B, A, alpha=2.0)
        dx = d if dx is None else dx + d
    return dx
def qb_fused():
    dx = dyf @ Wf
    dyb = torch.cat([dy @ B for dy, B in zip(dys, Bs)], dim=1)
    return dx.addmm_(dyb, Af, alpha=2.0)
rq = {k: t(v) for k, v in dict(q_sep=q_sep, q_fused=q_fused, qb_sep=qb_sep, qb_fused=qb_fused).items()}
print("qkv", json.dumps(rq, indent=1))
res["qkv"] = rq
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "aug_micro.json"), "w"), indent=1)
