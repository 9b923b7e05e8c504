"""RoPE kernel vs HF's apply_rotary_pos_emb math, forward and backward, in place on HF's layouts.

q and k are built as HF builds them: transposed views of a projection's [B, T, H*D] output, so the
gradients checked are those reaching the projections. cos/sin come from packed position_ids with
one-token documents.

Tolerances (atol = rtol), kernel vs reference in the same dtype:
    fp32  1e-5
    bf16  2e-2  (the reference rounds q*cos and rotate_half(q)*sin to bf16 before the sum)
Under the CPU interpreter bf16 sits up to an ulp further: it truncates fp32 -> bf16 where the GPU
rounds to nearest even.
"""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lightning_ft.kernels import rope
from lightning_ft.kernels.rope import apply_rope, rope_reference

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
PACKED_POSITIONS = [0, 0, 1, 0, 1, 2, 3, 0, 0, 1, 2]  # documents of length 1, 2, 4, 1, 3


def _cos_sin(position_ids, rot, dtype):
    """HF's default rotary tables: cat(freqs, freqs) at each token's position."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rot, 2, dtype=torch.float32, device=position_ids.device) / rot))
    freqs = position_ids[..., None].float() * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _projections(batch, seq_len, heads_q, heads_k, head_dim, dtype, device):
    torch.manual_seed(0)
    q_proj = torch.randn(batch, seq_len, heads_q * head_dim, dtype=dtype, device=device, requires_grad=True)
    k_proj = torch.randn(batch, seq_len, heads_k * head_dim, dtype=dtype, device=device, requires_grad=True)
    return q_proj, k_proj


def _run(fn, q_proj, k_proj, cos, sin, head_dim, dq, dk):
    """HF's attention prologue: project (here: an op on the leaf), view, transpose, rotate."""
    batch, seq_len = q_proj.shape[:2]
    q = (q_proj * 1).view(batch, seq_len, -1, head_dim).transpose(1, 2)
    k = (k_proj * 1).view(batch, seq_len, -1, head_dim).transpose(1, 2)
    q_out, k_out = fn(q, k, cos, sin)
    torch.autograd.backward((q_out, k_out), (dq, dk))
    grads = q_proj.grad, k_proj.grad
    q_proj.grad = k_proj.grad = None
    return q_out.detach(), k_out.detach(), *grads, q, k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "batch, seq_len, heads_q, heads_k, head_dim, rot, cos_batch",
    [
        (2, 11, 4, 2, 16, 16, 1),  # GQA, cos/sin broadcast over the batch (HF's [1, T, D])
        (1, 1, 3, 1, 24, 24, 1),  # T=1, odd head counts, half = 12 not a power of two
        (2, 11, 4, 4, 24, 8, 2),  # partial rotary, per-sequence cos/sin
        (1, 11, 8, 2, 128, 128, 1),  # Llama head_dim
    ],
)
def test_matches_reference(device, dtype, batch, seq_len, heads_q, heads_k, head_dim, rot, cos_batch):
    positions = torch.tensor(PACKED_POSITIONS[:seq_len], device=device).expand(cos_batch, seq_len)
    cos, sin = _cos_sin(positions, rot, dtype)
    q_proj, k_proj = _projections(batch, seq_len, heads_q, heads_k, head_dim, dtype, device)
    dq = torch.randn(batch, heads_q, seq_len, head_dim, dtype=dtype, device=device)
    dk = torch.randn(batch, heads_k, seq_len, head_dim, dtype=dtype, device=device)

    *outs, q, k = _run(apply_rope, q_proj, k_proj, cos, sin, head_dim, dq, dk)
    *refs, _, _ = _run(rope_reference, q_proj, k_proj, cos, sin, head_dim, dq, dk)
    for out, ref in zip(outs, refs, strict=True):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(q.detach(), outs[0])  # rotated in place, q itself came back
    assert torch.equal(k.detach(), outs[1])


@pytest.mark.parametrize("saved", ["q", "k"])
def test_in_place_and_autograd_still_checks_versions(device, saved):
    q_proj, k_proj = _projections(2, 5, 2, 1, 8, torch.float32, device)
    cos, sin = _cos_sin(torch.arange(5, device=device)[None], 8, torch.float32)
    q = (q_proj * 1).view(2, 5, 2, 8).transpose(1, 2)
    k = (k_proj * 1).view(2, 5, 1, 8).transpose(1, 2)
    x = q if saved == "q" else k
    saved_before = x * x  # an op that saves the pre-rotation q (or k) for its backward
    q_out, k_out = apply_rope(q, k, cos, sin)
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr()
    assert q_out.stride() == q.stride()  # the projection's [B, T, H, D] memory layout survives
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (saved_before.sum() + q_out.sum() + k_out.sum()).backward()


class _OpLog(TorchDispatchMode):
    """While active: the aten ops run outside the rope kernel, and the kernel's launches.

    `count_launches` must have wrapped the kernel first. The CPU interpreter runs aten ops of its
    own inside a launch; those are not recorded.
    """

    current = None

    def __init__(self):
        super().__init__()
        self.ops, self.launches, self.in_kernel = [], 0, False

    def __enter__(self):
        _OpLog.current = self
        return super().__enter__()

    def __exit__(self, *exc):
        _OpLog.current = None
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_kernel:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.fixture
def count_launches(monkeypatch):
    kernel = rope._rope_kernel

    class Counted:
        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                log = _OpLog.current
                log.launches += 1
                log.in_kernel = True
                try:
                    return kernel[grid](*args, **kwargs)
                finally:
                    log.in_kernel = False

            return launch

    monkeypatch.setattr(rope, "_rope_kernel", Counted())


