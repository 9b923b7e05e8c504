"""QLoRA linear layer: ``y = x Wᵀ + b + s · (x Aᵀ) Bᵀ`` with W stored in 4 bits (bitsandbytes' layout).

The frozen base weight is dequantised (`lightning_ft.kernels.nf4.dequantize_4bit`) into a buffer reused
by every layer right before its GEMM, in the forward and again in the backward for x's gradient, so one
dense weight exists at a time and none is saved for the backward (a custom autograd.Function: autograd
would save the buffer, which the next layer overwrites). The products are those of
`lightning_ft.kernels.lora.lora_linear`:

    forward   W = dequant(W4)    y = x Wᵀ + b    h = x Aᵀ    y += s · h Bᵀ   (in the last GEMM's epilogue)
    backward  dh = s · dy B      dA = dhᵀ x      dB = s · dyᵀ h
              W = dequant(W4)    dx = dh A;  dx += dy W                        (in the base GEMM's epilogue)

all in the compute dtype (the autocast dtype under autocast, else x's), A and B cast to it as autocast
casts them (their gradients flow back to PEFT's fp32 parameters through the cast). The reference,
PEFT's ``lora.bnb.Linear4bit`` over bitsandbytes' ``matmul_4bit``, computes the same products with the
weight from bitsandbytes' ``dequantize_4bit`` (bitwise ours) and rounds the sums once more, so bf16
results agree to bf16 rounding. Frozen base weight and bias; no LoRA dropout (the caller,
`lightning_ft.model.lora`, checks).

fp8 compute (``fp8_scale``, ``strategy.fp8`` over a 4-bit base): the weight is dequantised straight to e4m3 with
its static per-output-channel scales sw (`lightning_ft.kernels.nf4.e4m3_scales_4bit`, computed once) into the
reused e4m3 buffer (half the bytes of the bf16 one), and the base product is `lightning_ft.kernels.fp8`'s:

    forward   Wq = dequant_e4m3(W4, sw)     y = (xq Wqᵀ) · sx · sw + b     (xq, sx: x's fp8 rows)
    backward  Wq = dequant_e4m3(W4, sw)     dx = dh A + fp8_input_grad(dy, Wq, sw)

x's fp8 rows are those the kernel that wrote x left on it (`lightning_ft.kernels.fp8.fp8_rows_of`: RMSNorm,
SwiGLU) or `quantize_rows` of x; the LoRA terms stay in the compute dtype; no dense weight in the compute dtype
is written. Wq · sw is bitwise ``quantize_rows`` of the fp32 dequantisation, so the products are those of an
`lightning_ft.strategies.fp8.Fp8Linear` made from that weight: ~3.5% relative (Frobenius) from the bf16 QLoRA
product on random data, bounded at 8% in the tests for the output and x's gradient (`lightning_ft.kernels.fp8`).

Source of the method: QLoRA, Dettmers et al. 2023 (arXiv:2305.14314); the dequantise-then-GEMM
scheme with a reused buffer is Unsloth's ``fast_dequantize`` + ``matmul_lora``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lightning_ft.kernels.fp8 import E4M3, fp8_input_grad, fp8_product, fp8_rows_of, quantize_rows
from lightning_ft.kernels.lora import lora_linear_reference
from lightning_ft.kernels.nf4 import Quant4bitWeight, dequantize_4bit, dequantize_4bit_reference

__all__ = ["qlora_linear", "qlora_linear_reference"]


def qlora_linear_reference(
    x: torch.Tensor, weight: Quant4bitWeight, bias: torch.Tensor | None, lora_A: torch.Tensor, lora_B: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Plain-torch reference: `lora_linear_reference` on the reference dequantisation of ``weight`` in x's dtype."""
    return lora_linear_reference(x, dequantize_4bit_reference(weight, x.dtype), bias, lora_A, lora_B, scaling)


