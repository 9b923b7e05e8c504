"""Build the model a run trains, from the ``model``, ``lora``, ``kernels`` and ``moe`` config groups.

`ModelBuilder` is what `lightning_ft.module.FinetuneModule` receives and calls in Lightning's
``configure_model`` (on the target device, before a strategy shards the model). In order:

1. the packed attention backend of ``model.attention`` registered with transformers
   (`lightning_ft.model.attention`; ``auto`` resolved and logged);
2. the transformers causal LM (`load_causal_lm`: ``from_pretrained``, or random weights from a
   config, drawn right after ``torch.manual_seed(seed)`` so that the base is a function of the
   config and the seed alone; with ``model.quantization=nf4`` its linear layers in 4 bits,
   `lightning_ft.model.quantization`), ``use_cache`` off, optional gradient checkpointing;
3. LoRA through PEFT (`lightning_ft.model.lora.add_lora`), the MoE routers in its
   ``modules_to_save`` with ``moe.train_router``; or every weight trainable with
   ``lora.enabled=false`` (the routers only with ``moe.train_router``; `lightning_ft.model.router`);
4. with ``moe.backend`` other than ``hf``, the MoE patch (`lightning_ft.model.moe`) and, for
   ``grouped_mm``, the LoRA slots in the expert weights; then the router training checked
   (`lightning_ft.model.router.check_router_training`, a warning where the LM loss cannot train
   the router) and the load-balancing loss announced (``model.config.output_router_logits``);
   with the strategy's ``fp8``, the frozen base weights of the LoRA layers in e4m3 (`lightning_ft.strategies.fp8`),
   the experts under LoRA too (``triton`` backend, `lightning_ft.model.moe.convert_experts_to_fp8`); 4-bit
   (``nf4``) bases stay in 4 bits and get their e4m3 scales for fp8 products (NF4 experts keep ``model.dtype`` compute);
5. the fused kernels switched on in ``kernels`` (`lightning_ft.model.patching`);
6. with the strategy's ``cuda_graphs`` (`lightning_ft.strategies.strategy.Execution`), each decoder layer
   replayed from CUDA graphs (`lightning_ft.strategies.cuda_graphs`), checked against the config first,
   before any weight loads; ``auto`` (the default) resolved there to on where the checks pass and
   off otherwise, in one line that says which and why (``true`` raises what they refuse);
7. the model in training mode.

With every kernel off and ``moe.backend=hf`` the result is stock transformers + PEFT.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from huggingface_hub.errors import StrictDataclassError
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from lightning_ft.errors import check_choice, check_local_path
from lightning_ft.kernels._utils import INTERPRETER
from lightning_ft.kernels.moe import QUANTISED_EXPERT_BACKENDS
from lightning_ft.model import nf4_experts
from lightning_ft.model.attention import register_packed_attention, resolve_attention_backend
from lightning_ft.model.attention_plan import calibrate
from lightning_ft.model.lora import _skip_adapter_input_casts, add_lora
from lightning_ft.model.moe import apply_moe, augment_expert_weights, convert_experts_to_fp8
from lightning_ft.model.mxfp4 import dequantize_experts, gpt_oss_experts, keeping_mxfp4, no_mxfp4_experts, quantize_experts
from lightning_ft.model.mxfp4 import experts_bytes as mxfp4_experts_bytes
from lightning_ft.model.patching import KERNEL_KEYS, apply_kernels, has_moe_path
from lightning_ft.model.quantization import bnb_nf4_config, check_quantization, check_quantized_training, quantize_linears
from lightning_ft.model.router import (
    aux_loss_coef,
    check_router_training,
    freeze_routers,
    load_balancing_loss_function,
    router_module_names,
)
from lightning_ft.model.support import architecture_support, fast_path_lines
from lightning_ft.strategies.cuda_graphs import GRAPH_TOKEN_MULTIPLE, apply_cuda_graphs, check_cuda_graphs
from lightning_ft.strategies.fp8 import check_fp8_device, convert_4bit_to_fp8, convert_lm_head_to_fp8, convert_to_fp8
from lightning_ft.strategies.recompute import checkpoint_each_layer
from lightning_ft.strategies.strategy import Execution

__all__ = ["BuiltModel", "ModelBuilder", "holds_nf4_experts", "load_causal_lm", "nf4_experts_backend"]


#: model.init
INITS = ("pretrained", "random")
#: model.dtype → the weights' dtype
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def check_model_folder(name_or_path: str | None) -> None:
    """Refuse a ``model.name_or_path`` that names a local path but no model checkpoint: a path that does not exist
    (`check_local_path`), or a folder without a ``config.json``. A hub name passes.

    Raises:
        FileNotFoundError: naming the key and what is missing.
    """
    check_local_path("model.name_or_path", name_or_path)
    if name_or_path:
        folder = Path(name_or_path).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no config.json in that folder, so not a model checkpoint")


def load_causal_lm(
    name_or_path: str | None,
    init: str = "pretrained",
    config: dict[str, Any] | None = None,
    dtype: str = "float32",
    vocab_size: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
    quantization: str = "none",
    experts_in_nf4: bool = False,
) -> torch.nn.Module:
    """Build a transformers causal LM from a checkpoint or, with random weights, from a config.

    A checkpoint whose config says ``quantization_config.quant_method: mxfp4`` (gpt-oss's published
    checkpoints: the experts as ``*_blocks`` / ``*_scales``) loads with its experts dequantised to
    ``dtype`` (transformers' ``Mxfp4Config(dequantize=True)``): the trained model holds plain weights,
    and transformers' own MXFP4 experts do not train. With ``quantization=mxfp4`` they stay in MXFP4 instead
    (`lightning_ft.model.mxfp4`).

    Args:
        name_or_path: a local checkpoint folder or hub name; optional with ``init="random"`` when
            ``config`` names a ``model_type``.
        init: ``pretrained`` (``from_pretrained``) or ``random`` (``from_config``: random weights,
            created on the current default device, e.g. the GPU inside Lightning's
            ``configure_model``).
        config: config values that override the checkpoint's (or, with ``model_type``, the whole
            config for a random init).
        dtype: ``float32``, ``bfloat16`` or ``float16``: the dtype of the weights.
        vocab_size: the tokenizer's size; a random-init config without ``vocab_size`` gets it
            rounded up to a multiple of 64.
        attn_implementation: passed to transformers (packed attention: a name from `register_packed_attention`).
        quantization: ``none``, or ``nf4``: the linear layers (not the LM head) as bitsandbytes NF4 with double
            quantisation, quantised while a 16/32-bit checkpoint loads, after a random init, or as a
            bitsandbytes 4-bit checkpoint stores them (`lightning_ft.model.quantization`); or ``mxfp4``: gpt-oss's
            MoE experts in MXFP4, kept as an MXFP4 checkpoint stores them, else quantised after loading
            (`lightning_ft.model.mxfp4`).
        experts_in_nf4: with ``quantization=nf4``, a 16/32-bit checkpoint's MoE experts are quantised to NF4 as they
            load (`lightning_ft.model.nf4_experts.quantizing_on_load`; a random init's are quantised by the caller).

    Raises:
        ValueError: bad ``init``/``dtype``, no checkpoint and no ``model_type``, a config that is
            not a causal LM, a ``config`` value of the wrong type for transformers (naming
            ``model.config.<key>`` and the type expected), a ``config`` key that is a near miss of a
            field (``num_hidden_layer``), an embedding table smaller than the tokenizer, or a
            ``quantization`` the checkpoint contradicts (`lightning_ft.model.quantization.check_quantization`), a
            checkpoint whose tensors do not fit the config (``model.config`` of another shape).
        ImportError: ``quantization=nf4`` without bitsandbytes (naming the ``qlora`` extra).
        FileNotFoundError: ``name_or_path`` is neither a local checkpoint (a folder with a
            ``config.json``) nor a reachable hub name.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    check_choice("model.init", init, INITS)
    check_choice("model.dtype", dtype, tuple(DTYPES))
    overrides = dict(config or {})
    check_model_folder(name_or_path)
    if name_or_path:
        try:
            hf_config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **overrides)
        except OSError as err:
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: not a model checkpoint ({err})") from err
        except ValueError as err:  # e.g. a config.json without a model_type transformers knows
            raise ValueError(f"model.name_or_path={name_or_path!r}: transformers cannot read its config ({err})") from err
        except StrictDataclassError as err:
            raise _config_value_error(err, overrides, name_or_path) from err
    elif init == "random" and "model_type" in overrides:
        try:
            hf_config = AutoConfig.for_model(overrides.pop("model_type"), **overrides)
        except StrictDataclassError as err:
            raise _config_value_error(err, overrides, None) from err
    else:
        raise ValueError("set model.name_or_path, or model.init=random with model.config.model_type")
    _check_config_keys(hf_config, overrides)
    _check_head_shape(hf_config, overrides)
    if hf_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise ValueError(
            f"model {name_or_path or hf_config.model_type!r}: a {hf_config.model_type!r} config is not a causal LM "
            f"(transformers has no AutoModelForCausalLM class for it)"
        )
    _check_causal(hf_config)
    if vocab_size is not None:
        if init == "random" and "vocab_size" not in overrides and not name_or_path:
            hf_config.vocab_size = -(-vocab_size // 64) * 64
        elif hf_config.vocab_size < vocab_size:
            raise ValueError(
                f"the model's vocab_size {hf_config.vocab_size} is smaller than the tokenizer's {vocab_size} tokens"
            )
    method = _quant_method(hf_config)
    check_quantization(quantization, method, _quant_field(hf_config, "load_in_4bit") is True)
    if not _takes_attention_functions(hf_config):  # e.g. Git picks its attention class by name: ours is no key
        attn_implementation = None
    kwargs = {"dtype": DTYPES[dtype], "attn_implementation": attn_implementation}
    if init == "random" and quantization == "mxfp4":
        return _random_mxfp4(hf_config, trust_remote_code, kwargs)
    if init == "random":
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code, **kwargs)
        if quantization == "nf4":
            quantize_linears(model)
        return model
    if quantization == "nf4" and method is None:
        kwargs["quantization_config"] = bnb_nf4_config(DTYPES[dtype])
    if method == "mxfp4":
        from transformers import Mxfp4Config

        kwargs["quantization_config"] = Mxfp4Config(dequantize=True)
    device = torch.get_default_device()
    if device.type != "cpu":
        kwargs["device_map"] = str(device)
    keep_mxfp4 = quantization == "mxfp4" and method == "mxfp4"
    on_load = experts_in_nf4 and quantization == "nf4" and method is None
    with keeping_mxfp4() if keep_mxfp4 else nf4_experts.quantizing_on_load() if on_load else contextlib.nullcontext():
        try:
            model = AutoModelForCausalLM.from_pretrained(
                name_or_path, config=hf_config, trust_remote_code=trust_remote_code, **kwargs
            )
        except RuntimeError as err:
            if "size mismatch" not in str(err) and "ignore_mismatched_sizes" not in str(err):
                raise
            shown = ", ".join(f"{k}={v}" for k, v in overrides.items() if not isinstance(v, dict))[:300]
            raise ValueError(
                f"model.name_or_path={name_or_path}: its weights do not fit the config they load with (a tensor's shape "
                f"differs); model.config overrides the checkpoint's config.json ({shown or 'no keys'}): "
                "start from model=pretrained to take the checkpoint's own shape"
            ) from err
    if quantization == "mxfp4" and not keep_mxfp4:
        _quantize_experts(model, "loading")
    return model


