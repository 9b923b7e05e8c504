"""fp8 frozen base weights (``strategy.fp8``): the base ``nn.Linear`` of every PEFT LoRA layer held in e4m3.

`convert_to_fp8` replaces each such base layer by an `Fp8Linear` holding its weight in e4m3 with one
fp32 scale per output channel (`lightning_ft.kernels.fp8.quantize_weight`); the bf16 weight is
freed, so those weights take half the memory. LoRA A/B, norms, routers, embeddings and every other
module stay as they are; the frozen lm_head too unless ``strategy.fp8_lm_head`` (`convert_lm_head_to_fp8`). PEFT's ``lora.Linear`` calls its base layer as before (the
stock forward works), and the fused LoRA forward (`lightning_ft.kernels.lora.lora_linear`, kernel
switch ``lora``) computes the base product with `lightning_ft.kernels.fp8.fp8_linear`. The adapter
file is PEFT's and holds LoRA weights only, so an adapter trained over the fp8 base loads with
``peft.PeftModel.from_pretrained`` on the bf16 base.

The e4m3 bytes and the fp32 scales are kept as ``uint8`` and ``int32`` tensors (viewed as e4m3 and
fp32 for each product, no copy): a precision plugin's or a user's ``model.to(dtype)`` converts
floating-point tensors only, and would otherwise turn the scaled e4m3 values into wrong bf16 weights
(and the scales into bf16, which ``torch._scaled_mm`` refuses) without a word. They are parameters
that need no gradient, not buffers: DDP broadcasts every buffer from rank 0 before each forward
(``broadcast_buffers``), which would send the whole base each step; frozen parameters it syncs
once, when it wraps the model.

A 4-bit base (``model.quantization=nf4``: bitsandbytes' ``Linear4bit``) stays in 4 bits and computes in fp8
(`convert_4bit_to_fp8`): its e4m3 row scales, amax(|row|) / 448 of its dequantised weight, are computed once (one
transient fp32 copy of one weight at a time) and kept on the layer as the frozen int32-bits parameter
``fp8_scale_bits`` (`fp8_scale_4bit` views it as fp32), for the same reasons as above; the fused LoRA forward
(`lightning_ft.kernels.qlora.qlora_linear` with ``fp8_scale``) dequantises the weight straight to e4m3 with them
before each fp8 product. Only the fused forward reads them: a layer it does not serve (LoRA dropout, DoRA, a LoRA
bias) gets none and computes in the model's dtype (`convert_4bit_to_fp8` counts it), and ``kernels.lora=false``
is refused with the pair (`lightning_ft.model.build`). NF4 MoE experts keep computing in the model's dtype.

MoE experts (`convert_expert_weight`, called for every frozen expert weight with PEFT's split LoRA by
`lightning_ft.model.moe.convert_experts_to_fp8`): each 3-D weight, as the [E, N, C] the backends read, in
e4m3 with one fp32 scale per expert (`lightning_ft.kernels.fp8.Fp8ExpertWeight` says why not per channel), kept on
the experts module as the frozen parameters ``<name>_fp8`` (uint8 [E, N, C]) and ``<name>_fp8_scale`` (int32 bits
of fp32 [E]); the dense parameter
stays as a placeholder of its shape and dtype (a zero-stride view of one element, as PEFT reads them; nothing
computes with it). The ``triton`` and ``grouped_mm`` MoE backends read them (`fp8_expert_weight`) in our grouped
GEMM's fp8 path (`lightning_ft.kernels.moe.grouped_gemm.grouped_gemm`; ``grouped_mm`` around it keeps its
orchestration: kept activations, fused thin LoRA products, no LoRA slots), eager or replayed from CUDA graphs:
with ``hf`` or ``native_torch`` the experts stay in bf16 (`fp8_experts_blocker` says why). ``export --merge`` builds
the bf16 base again, so the adapter is merged into the weights the fp8 ones were quantised from, as for the
linear layers.

The products run through ``torch._scaled_mm`` on CUDA of compute capability 9.0+ (Hopper);
`check_fp8_device` refuses anything else for a run, while the plain-torch reference of the same
math runs anywhere (the tests use it on the CPU).
"""

from __future__ import annotations

import torch

from lightning_ft.kernels.fp8 import (
    E4M3, Fp8ExpertWeight, fp8_linear, fp8_rows_of, quantize_expert_weight, quantize_weight, scaled_mm_shape,
)
from lightning_ft.kernels.moe import QUANTISED_EXPERT_BACKENDS
from lightning_ft.kernels.nf4 import e4m3_scales_4bit