def qlora_linear(
    x: torch.Tensor,
    weight: Quant4bitWeight,
    bias: torch.Tensor | None,
    lora_A: torch.Tensor,
    lora_B: torch.Tensor,
    scaling: float,
    fp8_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """A LoRA linear layer on a 4-bit frozen base weight, ``x Wᵀ + b + scaling · (x Aᵀ) Bᵀ``.

    Args:
        x: [..., K] input.
        weight: the [N, K] base weight in 4 bits (`Quant4bitWeight`); bias: [N] frozen base bias or None.
        lora_A: [r, K] and lora_B: [N, r] adapter weights (fp32 in PEFT; cast to the compute dtype).
        scaling: PEFT's ``lora_alpha / r``.
        fp8_scale: [N] fp32 e4m3 row scales of ``weight`` (`lightning_ft.kernels.nf4.e4m3_scales_4bit`): the base
            product in fp8 (module docstring), over x's own fp8 rows where the kernel that wrote x left them; None:
            in the compute dtype.

    Returns:
        [..., N] in the compute dtype: the autocast dtype under autocast, else x's.

    Raises:
        ValueError: ``weight`` is not 2-D or its K is not x's last dimension; ``fp8_scale`` is not [N].
    """
    if len(weight.shape) != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"qlora_linear: a [N, K] weight with K = {x.shape[-1]} expected, got shape {weight.shape}")
    device = x.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    x_rows = None
    if fp8_scale is not None:  # x's rows in its own dtype, as fp8_linear quantises them
        x_rows = fp8_rows_of(x)
        x_rows = x_rows if x_rows is not None else quantize_rows(x.detach().reshape(-1, x.shape[-1]))
    x2 = x.reshape(-1, x.shape[-1]).to(dtype)
    bias = bias.to(dtype) if bias is not None else None
    with torch.autocast(device, enabled=False):
        y = _QLoRALinear.apply(x2, weight, bias, lora_A.to(dtype), lora_B.to(dtype), scaling, fp8_scale, x_rows)
    return y.view(*x.shape[:-1], y.shape[-1])


def _base_weight(weight: Quant4bitWeight, dtype: torch.dtype, fp8_scale: torch.Tensor | None) -> torch.Tensor:
    """The dequantised base weight in the reused buffer: in ``dtype``, or in e4m3 with ``fp8_scale``."""
    return dequantize_4bit(weight, dtype) if fp8_scale is None else dequantize_4bit(weight, E4M3, fp8_scale=fp8_scale)


class _QLoRALinear(torch.autograd.Function):
    """`qlora_linear` on [T, K] operands in one dtype (see the module docstring); saves x, h, A and B, not W."""

    @staticmethod
    def forward(ctx, x, weight, bias, lora_A, lora_B, scaling, fp8_scale, x_rows):
        base = _base_weight(weight, x.dtype, fp8_scale)
        y = F.linear(x, base, bias) if fp8_scale is None else fp8_product(x, base, fp8_scale, bias, x.dtype, x_rows)
        h = F.linear(x, lora_A)
        y.addmm_(h, lora_B.t(), alpha=scaling)
        ctx.weight, ctx.scaling = weight, scaling
        ctx.save_for_backward(x, h, lora_A, lora_B, fp8_scale)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h, lora_A, lora_B, fp8_scale = ctx.saved_tensors
        needs_x, _, _, needs_a, needs_b = ctx.needs_input_grad[:5]
        dx = da = db = None
        if needs_x or needs_a:
            dh = (dy @ lora_B) * ctx.scaling
            if needs_a:
                da = dh.t() @ x
            if needs_x:
                base = _base_weight(ctx.weight, dy.dtype, fp8_scale)
                if fp8_scale is None:
                    dx = (dh @ lora_A).addmm_(dy, base)
                else:  # the fp8 product first (``_scaled_mm`` adds into no output); the thin one adds in its epilogue
                    dx = fp8_input_grad(dy, base, fp8_scale).to(dh.dtype).addmm_(dh, lora_A)
        if needs_b:
            db = (dy.t() @ h) * ctx.scaling
        return dx, None, None, da, db, None, None, None