def _check_causal(hf_config: Any) -> None:
    """Refuse a config that declares ``is_decoder=False`` (BERT's family: its causal LM class is an encoder then) where
    a model built from it lets a token see later ones (`lightning_ft.model.support.ArchitectureSupport.causal`, probed
    on a tiny copy with the random state kept): training on the next token would read the answer (the loss falls
    towards zero; transformers only warns). Configs whose models are causal whatever the flag (GPT-NeoX; BART's causal
    LM sets it) pass; a tiny copy that does not build checks nothing.

    Raises:
        ValueError: naming ``model.config.is_decoder`` and the fix.
    """
    if "is_decoder" not in hf_config.to_dict() or hf_config.is_decoder is not False:
        return
    if architecture_support(hf_config).causal is not None:
        raise ValueError(
            f"model.config.is_decoder is false (the default of {hf_config.model_type!r} configs): the model then lets "
            "each token see the later ones, so training on the next token would read the answer; set it on the command "
            "line with +model.config.is_decoder=true"
        )


def _takes_attention_functions(config: Any) -> bool:
    """Whether ``config``'s transformers causal LM calls attention through the attention-function registry, where a
    registered name (our packed attention) may be its ``attn_implementation``; True for a class transformers does not
    map (remote code), which transformers checks itself."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return model_class is None or bool(model_class._supports_attention_backend)


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Within: each parameter a module registers is moved to the meta device (its constructor's init then runs on
    meta: a no-op); buffers stay where they are made, with the values their constructors compute (RoPE's inv_freq)."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param: torch.nn.Parameter | None) -> None:
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _random_mxfp4(hf_config: Any, trust_remote_code: bool, kwargs: dict[str, Any]) -> torch.nn.Module:
    """``model.init=random`` with ``model.quantization=mxfp4``: the model is built with its parameters on the meta
    device (`_parameters_on_meta`) and drawn by transformers' own ``initialize_weights`` (module by module, children
    first), each module's parameters put on the default device right before they are drawn and each experts module
    quantised right after, so the dense experts never exist together (gpt-oss-120b's are 234 GB in bf16, more than
    one GPU holds). The same seed gives the same weights on each build, but not ``model.quantization=none``'s: a stock
    build's constructors draw torch's default init first.

    Raises:
        ValueError: the config has no gpt-oss experts (`lightning_ft.model.mxfp4.no_mxfp4_experts`).
        RuntimeError: transformers' init left a parameter undrawn (naming it).
    """
    from transformers import AutoModelForCausalLM, PreTrainedModel

    device = torch.get_default_device()
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code, **kwargs)
    experts = set(gpt_oss_experts(model))
    if not experts:
        raise no_mxfp4_experts(type(model).__name__)
    quantised = []

    def drawing(init: Any) -> Any:
        def draw(module: torch.nn.Module) -> None:
            for name, param in module.named_parameters(recurse=False):
                if param.is_meta:
                    setattr(module, name, torch.nn.Parameter(torch.empty_like(param, device=device),
                                                             requires_grad=param.requires_grad))
            init(module)
            if module in experts:
                quantised.append(quantize_experts(module))
        return draw

    owners = [m for m in model.modules() if isinstance(m, PreTrainedModel)]  # each draws its submodules
    for module in model.modules():  # an init that ran at construction (on meta) drew nothing
        module.__dict__.pop("_is_hf_initialized", None)
    for owner in owners:
        owner._init_weights = drawing(owner._init_weights)
    try:
        model.initialize_weights()
    finally:
        for owner in owners:
            del owner._init_weights
    model.tie_weights()
    for name, param in model.named_parameters():
        if param.is_meta:
            raise RuntimeError(f"model.quantization=mxfp4: transformers' init did not draw {name}")
    _log_mxfp4(model, sum(quantised), "the random init")
    return model


def _quantize_experts(model: torch.nn.Module, after: str) -> None:
    """``model.quantization=mxfp4`` on dense experts: quantise them (`lightning_ft.model.mxfp4.quantize_experts`), logged."""
    _log_mxfp4(model, quantize_experts(model), after)


def _log_mxfp4(model: torch.nn.Module, count: int, after: str) -> None:
    """The start log's line for ``count`` expert weights quantised to MXFP4 after ``after``, with the bytes held."""
    rank_zero_info(f"quantization: {count} expert weights quantised to MXFP4 after {after}: {_bytes_held(*mxfp4_experts_bytes(model))}")