# Ops that move no data: metadata-only views and AccumulateGrad taking the gradient as it is.
_NO_DATA_OPS = {"view", "_reshape_alias", "reshape", "transpose", "as_strided", "alias", "detach"}


@pytest.mark.parametrize("rot", [32, 16])  # full and partial rotary
def test_one_launch_per_pass_and_no_copies(device, count_launches, rot):
    """The benchmark's graph: leaf projections viewed and transposed as HF does, rotated, backward with
    gradients in the layout attention hands back ([B, T, H, D] memory, like the outputs). Forward: one
    launch, nothing allocated. Backward: one launch, two empty allocations, no fill, copy or clone
    anywhere (not in the projections' transpose/view backward nor in AccumulateGrad either)."""
    q_proj, k_proj = _projections(2, 5, 4, 2, 32, torch.bfloat16, device)
    cos, sin = _cos_sin(torch.tensor(PACKED_POSITIONS[:5], device=device)[None], rot, torch.bfloat16)
    q = q_proj.view(2, 5, 4, 32).transpose(1, 2)
    k = k_proj.view(2, 5, 2, 32).transpose(1, 2)
    with _OpLog() as fwd:
        q_out, k_out = apply_rope(q, k, cos, sin)
    dq, dk = torch.randn_like(q_out), torch.randn_like(k_out)
    assert dq.stride() == q_out.stride()
    upstream = dq.clone(), dk.clone()
    with _OpLog() as bwd:
        torch.autograd.backward((q_out, k_out), (dq, dk))

    assert fwd.launches == 1 and set(fwd.ops) <= _NO_DATA_OPS, fwd.ops
    assert bwd.launches == 1 and set(bwd.ops) <= _NO_DATA_OPS | {"empty_strided"}, bwd.ops
    assert bwd.ops.count("empty_strided") == 2, bwd.ops
    assert q_proj.grad.is_contiguous() and k_proj.grad.is_contiguous()
    assert torch.equal(dq, upstream[0]) and torch.equal(dk, upstream[1])  # incoming gradients untouched

    x_q = torch.zeros(2, 4, 5, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    x_k = torch.zeros(2, 2, 5, 32, dtype=torch.bfloat16, device=device, requires_grad=True)
    torch.autograd.backward(rope_reference(x_q, x_k, cos, sin), (dq, dk))
    tol = TOL[torch.bfloat16]
    torch.testing.assert_close(q_proj.grad.view(2, 5, 4, 32).transpose(1, 2), x_q.grad, atol=tol, rtol=tol)
    torch.testing.assert_close(k_proj.grad.view(2, 5, 2, 32).transpose(1, 2), x_k.grad, atol=tol, rtol=tol)


def test_tables_2d_and_mismatched_strides(device):
    """[T, D_rot] tables, and a sin whose row stride differs from cos's (both made contiguous)."""
    q_proj, k_proj = _projections(1, 11, 4, 2, 16, torch.float32, device)
    cos, sin = _cos_sin(torch.tensor(PACKED_POSITIONS, device=device), 16, torch.float32)
    sin_strided = torch.cat((sin, sin), dim=-1)[:, :16]
    assert sin_strided.stride() != cos.stride()
    dq, dk = torch.randn(1, 4, 11, 16, device=device), torch.randn(1, 2, 11, 16, device=device)
    *outs, _, _ = _run(apply_rope, q_proj, k_proj, cos, sin_strided, 16, dq, dk)
    *refs, _, _ = _run(rope_reference, q_proj, k_proj, cos[None], sin[None], 16, dq, dk)
    for out, ref in zip(outs, refs, strict=True):
        torch.testing.assert_close(out, ref, atol=TOL[torch.float32], rtol=TOL[torch.float32])


def test_head_dim_not_unit_stride(device):
    q_wide, k_wide = torch.randn(1, 2, 5, 32, device=device), torch.randn(1, 1, 5, 32, device=device)
    q, k = q_wide[..., ::2], k_wide[..., ::2]
    cos, sin = _cos_sin(torch.arange(5, device=device)[None], 16, torch.float32)
    q_ref, k_ref = rope_reference(q, k, cos, sin)
    q_out, k_out = apply_rope(q, k, cos, sin)
    torch.testing.assert_close(q_out, q_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_out, k_ref, atol=1e-5, rtol=1e-5)


def test_rejects_mismatched_tables(device):
    q, k = torch.randn(1, 2, 5, 16, device=device), torch.randn(1, 1, 5, 16, device=device)
    cos, sin = _cos_sin(torch.arange(4, device=device)[None], 16, torch.float32)
    with pytest.raises(ValueError, match="cos/sin"):
        apply_rope(q, k, cos, sin)


@pytest.mark.gpu
def test_no_host_sync():
    q_proj, k_proj = _projections(1, 8192, 32, 8, 128, torch.bfloat16, "cuda")
    cos, sin = _cos_sin(torch.arange(8192, device="cuda")[None], 128, torch.bfloat16)
    dq = torch.ones(1, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    dk = torch.ones(1, 8, 8192, 128, device="cuda", dtype=torch.bfloat16)
    _run(apply_rope, q_proj, k_proj, cos, sin, 128, dq, dk)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _run(apply_rope, q_proj, k_proj, cos, sin, 128, dq, dk)
    finally:
        torch.cuda.set_sync_debug_mode("default")
