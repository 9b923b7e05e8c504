"""``model.quantization=nf4`` with ``moe.backend=triton``: the frozen MoE experts in NF4 too (QLoRA for MoE).

bitsandbytes quantises ``nn.Linear`` layers only, so an MoE model's fused 3-D expert weights (transformers 5:
``gate_up_proj`` [E, 2I, D] and ``down_proj`` [E, D, I], or gpt-oss's transposed ones) would stay in 16 bits, and in
a model like Qwen3-30B-A3B they are nearly all of the weights. Here each one is quantised as bitsandbytes
quantises a linear layer's weight for QLoRA (``quantize_4bit(w, blocksize=64, compress_statistics=True,
quant_type="nf4")`` over the whole stored tensor: `lightning_ft.kernels.nf4.Nf4ExpertWeight`, ~0.52 bytes a
weight) and kept in four buffers of the experts module, ``<name>_nf4_packed`` / ``_absmax`` (uint8),
``_absmax2`` / ``_tables`` (fp32). The parameter itself stays as a 2-byte placeholder of the dense shape and
dtype (`lightning_ft.model.mxfp4.keep_placeholder`: PEFT's ``target_parameters`` reads it to build the experts'
LoRA; nothing computes with it). The triton MoE backend dequantises each weight whole into the reused 4-bit buffer
right before each of its grouped GEMMs (forward and input gradient; the frozen experts get no weight gradient) and
reads it dense there, so one expert weight at a time is dense; the other backends read dense weights, so with
them the experts stay in ``model.dtype`` (logged once). ``export --merge`` writes dense experts
(`dequantize_experts`: the values trained over), and the adapter is PEFT's as always.

Each weight is quantised on its own device, one at a time (its 16-bit copy freed as its NF4 one is made). A
16/32-bit checkpoint's experts are quantised as they load (`quantizing_on_load`: each as soon as transformers has
put it together on its device, as bitsandbytes' quantizer does with the linear layers), so the whole 16-bit
experts are never on the device at once; a random init's after it is drawn.

Sources: QLoRA, Dettmers et al. 2023 (arXiv:2305.14314); bitsandbytes 0.50 ``functional.quantize_4bit``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from lightning_ft.kernels.nf4 import Nf4ExpertWeight
from lightning_ft.model.mxfp4 import keep_dense, keep_placeholder
from lightning_ft.model.patching import moe_classes
from lightning_ft.model.quantization import _bitsandbytes

__all__ = ["dequantize_experts", "experts_bytes", "experts_modules", "nf4_weight", "quantize_experts", "quantizing_on_load"]

_PROJECTIONS = ("gate_up_proj", "down_proj")
_PARTS = ("packed", "absmax", "absmax2", "tables")


def experts_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The experts module of each sparse MoE block the MoE patch serves (`lightning_ft.model.patching.moe_classes`),
    under PEFT's LoRA wrappers where the model has them."""
    blocks = moe_classes("sparse_block")
    found = [m.experts for m in model.modules() if isinstance(m, blocks)]
    found = [e.get_base_layer() if isinstance(e, BaseTunerLayer) else e for e in found]
    return [e for e in found if all(getattr(getattr(e, name, None), "ndim", 0) == 3 for name in _PROJECTIONS)]


def quantize_experts(model: torch.nn.Module) -> int:
    """Quantise every 3-D expert weight of ``model``'s sparse MoE blocks to NF4 in place, one at a time, on its
    device; returns how many (0: a dense model). Weights already in NF4 are skipped.

    Raises:
        ImportError: bitsandbytes is not installed (naming the ``qlora`` extra).
    """
    return sum(_quantize(experts, name) for experts in experts_modules(model) for name in _PROJECTIONS)