def _bytes_held(held: int, dense: int) -> str:
    """What quantised expert weights hold, for the start log: ``held`` bytes and ``dense`` bytes (as they would be in
    ``model.dtype``) in MiB, e.g. ``0.01 MiB (0.04 MiB in model.dtype)``."""
    return f"{held / 2**20:.2f} MiB ({dense / 2**20:.2f} MiB in model.dtype)"


def nf4_experts_backend(requested: str, on_cuda: bool) -> str:
    """The MoE backend of a ``model.quantization=nf4`` run with MoE experts: ``auto`` is ``triton`` on CUDA (the backend
    that reads NF4 experts), else as ``requested``. A pure function of the run's config and device, so that ``export``
    rebuilds the experts as the run held them."""
    return "triton" if requested == "auto" and on_cuda else requested


def holds_nf4_experts(backend: str) -> bool:
    """Whether the MoE ``backend`` (resolved by `nf4_experts_backend`) reads NF4 experts (``triton`` and ``grouped_mm``
    do); with another a ``model.quantization=nf4`` run keeps its experts in ``model.dtype``."""
    return backend in QUANTISED_EXPERT_BACKENDS


def _nf4_experts(model: torch.nn.Module, moe_backend: str, keep: bool | None, dtype: str, device: torch.device) -> str:
    """``model.quantization=nf4`` on an MoE model: its experts quantised to NF4 where ``keep`` says (None: where the
    backend, ``auto`` resolved by `nf4_experts_backend`, reads them: `holds_nf4_experts`; `lightning_ft.model.nf4_experts`), the count
    and bytes logged; else left in ``dtype``, logged where ``keep`` is None (a training run's choice). Returns the
    MoE backend to apply."""
    if not nf4_experts.experts_modules(model):
        return moe_backend
    if keep is None and moe_backend != (backend := nf4_experts_backend(moe_backend, device.type == "cuda")):
        rank_zero_info(f"moe: backend {moe_backend} -> {backend}, the backend that reads NF4 experts")
        moe_backend = backend
    if keep or (keep is None and holds_nf4_experts(moe_backend)):
        after = nf4_experts.quantize_experts(model)  # those a checkpoint's load did not quantise (a random init's)
        count = sum(nf4_experts.nf4_weight(e, n) is not None for e in nf4_experts.experts_modules(model)
                    for n in ("gate_up_proj", "down_proj"))
        if count:
            rank_zero_info(f"quantization: {count} expert weights quantised to NF4{'' if after else ' as they loaded'}: "
                           f"{_bytes_held(*nf4_experts.experts_bytes(model))}")
    elif keep is None:
        why = "takes triton, which keeps them in NF4 too, on CUDA only (moe.backend=grouped_mm keeps them in NF4 " \
            "anywhere)" if moe_backend == "auto" else \
            "reads dense weights (moe.backend=triton or grouped_mm keeps them in NF4 too)"
        rank_zero_info(f"quantization: the MoE experts stay in {dtype}: moe.backend={moe_backend} {why}")
    return moe_backend


