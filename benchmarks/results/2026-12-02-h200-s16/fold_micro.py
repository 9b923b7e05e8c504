"""One storage [E, N+R, C+R]: W at [:N, :C], B at [:N, C:], A at [N:, :C]; forward K-folds B, backward K-folds A."""
import json, os, torch
from lightning_ft.kernels.moe.grouped_gemm import _GROUPED_MM as gmm, grouped_gemm, _add_thin_grouped
torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
E, T, K, D, I, R = 128, 8192, 8, 2048, 768, 16
S = T * K
idx = torch.randn(T, E, device=dev).topk(K, dim=-1).indices.reshape(-1)
offs = torch.bincount(idx, minlength=E).cumsum(0).to(torch.int32)
def t(fn, reps=20):
    fn(); torch.cuda.synchronize(); torch.cuda._sleep(10_000_000)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(reps): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / reps * 1e3
res = {}
for name, C, N in (("gate_up", D, 2 * I), ("down", I, D)):
    W = torch.randn(E, N, C, device=dev, dtype=dt) * 0.02
    A = torch.randn(E, R, C, device=dev, dtype=dt) * 0.02
    B = torch.randn(E, N, R, device=dev, dtype=dt) * 0.02
    big = torch.zeros(E, N + R, C + R, device=dev, dtype=dt)
    big[:, :N, :C] = W; big[:, :N, C:] = B; big[:, N:, :C] = A
    Wv = big[:, :N, :C]
    fwd_w = big[:, :N, :]          # [E, N, C+R]
    bwd_w = big[:, :, :C]          # [E, N+R, C]
    x = torch.randn(S, C, device=dev, dtype=dt)
    xaug = torch.empty(S, C + R, device=dev, dtype=dt); xaug[:, :C] = x
    xaug[:, C:] = grouped_gemm(x, A.transpose(1, 2), offs, S).mul_(2.0)
    dy = torch.randn(S, N, device=dev, dtype=dt)
    dyaug = torch.empty(S, N + R, device=dev, dtype=dt); dyaug[:, :N] = dy
    r = {}
    r["f_cur"] = t(lambda: _add_thin_grouped(gmm(x, W.transpose(1, 2), offs=offs), xaug[:, C:], B.transpose(1, 2), offs))
    r["f_fold_bigview"] = t(lambda: gmm(xaug, fwd_w.transpose(1, 2), offs=offs))
    r["f_base_strided_w"] = t(lambda: gmm(x, Wv.transpose(1, 2), offs=offs))
    r["b_cur"] = t(lambda: _add_thin_grouped(gmm(dy, W, offs=offs), grouped_gemm(dy, B, offs, S).mul_(2.0), A, offs))
    def b_fold():
        dyaug[:, N:] = grouped_gemm(dyaug[:, :N], B, offs, S).mul_(2.0)
        return gmm(dyaug, bwd_w, offs=offs)
    r["b_fold"] = t(b_fold)
    r["b_base_strided_w"] = t(lambda: gmm(dy, Wv, offs=offs))
    r["b_base"] = t(lambda: gmm(dy, W, offs=offs))
    r["dyb_strided"] = t(lambda: grouped_gemm(dyaug[:, :N], B, offs, S))
    r["dyb"] = t(lambda: grouped_gemm(dy, B, offs, S))
    ref_f = _add_thin_grouped(gmm(x, W.transpose(1, 2), offs=offs), xaug[:, C:], B.transpose(1, 2), offs).float()
    got_f = gmm(xaug, fwd_w.transpose(1, 2), offs=offs).float()
    ref_b = _add_thin_grouped(gmm(dy, W, offs=offs), grouped_gemm(dy, B, offs, S).mul_(2.0), A, offs).float()
    got_b = b_fold().float()
    exact_f = torch.cat([xaug[a:b].float() @ fwd_w[e].float().T for e, (a, b) in enumerate(zip([0] + offs[:-1].tolist(), offs.tolist()))])
    r["fwd_err_cur"] = (ref_f - exact_f).abs().max().item(); r["fwd_err_fold"] = (got_f - exact_f).abs().max().item()
    r["bwd_maxdiff"] = (ref_b - got_b).abs().max().item(); r["bwd_scale"] = ref_b.abs().max().item()
    r["strided_base_ok"] = bool(torch.equal(gmm(x, Wv.transpose(1, 2), offs=offs), gmm(x, W.transpose(1, 2), offs=offs))) and bool(torch.equal(gmm(dy, Wv, offs=offs), gmm(dy, W, offs=offs)))
    res[name] = r
    print(name, json.dumps(r, indent=1), flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "fold_micro.json"), "w"), indent=1)