__all__ = [
    "Fp8Linear", "check_fp8_device", "convert_4bit_to_fp8", "convert_expert_weight", "convert_lm_head_to_fp8", "convert_to_fp8",
    "fp8_expert_weight", "fp8_experts_blocker", "fp8_scale_4bit",
]  # fmt: skip


class Fp8Linear(torch.nn.Module):
    """A frozen ``nn.Linear`` with its weight in e4m3 and per-output-channel fp32 scales.

    Args:
        linear: the layer to convert (its weight is quantised with `quantize_weight`; its bias, if any,
            is kept as it is, frozen).

    Attributes:
        weight_bytes: [N, K] uint8, the e4m3 bits (`weight_fp8` views them as e4m3); a frozen parameter.
        scale_bits: [N] int32, the fp32 bits of the scales (`weight_scale` views them); a frozen parameter.
        bias: the original bias Parameter (frozen) or None.
    """

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_weight(linear.weight)
        self.weight_bytes = torch.nn.Parameter(weight.view(torch.uint8), requires_grad=False)
        self.scale_bits = torch.nn.Parameter(scale.view(torch.int32), requires_grad=False)
        self.bias = linear.bias
        if self.bias is not None:
            self.bias.requires_grad_(False)

    @property
    def weight_fp8(self) -> torch.Tensor:
        """[N, K] e4m3 view of `weight_bytes`."""
        return self.weight_bytes.view(E4M3)

    @property
    def weight_scale(self) -> torch.Tensor:
        """[N] fp32 view of `scale_bits`: the per-output-channel scales."""
        return self.scale_bits.view(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x Wᵀ + b`` through `lightning_ft.kernels.fp8.fp8_linear` ([..., K] → [..., N]), over x's fp8 rows where
        the kernel that wrote x left them (`lightning_ft.kernels.fp8.fp8_rows_of`)."""
        return fp8_linear(x, self.weight_fp8, self.weight_scale, self.bias, fp8_rows_of(x))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, e4m3"


def convert_to_fp8(model: torch.nn.Module) -> int:
    """Convert the frozen base ``nn.Linear`` of every PEFT ``lora.Linear`` in ``model`` to `Fp8Linear`, in place.

    A base layer whose weight or bias trains is left as it is. Returns the number converted.
    """
    from peft.tuners.lora.layer import Linear as LoraLinear

    count = 0
    for module in model.modules():
        if isinstance(module, LoraLinear) and type(base := module.base_layer) is torch.nn.Linear:
            if base.weight.requires_grad or (base.bias is not None and base.bias.requires_grad):
                continue
            module.base_layer = Fp8Linear(base)
            count += 1
    return count


def convert_lm_head_to_fp8(model: torch.nn.Module) -> str:
    """Hold the frozen lm_head of ``model`` (a transformers model, or a PEFT model around one) in e4m3
    (``strategy.fp8_lm_head``): its output embeddings become an `Fp8Linear`, in place. The chunked linear
    cross-entropy then computes the logits and their input gradient as fp8 products
    (`lightning_ft.kernels.linear_cross_entropy.fused_linear_cross_entropy` with ``weight_scale``); without it the
    logits come from `Fp8Linear`'s forward. A head that is not a plain ``nn.Linear``, that trains (PEFT's
    ``modules_to_save`` wraps it), whose weight is the input embeddings' (tied: the embedding lookup reads it), or
    that ``torch._scaled_mm`` cannot take (not bf16, or a vocabulary or hidden size that is not a multiple of 16:
    the fp32 reference over the dequantised head would cost more memory than the bf16 head) stays as it is.

    Returns:
        the start-log line saying what was done, or why not.
    """
    hf = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = hf.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"fp8: the lm_head stays as it is ({type(head).__name__}, not a frozen nn.Linear: lora.modules_to_save trains it)"
    if head.weight.requires_grad:
        return "fp8: the lm_head stays as it is (it trains)"
    embeddings = hf.get_input_embeddings()
    if embeddings is not None and getattr(embeddings, "weight", None) is head.weight:
        return "fp8: the lm_head stays as it is (tied to the input embeddings, which the lookup reads in full precision)"
    if head.weight.dtype != torch.bfloat16 or not scaled_mm_shape(head.weight):
        # elsewhere the products would run fp8_linear's fp32 reference over the whole dequantised head: more memory
        return (f"fp8: the lm_head stays as it is (its fp8 GEMMs need a bf16 head of dims that are multiples of 16; it is "
                f"{str(head.weight.dtype).removeprefix('torch.')} {head.out_features} × {head.in_features})")
    hf.set_output_embeddings(Fp8Linear(head))
    return f"fp8: the lm_head ({head.out_features} × {head.in_features}) in e4m3, per-output-channel scales"


_SCALE_4BIT = "fp8_scale_bits"  # on a 4-bit base layer: int32 [N], the bits of its fp32 e4m3 row scales


def convert_4bit_to_fp8(model: torch.nn.Module) -> tuple[int, int]:
    """Compute the e4m3 row scales of the 4-bit base (bitsandbytes' ``Linear4bit``) of every PEFT LoRA layer whose
    adapters the fused LoRA forward serves (`lightning_ft.model.lora.lora_linear_adapters`), in place, one weight at
    a time (module docstring); layers that already have them are skipped.

    Returns:
        (the number of base weights given scales, the number of 4-bit bases under LoRA left in the model's dtype:
        the fused forward does not serve their adapters).
    """
    from peft.tuners.lora import LoraLayer

    from lightning_ft.model.lora import lora_linear_adapters
    from lightning_ft.model.quantization import quant4bit_weight

    count = left = 0
    for module in model.modules():
        if not isinstance(module, LoraLayer) or (weight := quant4bit_weight(base := module.get_base_layer())) is None:
            continue
        if len(weight.shape) != 2 or not lora_linear_adapters(module):
            left += 1
        elif fp8_scale_4bit(base) is None:
            scale = e4m3_scales_4bit(weight)
            base.register_parameter(_SCALE_4BIT, torch.nn.Parameter(scale.view(torch.int32), requires_grad=False))
            count += 1
    return count, left


def fp8_scale_4bit(layer: torch.nn.Module) -> torch.Tensor | None:
    """The [N] fp32 e4m3 row scales `convert_4bit_to_fp8` left on a 4-bit base layer, or None (it computes in the
    model's dtype)."""
    bits = getattr(layer, _SCALE_4BIT, None)
    return None if bits is None else bits.view(torch.float32)


def convert_expert_weight(experts: torch.nn.Module, name: str, transposed: bool) -> None:
    """Hold the frozen 3-D weight ``experts.<name>`` in e4m3 (module docstring), in place; the dense weight is freed.

    Args:
        experts: the experts module (transformers' layout: ``gate_up_proj`` / ``down_proj``).
        name: the parameter's name.
        transposed: the parameter is stored [E, C, N] (gpt-oss's layout); quantised as its [E, N, C] transpose.
    """
    weight = getattr(experts, name)
    shape, dtype = weight.shape, weight.dtype
    values, scales = quantize_expert_weight(weight.transpose(1, 2) if transposed else weight)
    del weight
    setattr(experts, f"{name}_fp8", torch.nn.Parameter(values.view(torch.uint8), requires_grad=False))
    setattr(experts, f"{name}_fp8_scale", torch.nn.Parameter(scales.view(torch.int32), requires_grad=False))
    placeholder = torch.zeros((), dtype=dtype, device=values.device).expand(shape)
    setattr(experts, name, torch.nn.Parameter(placeholder, requires_grad=False))


def fp8_expert_weight(experts: torch.nn.Module, name: str) -> Fp8ExpertWeight | None:
    """``experts.<name>`` as the [E, N, C] `Fp8ExpertWeight` the triton backend reads (`convert_expert_weight`), or
    None where it is not in fp8. Its compute dtype is the placeholder's (the model's dtype)."""
    values = getattr(experts, f"{name}_fp8", None)
    if values is None:
        return None
    scales = getattr(experts, f"{name}_fp8_scale").view(torch.float32)
    return Fp8ExpertWeight(values.view(E4M3), scales, getattr(experts, name).dtype)


def fp8_experts_blocker(backend: str) -> str | None:
    """Why the MoE experts under LoRA cannot be held in fp8 with this ``moe.backend`` (resolved), naming the setting
    that would allow it; None where they can (``triton`` or ``grouped_mm``, with or without CUDA graphs)."""
    if backend not in QUANTISED_EXPERT_BACKENDS:
        return f"only moe.backend=triton or grouped_mm reads fp8 experts (moe.backend={backend}): set moe.backend=triton"
    return None


def check_fp8_device(device: torch.device) -> None:
    """Refuse ``strategy.fp8=true`` on a device without row-wise fp8 GEMMs.

    Raises:
        ValueError: ``device`` is not CUDA of compute capability 9.0 or newer, naming the device found.
    """
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) >= (9, 0):
            return
        found = f"{torch.cuda.get_device_name(device)} (sm{major}{minor})"
    else:
        found = str(device)
    raise ValueError(
        f"strategy.fp8=true needs an NVIDIA GPU of compute capability 9.0 or newer (Hopper, sm90+: row-wise fp8 "
        f"GEMMs through torch._scaled_mm); found {found}: set strategy.fp8=false"
    )