def _moe_backend(requested: str, device: torch.device, quantization: str, execution: Execution, lora: dict[str, Any]) -> str:
    """``moe.backend``, with ``auto`` as ``triton`` (logged) where the experts are held in a format ``triton`` reads:
    ``model.quantization=mxfp4``, or ``strategy.fp8`` with LoRA on dense experts (`_fp8_experts`), on a device Triton
    runs on (``grouped_mm`` reads both too, when asked for).
    Otherwise as given (``auto`` then resolves by the hardware, `lightning_ft.kernels.moe.select_backend`; nf4's
    experts resolve ``auto`` after loading: `nf4_experts_backend`)."""
    held = "mxfp4" if quantization == "mxfp4" else "fp8" if _fp8_experts(execution, quantization, lora) else None
    if requested != "auto" or held is None or not (device.type == "cuda" or (INTERPRETER and device.type == "cpu")):
        return requested
    rank_zero_info(f"moe: backend auto -> triton, which reads {held} experts")
    return "triton"


def _fp8_experts(execution: Execution, quantization: str, lora: dict[str, Any]) -> bool:
    """Whether ``strategy.fp8`` will hold the MoE experts in e4m3: dense experts (no 4-bit or MXFP4 base) with LoRA."""
    return execution.fp8 and quantization == "none" and bool(lora.get("target_parameters"))


def _quant_method(hf_config: Any) -> str | None:
    """The checkpoint's ``quantization_config.quant_method`` (a dict or a transformers config object), or None."""
    return _quant_field(hf_config, "quant_method")


def _quant_field(hf_config: Any, key: str) -> Any:
    """The checkpoint's ``quantization_config.<key>`` (a dict or a transformers config object), or None."""
    quantization = getattr(hf_config, "quantization_config", None)
    if quantization is None:
        return None
    return quantization.get(key) if isinstance(quantization, dict) else getattr(quantization, key, None)


