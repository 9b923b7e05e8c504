"""``model.quantization=mxfp4``: gpt-oss's frozen MoE experts kept in MXFP4 (`lightning_ft.kernels.mxfp4`).

Each experts module (gpt-oss's layout, `lightning_ft.model.moe`) keeps ``gate_up_proj`` and ``down_proj`` as
buffers in the checkpoint's own layout and names, ``<name>_blocks`` [E, N, C/32, 16] and ``<name>_scales``
[E, N, C/32] uint8 (N the output, C the input size: the stored [E, C, N] weight transposed), ~0.53 bytes per
weight instead of bf16's 2. The parameter itself stays, as a placeholder: a zero-stride view of one element of
the dense shape and dtype (2 bytes), because PEFT's ``target_parameters`` reads its shape, device and dtype to
build the experts' LoRA; nothing computes with it (the patched MoE block reads the buffers, `mxfp4_weight`).
Everything else stays in ``model.dtype``.

- An MXFP4 checkpoint (``quantization_config.quant_method: mxfp4``, gpt-oss's published ones) loads its
  blocks and scales as they are (`keeping_mxfp4`: transformers' dequantising load op keeps them instead);
- a random init or a 16/32-bit checkpoint is quantised after loading (`quantize_experts`, OCP rounding).

The experts run on the ``triton`` or ``grouped_mm`` MoE backend, which dequantises each weight whole into a reused
buffer right before each of its GEMMs (forward and input gradient; the frozen experts get no weight gradient;
`lightning_ft.kernels.mxfp4.dequantize_mxfp4`). ``export --merge`` writes
dense experts (`dequantize_experts`). Caveat: casting the model to another dtype (``model.to``) materialises
each placeholder at its dense size (zeros, still unread): build the model in the dtype it trains in.

Sources: transformers 5 ``integrations/mxfp4.py`` (``Mxfp4Dequantize``, the checkpoint names and layout) and
``quantizers/quantizer_mxfp4.py`` (``get_load_operations``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from lightning_ft.kernels.mxfp4 import Mxfp4Weight, quantize_mxfp4

__all__ = [
    "dequantize_experts", "experts_bytes", "gpt_oss_experts", "keep_dense", "keep_placeholder", "keeping_mxfp4", "mxfp4_weight", "no_mxfp4_experts",
    "quantize_experts",
]

_PROJECTIONS = ("gate_up_proj", "down_proj")


def gpt_oss_experts(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts modules of gpt-oss's layout (transposed [E, C, N] weights with biases) in ``model``."""
    return [m for m in model.modules() if getattr(m, "is_transposed", False) and all(hasattr(m, p) for p in _PROJECTIONS)
            and getattr(m, "has_bias", False)]


