"""``model.quantization``: the frozen base in 4 bits: ``nf4`` (QLoRA) as bitsandbytes stores it, or ``mxfp4``.

``mxfp4`` keeps gpt-oss's MoE experts in MXFP4 (`lightning_ft.model.mxfp4`); the rest of this module is ``nf4``'s.

``nf4`` keeps every frozen ``nn.Linear`` of the decoder (not the LM head, as transformers leaves it) as a
bitsandbytes ``Linear4bit``: NF4 codes, blocks of 64 with double-quantised absmax (blocks of 256), as
``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)``
and ``quantize_4bit(..., quant_type="nf4", compress_statistics=True)`` make them:

- a checkpoint in 16/32 bits loads through transformers' bitsandbytes quantizer (`bnb_nf4_config`), which
  quantises each weight as it is read onto the device: the whole model never sits there in 16 bits;
- a checkpoint saved already quantised by bitsandbytes in 4 bits (its config's ``quantization_config``)
  loads as it is, NF4 or FP4, with or without double quantisation;
- a random-init model (benchmarks) is quantised right after its weights are drawn (`quantize_linears`),
  one layer at a time.

An MoE model's fused 3-D expert weights, which bitsandbytes leaves alone, go to NF4 in the same layout with
``moe.backend=triton`` (`lightning_ft.model.nf4_experts`).

PEFT wraps these layers with its ``lora.bnb.Linear4bit`` and saves adapters in its own format, which load
on the stock bitsandbytes-quantised model. The training forward dequantises with our kernel
(`lightning_ft.kernels.nf4`, through `lightning_ft.model.lora` with ``kernels.lora``; straight to e4m3 for fp8
products with ``strategy.fp8``, `lightning_ft.strategies.fp8.convert_4bit_to_fp8`), which needs no bitsandbytes; the storage classes are bitsandbytes', so ``nf4`` needs it installed (the ``qlora`` extra).

Sources: bitsandbytes 0.50 ``nn.Linear4bit``, ``Params4bit``, ``functional.quantize_4bit``; transformers 5
``BitsAndBytesConfig`` and ``get_keys_to_not_convert``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info

from lightning_ft.errors import check_choice
from lightning_ft.kernels.moe import QUANTISED_EXPERT_BACKENDS
from lightning_ft.kernels.nf4 import Quant4bitWeight

__all__ = [
    "QUANTIZATIONS", "bnb_nf4_config", "check_quantization", "check_quantized_training", "dequantize_linears", "quant4bit_weight",
    "quantize_linears",
]

QUANTIZATIONS = ("none", "nf4", "mxfp4")
_BLOCKSIZE = 64


def _bitsandbytes():
    """bitsandbytes, imported.

    Raises:
        ImportError: not installed, naming the extra that installs it.
    """
    try:
        import bitsandbytes
    except ImportError as err:
        raise ImportError(
            'model.quantization=nf4 needs bitsandbytes: pip install -e ".[qlora]" (or pip install bitsandbytes)'
        ) from err
    return bitsandbytes


def check_quantization(quantization: str, checkpoint_method: str | None, checkpoint_4bit: bool) -> None:
    """Refuse a ``model.quantization`` that the value or the checkpoint's own quantisation contradicts.

    Args:
        quantization: ``model.quantization``.
        checkpoint_method: the checkpoint's ``quantization_config.quant_method`` (None: not quantised).
        checkpoint_4bit: that config says ``load_in_4bit``.

    Raises:
        ValueError: an unknown value; a bitsandbytes 4-bit checkpoint with ``none`` (it loads in 4 bits
            whatever we say: set ``nf4``); ``nf4`` on a checkpoint quantised otherwise (MXFP4, 8-bit...);
            ``mxfp4`` on a checkpoint quantised other than in MXFP4.
        ImportError: ``nf4`` without bitsandbytes (naming the ``qlora`` extra).
    """
    check_choice("model.quantization", quantization, QUANTIZATIONS)
    bnb_4bit = checkpoint_method == "bitsandbytes" and checkpoint_4bit
    if quantization == "none" and bnb_4bit:
        raise ValueError("model.quantization=none, but the checkpoint is quantised in 4 bits by bitsandbytes: set model.quantization=nf4")
    if quantization == "nf4":
        if checkpoint_method is not None and not bnb_4bit:
            raise ValueError(
                f"model.quantization=nf4: the checkpoint is already quantised ({checkpoint_method}); nf4 takes a 16/32-bit "
                "checkpoint or a bitsandbytes 4-bit one: set model.quantization=none"
            )
        _bitsandbytes()
    if quantization == "mxfp4" and checkpoint_method not in (None, "mxfp4"):
        raise ValueError(
            f"model.quantization=mxfp4: the checkpoint is already quantised ({checkpoint_method}); mxfp4 takes a 16/32-bit "
            "or an MXFP4 checkpoint: set model.quantization=none"
        )


def check_quantized_training(quantization: str, lora: bool, sharded: bool, moe_backend: str = "triton") -> None:
    """Refuse, before any weight loads, what a 4-bit base cannot run with (yet).

    Raises:
        ValueError: ``nf4`` or ``mxfp4`` without LoRA (the 4-bit weights cannot train), under FSDP2 (``sharded``: it
            would shard the packed bytes without their scales); ``mxfp4`` on a ``moe.backend`` other than ``triton`` or
            ``grouped_mm`` (those that read MXFP4); each naming the setting to change. Both run under CUDA graphs (the
            dequantisation buffer is recorded at its address, `lightning_ft.kernels._utils.dequant_buffer`)
    """
    if quantization == "none":
        return
    if not lora:
        raise ValueError(f"model.quantization={quantization} freezes the base in 4 bits, so only LoRA can train: set "
                         "lora.enabled=true (or model.quantization=none for full fine-tuning)")
    if sharded:
        raise ValueError(f"model.quantization={quantization} does not run under strategy=fsdp2: use one GPU or strategy=ddp")
    if quantization == "mxfp4" and moe_backend not in QUANTISED_EXPERT_BACKENDS:
        raise ValueError(f"model.quantization=mxfp4 keeps the experts in MXFP4, which only moe.backend=triton or "
                         f"grouped_mm reads (moe.backend={moe_backend}): set moe.backend=grouped_mm, or triton on a GPU")


def bnb_nf4_config(dtype: torch.dtype) -> Any:
    """transformers' ``BitsAndBytesConfig`` quantising a checkpoint to NF4 with double quantisation at load, computing in ``dtype``."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )


def quantize_linears(model: torch.nn.Module) -> int:
    """Replace each ``nn.Linear`` of a transformers model but those transformers keeps in full precision (the
    output embeddings, tied weights, the last module) by a bitsandbytes NF4 ``Linear4bit`` (double quantisation,
    blocksize 64) computing in its weight's dtype, one layer at a time (each dense weight freed as its 4-bit
    copy is made, on the weight's device). The model and its config record the quantisation as
    ``from_pretrained`` with `bnb_nf4_config` does (``save_pretrained`` writes a 4-bit checkpoint; casting the
    model to another dtype is refused, as transformers refuses it for a bitsandbytes model).

    Returns:
        The number of layers quantised.
    """
    bnb = _bitsandbytes()
    from transformers.quantizers.base import get_keys_to_not_convert

    keep = set(get_keys_to_not_convert(model))
    targets = [(name, m) for name, m in model.named_modules() if type(m) is torch.nn.Linear and name not in keep]
    dtype = None
    for name, linear in targets:
        weight = linear.weight.detach()
        dtype = weight.dtype
        packed, state = bnb.functional.quantize_4bit(
            weight, blocksize=_BLOCKSIZE, compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8
        )
        new = bnb.nn.Linear4bit(
            linear.in_features, linear.out_features, bias=linear.bias is not None, compute_dtype=dtype,
            compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8, device="meta",
        )  # fmt: skip
        new.weight = bnb.nn.Params4bit(
            packed, requires_grad=False, quant_state=state, blocksize=_BLOCKSIZE, compress_statistics=True,
            quant_type="nf4", quant_storage=torch.uint8, module=new, bnb_quantized=True,
        )  # fmt: skip
        new.quant_state = state
        if linear.bias is not None:
            new.bias = linear.bias
        new.train(linear.training)
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, new)
        del linear, weight
    if targets:  # the attributes transformers' bitsandbytes quantizer sets (so e.g. `model.to(dtype)` is refused)
        model.config.quantization_config = bnb_nf4_config(dtype)
        model.is_quantized, model.is_loaded_in_4bit = True, True
        model.quantization_method = model.config.quantization_config.quant_method
        rank_zero_info(f"quantization: {len(targets)} linear layers quantised to NF4 after the random init")
    return len(targets)


def dequantize_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Replace each bitsandbytes 4-bit ``Linear4bit`` of a transformers ``model`` by an ``nn.Linear`` holding its
    weight dequantised and cast to ``dtype`` (the values the training forward computed with, for a ``dtype`` the
    weights were quantised from), and drop the model's and its config's record of the quantisation, so that
    ``save_pretrained`` writes a plain ``dtype`` checkpoint. transformers' bitsandbytes quantizer does it
    (``HfQuantizer.dequantize``, built from the config's ``quantization_config``: also for `quantize_linears`'s
    models, which have no quantizer of their own).

    Returns:
        The number of layers dequantised (0: nothing was quantised in 4 bits, the model is left as it is).
    """
    from transformers.quantizers.auto import AutoHfQuantizer

    count = sum(type(m).__name__ == "Linear4bit" for m in model.modules())
    if not count:
        return 0
    said = logging.getLogger("transformers.integrations.bitsandbytes")  # its "dequantized in ... and casted" warning: the caller's to tell
    level = said.level
    said.setLevel(logging.ERROR)
    try:
        AutoHfQuantizer.from_config(model.config.quantization_config, pre_quantized=True).dequantize(model, dtype=dtype)
    finally:
        said.setLevel(level)
    model.is_loaded_in_4bit = False
    return count


def quant4bit_weight(layer: torch.nn.Module) -> Quant4bitWeight | None:
    """The 4-bit weight of a bitsandbytes ``Linear4bit`` (``layer``) as our dequantisation reads it, or None:
    not such a layer, not quantised yet, or repacked by bitsandbytes for its CPU inference kernel."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or type(weight).__name__ != "Params4bit" or getattr(state, "packing_format_for_cpu", False):
        return None
    return Quant4bitWeight.from_quant_state(weight.data, state)