def _check_config_keys(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Refuse a ``model.config`` key that is a near miss of a field of the model's config class (a typo:
    transformers stores any extra key as an attribute that nothing reads); log the other keys the class
    does not declare (a model may read them with a default, as Qwen3-MoE reads ``head_dim``), on rank 0 only.
    An activation field (one whose default names a transformers activation, ``hidden_act``) must name one too:
    transformers would fail only when it builds the layers, with a bare ``KeyError``.

    Raises:
        ValueError: a key within a character or two of a declared field (``num_hidden_layer``); an activation
            field set to a name transformers does not have (``hidden_act=gelu_typo``), with the closest names.
    """
    import difflib

    from transformers.activations import ACT2FN

    cls = type(hf_config)
    defaults = cls().to_dict()
    known = set(defaults) | set(getattr(cls, "attribute_map", {}))
    for key, value in overrides.items():
        if isinstance(defaults.get(key), str) and defaults[key] in ACT2FN and isinstance(value, str):
            check_choice(f"model.config.{key}", value, sorted(ACT2FN))
        if key in known or key == "model_type":
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"model.config.{key}: {cls.__name__} has no such field; did you mean model.config.{close[0]}?")
        rank_zero_info(f"model.config.{key}: not a declared field of {cls.__name__}; set on the config as given")


def _check_head_shape(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Where ``model.config`` sets ``hidden_size``, ``num_attention_heads`` or ``num_key_value_heads``: refuse key/value
    heads that do not divide the query heads (grouped-query attention shares each among a whole
    group), a derived head size (``hidden_size / num_attention_heads``: no ``head_dim``, or the one the config
    computed from them, as Llama's and Mistral's store it) that the heads do not divide, and an odd head size under
    RoPE (which rotates pairs of channels; transformers refuses an odd ``head_dim`` given as such). Configs such as
    Qwen2, Qwen3-MoE, Mixtral, Llama and Mistral build a model with such heads that fails in its first forward with
    a shape mismatch.

    Raises:
        ValueError: naming the ``model.config`` key, the sizes and the fix.
    """
    if not {"hidden_size", "num_attention_heads", "num_key_value_heads"} & overrides.keys():
        return
    hidden, heads = getattr(hf_config, "hidden_size", None), getattr(hf_config, "num_attention_heads", None)
    kv_heads, head_dim = getattr(hf_config, "num_key_value_heads", None), getattr(hf_config, "head_dim", None)
    if not isinstance(heads, int) or heads < 1:
        return
    if isinstance(kv_heads, int) and kv_heads > 0 and heads % kv_heads:
        raise ValueError(
            f"model.config.num_attention_heads={heads} with num_key_value_heads={kv_heads}: each key/value head serves a "
            "whole group of query heads, so num_key_value_heads must divide num_attention_heads"
        )
    rope = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_theta", None)
    derived = isinstance(hidden, int) and "head_dim" not in overrides and head_dim in (None, hidden // heads)
    if derived and (hidden % heads or (rope and hidden // heads % 2)):
        why = "does not divide it" if hidden % heads else f"gives each head {hidden // heads} channels, and RoPE needs an even number"
        raise ValueError(
            f"model.config.num_attention_heads={heads} with hidden_size={hidden}: {why}; pick a head count that gives an "
            "even head size, or set model.config.head_dim"
        )


def _config_value_error(err: Exception, overrides: dict[str, Any], name_or_path: str | None) -> ValueError:
    """A transformers config's field validation error (huggingface_hub's strict dataclasses, e.g.
    ``num_hidden_layers='abc'``: expected int) as one line naming the config key: ``model.config.<field>``
    when the run's config sets that field, else the checkpoint's config.json."""
    match = re.match(r"Validation error for field '([^']+)'", str(err))
    field = match.group(1) if match else None
    why = " ".join(str(err.__cause__ or err).split())
    why = re.sub(r"^Field '[^']*' ", "", why)  # "expected int, got str (value: 'abc')"
    if field in overrides:
        return ValueError(f"model.config.{field}={overrides[field]!r}: {why}")
    source = f"model.name_or_path={name_or_path!r}: its config.json"
    if field is None:  # a check across fields (a class validator); its message names them
        return ValueError(f"{'model.config' if overrides else source}: transformers refuses the model config: {why}")
    return ValueError(f"{source} field {field!r}: {why}")


def _use_cuda_graphs(
    model: dict[str, Any],
    execution: Execution,
    lora: dict[str, Any],
    attention: str,
    device: torch.device,
    sharded: bool = False,
    moe_backend: str | None = None,
) -> bool:
    """Whether the strategy's CUDA graphs apply (``strategy.cuda_graphs`` true or ``auto``), checked from the config
    before the model is built.

    `Execution.check` (a CUDA device) and `check_cuda_graphs`, which `apply_cuda_graphs` runs again on the built
    model, run here on the config first, so a bad combination fails before 60 GB of weights are loaded. ``true``: what
    they refuse raises, and under FSDP2 (``sharded``: it gathers each layer's weights at new addresses every step) the
    graphs are skipped with a warning (with ``auto`` too where
    ``strategy.activation_offload`` asks for them). ``auto``: False instead, with one info line that says why
    (`_auto_off`). ``false``: False.

    Raises:
        ValueError: with ``strategy.cuda_graphs=true``, off CUDA, or what `check_cuda_graphs` refuses; with ``auto``,
            ``strategy.activation_offload=true`` where the graphs stay off.
    """
    if execution.cuda_graphs is False:
        return False
    if sharded:
        if execution.cuda_graphs == "auto" and not execution.activation_offload:
            return _auto_off(execution, "strategy=fsdp2 (it gathers each layer's weights at new addresses every step)")
        rank_zero_warn(
            "strategy.cuda_graphs=true (and with it strategy.activation_offload) is skipped under strategy=fsdp2 (FSDP2 "
            "gathers each layer's weights at new addresses every step); set strategy.cuda_graphs=false to silence this"
        )
        return False
    dropout = lora.get("dropout", 0.0) if lora.get("enabled", True) else 0.0
    router_logits = bool((model.get("config") or {}).get("output_router_logits", False))
    no_cuda = None if device.type == "cuda" else f"the model is on {device}"
    checks = (  # each with the reason ``auto`` logs (None: the refusal's own words)
        (lambda: replace(execution, cuda_graphs=True).check(no_cuda=no_cuda), f"the model is on {device.type}"),
        (lambda: check_cuda_graphs(bool(model.get("gradient_checkpointing")), attention, dropout, moe_backend, router_logits), None),
    )
    for check, reason in checks:
        try:
            check()
        except ValueError as err:
            if execution.cuda_graphs is True:
                raise
            return _auto_off(execution, reason or _refusal_reason(err))
    return True


def _refusal_reason(err: ValueError) -> str:
    """A `check_cuda_graphs` refusal as the reason ``auto`` logs: without its ``strategy.cuda_graphs=true`` subject
    and its ``strategy.cuda_graphs=false`` fix."""
    return re.sub(r",? or strategy\.cuda_graphs=false$", "", str(err).removeprefix("strategy.cuda_graphs=true "))


def _auto_off(execution: Execution, reason: str) -> bool:
    """``strategy.cuda_graphs=auto`` turned off for ``reason``: log one line saying so and return False.

    Raises:
        ValueError: ``strategy.activation_offload=true``, which needs the graphs (naming ``reason`` and the key to change).
    """
    if execution.activation_offload:
        raise ValueError(f"strategy.activation_offload=true needs CUDA graphs, which strategy.cuda_graphs=auto leaves off "
                         f"here ({reason}): set strategy.activation_offload=false")
    rank_zero_info(f"cuda graphs: off (auto): {reason}")
    return False


@dataclass
class BuiltModel:
    """What `ModelBuilder` returns to the LightningModule.

    Attributes:
        model: the model to train (a PEFT model around a transformers causal LM, or the causal LM
            itself without LoRA), patched and in training mode.
        execution: the strategy's options it was built with, ``cuda_graphs`` resolved to whether the layers replay
            CUDA graphs (``auto`` to True or False; ``true`` under FSDP2 to False); the strategy holds these from then on.
        fused_linear_cross_entropy: ``kernels.fused_linear_cross_entropy``: compute the loss without
            materialising the logits (`lightning_ft.kernels.linear_cross_entropy`).
        pad_for_graphs: the decoder layers replay CUDA graphs with varlen attention: packed rows are
            padded to shared token counts (`lightning_ft.module.FinetuneModule.pad_for_graphs`).
        packed: the architecture takes packed rows; else each document runs in its own padded row
            through the model's stock attention (`lightning_ft.model.support`).
        plain_head: the model's logits are its LM head's output (the chunked CE may apply); else its
            own forward makes them.
        nf4_experts_dequantized: with ``dense_experts``, how many NF4 expert weights were dequantised
            (`lightning_ft.model.nf4_experts.dequantize_experts`; ``export --merge`` says it).
    """

    model: torch.nn.Module
    execution: Execution
    fused_linear_cross_entropy: bool = False
    pad_for_graphs: bool = False
    packed: bool = True
    plain_head: bool = True
    nf4_experts_dequantized: int = 0


class ModelBuilder:
    """Builds the model from the config groups (the steps in the module docstring), when called.

    Args:
        model: the ``model`` config group (see `lightning_ft.config.ModelConfig`).
        lora: the ``lora`` config group.
        kernels: the ``kernels`` config group: ``rms_norm``, ``rope``, ``swiglu``, ``lora``,
            ``fused_linear_cross_entropy`` switches (all off = stock transformers + PEFT).
        moe: the ``moe`` config group: ``backend`` (``hf`` = stock transformers experts, or
            ``auto``/``native_torch``/``grouped_mm``/``triton``, see `lightning_ft.model.moe`)
            ``train_router`` (`lightning_ft.model.router`) and ``lora_slots`` (grouped_mm:
            `augment_expert_weights`).
        vocab_size: the tokenizer's size (for random-init models).
        seed: with ``model.init=random``, ``torch.manual_seed(seed)`` right before the weights are drawn
            (the run's ``seed``), so that ``python -m lightning_ft export`` rebuilds the same base on the
            same kind of device (random draws differ between the CPU and CUDA); None: the current RNG state.
        execution: the strategy's options where no strategy gives them when called (a model built without
            a Trainer); default: `Execution`'s defaults (``cuda_graphs=auto``).
        dense_experts: dequantise ``model.quantization=mxfp4``'s experts right after loading, to the values trained
            over (`lightning_ft.model.mxfp4.dequantize_experts`), and skip the training checks: the stock model
            of ``export``, not for training. ``model.quantization=nf4``'s NF4 experts likewise
            (`lightning_ft.model.nf4_experts.dequantize_experts`).
        experts_in_nf4: with ``model.quantization=nf4``, quantise the MoE experts to NF4 too
            (`lightning_ft.model.nf4_experts`); None: where the backend reads them (`holds_nf4_experts`: ``triton``,
            ``grouped_mm``; with another the experts stay in ``model.dtype``, logged). ``export`` passes what the run's backend made.

    Raises:
        ValueError: ``model`` has a key the strategy owns now (`lightning_ft.config.MOVED_KEYS`), naming its new key.
    """

    def __init__(
        self,
        model: dict[str, Any],
        lora: dict[str, Any],
        kernels: dict[str, bool] | None = None,
        moe: dict[str, Any] | None = None,
        vocab_size: int | None = None,
        seed: int | None = None,
        execution: Execution | None = None,
        dense_experts: bool = False,
        experts_in_nf4: bool | None = None,
    ):
        from lightning_ft.config import MOVED_KEYS

        if moved := [key for key in MOVED_KEYS if key.split(".")[1] in model]:
            raise ValueError(f"{', '.join(moved)}: moved to {', '.join(MOVED_KEYS[k] for k in moved)} (the strategy's options)")
        self.model_cfg = dict(model)
        self.lora_cfg = dict(lora)
        self.kernels_cfg = dict(kernels or {})
        self.moe_cfg = dict(moe or {})
        self.vocab_size = vocab_size
        self.seed = seed
        self.execution = execution if execution is not None else Execution()
        self.dense_experts = dense_experts
        self.experts_in_nf4 = experts_in_nf4

    def __call__(
        self, device: torch.device, precision: str | None = None, sharded: bool = False, execution: Execution | None = None
    ) -> BuiltModel:
        """Build the model on ``device`` (the current default device for a random init).

        Args:
            device: where the model will run (Lightning's ``strategy.root_device``).
            precision: Lightning's precision setting (e.g. ``bf16-mixed``), or None without a trainer;
                under mixed precision PEFT's casts of the adapter inputs are skipped
                (`lightning_ft.model.lora._skip_adapter_input_casts`).
            sharded: the strategy shards the model afterwards (FSDP2): no CUDA graphs (warned where
                ``strategy.cuda_graphs=true`` asked for them) and no LoRA slots in the expert weights.
            execution: the strategy's options (`lightning_ft.strategies.strategy.Execution`: CUDA graphs,
                kept and offloaded activations); None: the builder's own.

        Raises:
            ValueError, FileNotFoundError: what `load_causal_lm`, `lightning_ft.model.lora.add_lora`,
                `lightning_ft.model.quantization.check_quantized_training` (a 4-bit base without LoRA or under
                FSDP2, MXFP4 on a backend that cannot read it),
                `Execution.check`, `lightning_ft.strategies.cuda_graphs.check_cuda_graphs`,
                `lightning_ft.model.router` (``moe.train_router`` on a model without routers, or
                against what ``lora.modules_to_save`` or ``lora.init_from`` says), ``lora.modules_to_save``
                without LoRA, and the patches refuse.
        """
        cfg = self.model_cfg
        dtype = DTYPES.get(cfg.get("dtype", "float32"))
        attention, why = resolve_attention_backend(cfg.get("attention", "auto"), device, dtype)
        execution = execution if execution is not None else self.execution
        execution.check()
        lora_enabled = bool(self.lora_cfg.get("enabled", True))
        quantization = cfg.get("quantization", "none")
        moe_backend = _moe_backend(self.moe_cfg.get("backend", "hf"), device, quantization, execution, self.lora_cfg)
        if not self.dense_experts:  # export's stock model (no LoRA for an adapter's export) trains nothing
            check_quantized_training(quantization, lora_enabled, sharded, moe_backend)
        if execution.fp8:
            _check_fp8(device, sharded, self.lora_cfg, quantization, bool(self.kernels_cfg.get("lora")))
        cuda_graphs = _use_cuda_graphs(cfg, execution, self.lora_cfg, attention, device, sharded, moe_backend)
        rank_zero_info(f"attention: {attention} ({why})")
        if cfg.get("init", "pretrained") == "random" and self.seed is not None:
            torch.manual_seed(self.seed)  # every device's generator: the base does not depend on what drew before
        experts_in_nf4 = self.experts_in_nf4 if self.experts_in_nf4 is not None else \
            holds_nf4_experts(nf4_experts_backend(moe_backend, device.type == "cuda"))
        model = load_causal_lm(
            cfg.get("name_or_path"),
            init=cfg.get("init", "pretrained"),
            config=cfg.get("config"),
            dtype=cfg.get("dtype", "float32"),
            vocab_size=self.vocab_size,
            attn_implementation=register_packed_attention(attention),
            trust_remote_code=cfg.get("trust_remote_code", False),
            quantization=cfg.get("quantization", "none"),
            experts_in_nf4=experts_in_nf4,  # a checkpoint's experts quantised as they load (a dense model has none)
        )
        model.config.use_cache = False
        if quantization == "nf4":
            moe_backend = _nf4_experts(model, moe_backend, self.experts_in_nf4, cfg.get("dtype", "float32"), device)
        if self.dense_experts and (experts := dequantize_experts(model)):
            rank_zero_info(f"quantization: {experts} MXFP4 expert weights dequantised to model.dtype")
        nf4_dequantized = nf4_experts.dequantize_experts(model) if self.dense_experts else 0
        if nf4_dequantized:
            rank_zero_info(f"quantization: {nf4_dequantized} NF4 expert weights dequantised to model.dtype")
        if attention == "auto":  # which documents run cuDNN: measured before any step (CUDA graphs key rows by it)
            calibrate(model.config, device, dtype)
        support = architecture_support(model.config)
        if support.packing is not None:
            if cuda_graphs and execution.cuda_graphs is True:
                raise ValueError(f"strategy.cuda_graphs=true needs packed rows, which {model.config.model_type} cannot take "
                                 f"({support.packing}): set strategy.cuda_graphs=false")
            if cuda_graphs:
                cuda_graphs = _auto_off(execution, f"{model.config.model_type} cannot take packed rows ({support.packing})")
            rank_zero_warn(f"{model.config.model_type}: one document per padded row, not packed rows ({support.packing})")
            if model._supports_attention_backend:
                model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")
        if cfg.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            checkpoint_each_layer(model)  # each layer's checkpoint says which pass of it runs (lightning_ft.strategies.recompute)
        train_router = bool(self.moe_cfg.get("train_router", False))
        routers = router_module_names(model) if train_router else []
        if lora_enabled:
            lora_cfg = self.lora_cfg
            if routers:  # PEFT trains a copy of each router and saves it with the adapter
                saved = list(lora_cfg.get("modules_to_save") or [])
                lora_cfg = {**lora_cfg, "modules_to_save": saved + [name for name in routers if name not in saved]}
            model = add_lora(model, lora_cfg)
            if precision is not None and "mixed" in precision:
                _skip_adapter_input_casts(model)
        elif self.lora_cfg.get("modules_to_save"):
            raise ValueError(
                f"lora.modules_to_save={list(self.lora_cfg['modules_to_save'])} needs lora.enabled=true: without LoRA every "
                "weight trains and the whole model is saved; set lora.modules_to_save=null"
            )
        elif not train_router:
            freeze_routers(model)
        if moe_backend == "auto" and not has_moe_path(model.config.model_type):
            rank_zero_info(f"moe: backend auto -> hf ({model.config.model_type} has no experts on our MoE path)")
            moe_backend = "hf"  # a dense model (what the GPU path's moe=auto resolves to for it, lightning_ft.device)
        if moe_backend == "hf" and has_moe_path(model.config.model_type):
            rank_zero_info("moe: hf experts backend (transformers' own; moe=auto, grouped_mm or triton for ours)")
        if moe_backend != "hf":
            backend = apply_moe(model, backend=moe_backend, chunk_tokens=self.moe_cfg.get("chunk_tokens", "auto"))
            rank_zero_info(f"moe: {backend} experts backend")
            lora_slots = backend == "grouped_mm" and self.moe_cfg.get("lora_slots", True) and not sharded \
                and not _fp8_experts(execution, quantization, self.lora_cfg)  # e4m3 experts have no slots
            if lora_slots and (augmented := augment_expert_weights(model)):
                rank_zero_info(f"moe: {augmented} expert weights hold their LoRA factors in spare rows and columns (LoRA joins the GEMMs)")
            if cuda_graphs:  # `auto` resolved to native_torch (a GPU without a grouped_mm kernel)
                cuda_graphs = _use_cuda_graphs(cfg, execution, self.lora_cfg, attention, device, sharded, backend)
        if execution.fp8:
            linears = convert_to_fp8(model)
            if quantization == "none" or linears:
                rank_zero_info(f"fp8: {linears} frozen LoRA base weights in e4m3, per-output-channel scales")
            if quantization == "nf4":
                _fp8_over_4bit(model, cfg.get("dtype", "float32"))
            experts, left = convert_experts_to_fp8(model)
            if experts:
                rank_zero_info(f"fp8: {experts} frozen expert weights under LoRA in e4m3, one scale per expert")
            if left:
                rank_zero_info(f"fp8: the MoE experts stay in {cfg.get('dtype', 'float32')}: {left}")
            if execution.fp8_lm_head:
                rank_zero_info(convert_lm_head_to_fp8(model))
        hf = model.get_base_model() if hasattr(model, "get_base_model") else model
        if note := check_router_training(model, train_router, hf.config):
            rank_zero_warn(note)
        coef = aux_loss_coef(hf.config)
        if coef is not None:
            load_balancing_loss_function(hf)  # refused now where the model has none
            rank_zero_info(
                f"moe: load-balancing loss on: router_aux_loss_coef={coef} × aux_loss added to each micro-batch's "
                "training loss (logged as train/aux_loss)"
            )
        for line in fast_path_lines(model.config.model_type, support, self.kernels_cfg, apply_kernels(model, self.kernels_cfg)):
            rank_zero_info(line)
        triton_kernels = [k for k in KERNEL_KEYS if k != "lora" and self.kernels_cfg.get(k)]  # lora: torch ops alone
        if triton_kernels and device.type == "cpu" and not INTERPRETER:
            rank_zero_info(f"{model.config.model_type} kernels: Triton cannot run on the CPU (without TRITON_INTERPRET=1): "
                           f"{', '.join(triton_kernels)} run their plain-torch references, same math")
        pad_for_graphs = False
        if cuda_graphs:
            offload = execution.activation_offload
            layers = apply_cuda_graphs(
                model,
                keep_attention=execution.keep_attention,
                activation_offload=offload,
                keep_projections=execution.keep_projections,
                keep_max_gib=execution.keep_max_gib,
            )
            how = " (auto)" if execution.cuda_graphs == "auto" else ""
            rank_zero_info(f"cuda graphs: on{how}: {layers} decoder layers replayed from CUDA graphs in training")
            if attention == "varlen":
                pad_for_graphs = True
                rank_zero_info(
                    f"cuda graphs: packed rows of several documents are padded to a multiple of {GRAPH_TOKEN_MULTIPLE} "
                    "tokens (at least the longest row so far, at most data.max_tokens) by a document of ignored tokens, "
                    "so that rows share graphs"
                )
            if offload:
                rank_zero_info("activation offloading: each decoder layer's input (but the last's) waits in host memory for the backward")
        # training mode throughout, as a transformers Trainer sets it: from_pretrained (and PEFT's, for
        # lora.init_from) return the model in eval mode, and Lightning keeps each submodule's mode, so a
        # loaded checkpoint would train without gradient checkpointing (transformers checkpoints only in
        # training mode), CUDA graphs (replayed only then) or LoRA dropout
        model.train()
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(f"model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable")
        fused_ce = bool(self.kernels_cfg.get("fused_linear_cross_entropy")) and support.plain_head is None
        return BuiltModel(
            model, replace(execution, cuda_graphs=cuda_graphs), fused_ce, pad_for_graphs, support.packing is None,
            support.plain_head is None, nf4_dequantized,
        )


def _fp8_over_4bit(model: torch.nn.Module, dtype: str) -> None:
    """``strategy.fp8`` over ``model.quantization=nf4``: the e4m3 scales of the 4-bit LoRA bases
    (`lightning_ft.strategies.fp8.convert_4bit_to_fp8`), logged with what keeps computing in ``dtype``."""
    computed, left = convert_4bit_to_fp8(model)
    rank_zero_info(f"fp8: {computed} 4-bit base weights computed in e4m3 (NF4 storage, per-output-channel scales)")
    if left:
        rank_zero_info(f"fp8: {left} 4-bit base weights under LoRA compute in {dtype}: the fused LoRA forward does not "
                       "serve their adapters (LoRA dropout, DoRA or a LoRA bias)")
    if nf4_experts.experts_bytes(model)[0]:
        rank_zero_info(f"fp8: the NF4 MoE experts compute in {dtype} (dequantised to it before the grouped GEMM)")


def _check_fp8(device: torch.device, sharded: bool, lora: dict[str, Any], quantization: str, fused_lora: bool) -> None:
    """Refuse ``strategy.fp8=true`` where it cannot run, before any weight loads (`lightning_ft.strategies.fp8`).

    Raises:
        ValueError: a device without row-wise fp8 GEMMs (`check_fp8_device`), a sharded model (FSDP2
            would shard the e4m3 bytes apart from their scales), no LoRA (nothing is frozen), an MXFP4
            base, an NF4 base without ``kernels.lora`` (only the fused LoRA forward computes it in fp8).
    """
    if quantization == "mxfp4":
        raise ValueError("strategy.fp8=true with model.quantization=mxfp4 is not supported: set one of them off")
    if quantization == "nf4" and not fused_lora:
        raise ValueError("strategy.fp8=true with model.quantization=nf4 computes the 4-bit base weights in fp8 in the fused "
                         "LoRA forward only: set kernels.lora=true (or strategy.fp8=false)")
    if sharded:
        raise ValueError(
            "strategy.fp8=true is not available with strategy=fsdp2: use strategy=ddp or one device, or strategy.fp8=false"
        )
    if not lora.get("enabled", True):
        raise ValueError("strategy.fp8=true needs lora.enabled=true (fp8 holds the frozen base weights under the LoRA layers)")
    check_fp8_device(device)