def _keep(experts: torch.nn.Module, name: str, blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> None:
    """Hold ``experts.<name>`` as MXFP4 buffers (uint8, on the blocks' device) and a zero-stride placeholder parameter."""
    shape = (blocks.shape[0], blocks.shape[2] * 32, blocks.shape[1])  # the stored [E, C, N]
    experts.register_buffer(f"{name}_blocks", blocks.to(torch.uint8).contiguous())
    experts.register_buffer(f"{name}_scales", scales.to(torch.uint8).contiguous())
    keep_placeholder(experts, name, shape, dtype, blocks.device)


def keep_dense(experts: torch.nn.Module, name: str, dense: torch.Tensor, parts: tuple[str, ...]) -> None:
    """Set ``experts.<name>`` to the frozen parameter ``dense`` (made contiguous) in place of its placeholder, and drop
    the quantised weight's buffers ``<name>_<part>``."""
    for part in parts:
        delattr(experts, f"{name}_{part}")
    setattr(experts, name, torch.nn.Parameter(dense.contiguous(), requires_grad=False))


def keep_placeholder(experts: torch.nn.Module, name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
    """Set ``experts.<name>`` to a frozen placeholder of a quantised weight: a zero-stride view of one element of the
    dense ``shape`` and ``dtype`` (2 bytes in bf16), which PEFT's ``target_parameters`` reads (also for NF4 experts,
    `lightning_ft.model.nf4_experts`)."""
    placeholder = torch.zeros((), dtype=dtype, device=device).expand(shape)
    setattr(experts, name, torch.nn.Parameter(placeholder, requires_grad=False))


def no_mxfp4_experts(name: str) -> ValueError:
    """The error for ``model.quantization=mxfp4`` on ``name`` (a model class or ``model_type``) without gpt-oss experts."""
    return ValueError(f"model.quantization=mxfp4 is for gpt-oss's MoE experts (model_type gpt_oss), which {name} does "
                      "not have: use model.quantization=none (or nf4: the linear layers, and MoE experts on "
                      "moe.backend=triton or grouped_mm)")


def quantize_experts(model: torch.nn.Module) -> int:
    """Quantise every gpt-oss experts weight of ``model`` (a model, or one experts module) to MXFP4 in place (one
    weight at a time); returns how many.

    Raises:
        ValueError: no gpt-oss experts in ``model`` (``model.quantization=mxfp4`` is for gpt-oss), or a weight whose
            input size is not a multiple of 32.
    """
    modules = gpt_oss_experts(model)
    if not modules:
        raise no_mxfp4_experts(type(model).__name__)
    count = 0
    for experts in modules:
        for name in _PROJECTIONS:
            if hasattr(experts, f"{name}_blocks"):
                continue
            weight = getattr(experts, name).detach()
            blocks, scales = quantize_mxfp4(weight.transpose(1, 2))  # quantised along C, as the checkpoints are
            dtype = weight.dtype
            del weight
            _keep(experts, name, blocks, scales, dtype)
            count += 1
    return count


def mxfp4_weight(experts: torch.nn.Module, name: str) -> Mxfp4Weight | None:
    """``experts.<name>`` as the [E, N, C] `Mxfp4Weight` the backends read (the stored weight transposed), or
    None where it is dense. Its compute dtype is the placeholder's (the model's dtype)."""
    blocks = getattr(experts, f"{name}_blocks", None)
    if blocks is None:
        return None
    return Mxfp4Weight.from_checkpoint(blocks, getattr(experts, f"{name}_scales"), getattr(experts, name).dtype)


def experts_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the experts' weights hold: MXFP4 blocks and scales, or the dense parameters (placeholders' one element);
    bytes they would hold dense in their compute dtype); (0, 0) for none."""
    held = dense = 0
    for experts in gpt_oss_experts(model):
        for name in _PROJECTIONS:
            weight = getattr(experts, name)
            for tensor in (weight, getattr(experts, f"{name}_blocks", None), getattr(experts, f"{name}_scales", None)):
                if tensor is not None:
                    held += tensor.untyped_storage().nbytes()
            dense += weight.numel() * weight.element_size()  # a placeholder has the dense shape and dtype
    return held, dense


def dequantize_experts(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every MXFP4 experts weight by its dense parameter (exact, in ``dtype`` or the placeholder's), frozen as
    it was, and drop the buffers: ``save_pretrained`` then writes a plain checkpoint. Returns how many (0: none)."""
    count = 0
    for experts in gpt_oss_experts(model):
        for name in _PROJECTIONS:
            weight = mxfp4_weight(experts, name)
            if weight is None:
                continue
            dense = weight._replace(dtype=dtype or weight.dtype, transposed=True).dequantize()  # the stored [E, C, N]
            keep_dense(experts, name, dense, ("blocks", "scales"))
            count += 1
    return count


@contextlib.contextmanager
def keeping_mxfp4() -> Iterator[None]:
    """Within: an MXFP4 checkpoint loaded with ``Mxfp4Config(dequantize=True)`` keeps its experts' blocks and scales
    (`_keep`, on the device they load to) instead of dequantising them; the rest of transformers' load is its own."""
    from transformers.integrations.mxfp4 import Mxfp4Dequantize
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer
    from transformers.quantizers.quantizers_utils import get_module_from_name

    class _KeepMxfp4(Mxfp4Dequantize):
        def convert(self, input_dict, model=None, full_layer_name=None, missing_keys=None, **kwargs):
            proj = "gate_up_proj" if "gate_up_proj" in full_layer_name else "down_proj"
            blocks, scales = (input_dict[f"{proj}_{part}"] for part in ("blocks", "scales"))
            blocks, scales = (t[0] if isinstance(t, list) else t for t in (blocks, scales))
            module, tensor_name = get_module_from_name(model, full_layer_name)
            dtype = getattr(module, tensor_name).dtype
            _keep(module, tensor_name, blocks, scales, dtype)
            return {full_layer_name: getattr(module, tensor_name)}

    original = Mxfp4HfQuantizer.get_load_operations
    Mxfp4HfQuantizer.get_load_operations = lambda self: {**original(self), "dequantize": _KeepMxfp4}
    try:
        yield
    finally:
        Mxfp4HfQuantizer.get_load_operations = original