def _quantize(experts: torch.nn.Module, name: str) -> bool:
    """``experts.<name>`` in NF4 (buffers and a placeholder, module docstring), its 16-bit copy freed; False where it
    is in NF4 already."""
    if hasattr(experts, f"{name}_nf4_packed"):
        return False
    bnb = _bitsandbytes()
    weight = getattr(experts, name).detach()
    packed, state = bnb.functional.quantize_4bit(
        weight.contiguous(), blocksize=64, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
    )
    quantised = Nf4ExpertWeight.from_quant_state(packed, state, weight.dtype)
    shape, dtype, device = weight.shape, weight.dtype, weight.device
    del weight, packed, state
    setattr(experts, name, None)  # the 16-bit weight freed before the placeholder takes its name
    for part in _PARTS:
        experts.register_buffer(f"{name}_nf4_{part}", getattr(quantised, part).contiguous())
    keep_placeholder(experts, name, shape, dtype, device)
    getattr(experts, name)._is_hf_initialized = True  # loaded: transformers' init of missing weights leaves it alone
    return True


@contextlib.contextmanager
def quantizing_on_load() -> Iterator[None]:
    """Within: transformers' checkpoint load (``from_pretrained``) quantises each expert weight of a sparse MoE block
    (`experts_modules`) to NF4 as soon as it is set on its module, one weight at a time, so a 16-bit checkpoint's
    experts never sit on the device whole (about 57 GB for Qwen3-30B-A3B in bf16). A transformers without
    ``core_model_loading.set_param_for_module`` loads as before (the caller quantises after loading).

    Source: transformers 5 ``core_model_loading.convert_and_load_state_dict_in_model``, which sets every loaded
    (and converted: the per-expert checkpoint tensors stacked into the fused 3-D weight) parameter through
    ``set_param_for_module``.
    """
    try:
        from transformers import core_model_loading as loading
    except ImportError:
        loading = None
    original = getattr(loading, "set_param_for_module", None)
    if original is None:
        yield
        return
    blocks = moe_classes("sparse_block")

    def set_and_quantize(model, target_name, param_value, *args, **kwargs):
        original(model, target_name, param_value, *args, **kwargs)
        module_path, _, name = target_name.rpartition(".")
        if name in _PROJECTIONS and module_path.endswith(".experts"):
            block = model.get_submodule(module_path.rpartition(".")[0])
            experts = block.experts
            if isinstance(block, blocks) and getattr(getattr(experts, name), "ndim", 0) == 3:
                _quantize(experts, name)

    loading.set_param_for_module = set_and_quantize
    try:
        yield
    finally:
        loading.set_param_for_module = original


def nf4_weight(experts: torch.nn.Module, name: str) -> Nf4ExpertWeight | None:
    """``experts.<name>`` as the `Nf4ExpertWeight` of its stored shape the backends read, or None where it is dense.
    Its compute dtype is the placeholder's (the model's dtype)."""
    if not hasattr(experts, f"{name}_nf4_packed"):
        return None
    placeholder = getattr(experts, name)
    parts = (getattr(experts, f"{name}_nf4_{part}") for part in _PARTS)
    return Nf4ExpertWeight(*parts, placeholder.shape, placeholder.dtype)


def experts_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes the NF4 expert weights hold, bytes they would hold dense in their compute dtype); (0, 0) for none."""
    held = dense = 0
    for experts in experts_modules(model):
        for name in _PROJECTIONS:
            if (weight := nf4_weight(experts, name)) is not None:
                held += sum(getattr(weight, part).untyped_storage().nbytes() for part in _PARTS)
                held += getattr(experts, name).untyped_storage().nbytes()  # the placeholder's element
                dense += weight.stored_shape.numel() * weight.dtype.itemsize
    return held, dense


def dequantize_experts(model: torch.nn.Module, dtype: torch.dtype | None = None) -> int:
    """Replace every NF4 expert weight by its dense parameter (`Nf4ExpertWeight.dequantize`, in ``dtype`` or the
    placeholder's: the values the triton backend computed with), frozen as it was, and drop the buffers:
    ``save_pretrained`` then writes plain experts. Returns how many (0: none)."""
    count = 0
    for experts in experts_modules(model):
        for name in _PROJECTIONS:
            weight = nf4_weight(experts, name)
            if weight is None:
                continue
            keep_dense(experts, name, weight._replace(dtype=dtype or weight.dtype).dequantize(), tuple(f"nf4_{p}" for p in _PARTS))
            count += 1
    return count
