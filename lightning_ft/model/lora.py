"""PEFT LoRA in the model: the adapters wrapped around it, and the fused forward of PEFT's ``lora.Linear``.

`add_lora` wraps a transformers model with PEFT LoRA (``get_peft_model``) or loads an adapter to train
further (``PeftModel.from_pretrained``), refusing target names that match nothing before PEFT would
drop them silently. `lora_linear_adapters` says for which adapters of a PEFT ``lora.Linear`` the
fused op `lightning_ft.kernels.lora.lora_linear` computes PEFT's forward; `_fused_lora_forward` is the
forward the patch tables (`lightning_ft.model.patching`, kernel switch ``lora``) install on those
layers: the fused op whenever that adapter alone is active, enabled and not merged, PEFT's own
forward otherwise, call by call. On a 4-bit base (PEFT's ``lora.bnb.Linear4bit`` around bitsandbytes'
``Linear4bit``, `lightning_ft.model.quantization`) the fused op is `lightning_ft.kernels.qlora.qlora_linear`
(our dequantisation, then the same products; in e4m3 with fp8 products under ``strategy.fp8``). The LoRA
parameters and the adapter file stay PEFT's.

Sources: PEFT 0.21 ``peft.tuners.lora.layer.Linear``, ``LoraConfig``, ``check_target_module_exists``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info
from peft.tuners.tuners_utils import BaseTunerLayer

from lightning_ft.kernels.lora import lora_linear
from lightning_ft.kernels.qlora import qlora_linear
from lightning_ft.model.quantization import quant4bit_weight
from lightning_ft.strategies import kept
from lightning_ft.strategies.fp8 import Fp8Linear, fp8_scale_4bit

__all__ = ["active_module", "adapter_folder", "add_lora", "fused_lora_classes", "lora_linear_adapters"]


def adapter_folder(init_from: str) -> Path:
    """The folder of ``lora.init_from``, checked to hold a PEFT adapter (``adapter_config.json``); `fit` checks it
    before the run folder is used, `add_lora` loads it.

    Raises:
        FileNotFoundError: naming ``lora.init_from`` when the folder has no ``adapter_config.json`` (or is missing).
    """
    folder = Path(init_from).expanduser()
    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"lora.init_from={init_from!r}: no adapter_config.json there; expected a folder written by "
            "PEFT's save_pretrained (such as <run_dir>/adapter)"
        )
    return folder


def add_lora(model: torch.nn.Module, lora: dict[str, Any]) -> torch.nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (or load an existing adapter to train further).

    ``lora`` keys: ``rank``, ``alpha``, ``dropout``, ``target_modules`` (a list of module names,
    ``all-linear`` (`all_linear_targets`), or, as PEFT reads any other string, a regular expression that must match
    a module's whole name), ``target_parameters`` (a list of names of 3-D expert parameters, e.g.
    ``mlp.experts.gate_up_proj``; optional), ``modules_to_save`` (names of whole modules, e.g.
    ``embed_tokens``, ``lm_head`` or a router ``mlp.gate``, that train in full and are saved in the
    adapter file: PEFT's ``LoraConfig.modules_to_save``, a trainable copy of each; optional),
    ``init_from`` (a PEFT adapter folder; optional).
    With ``init_from`` the adapter's own configuration (rank, alpha, targets, modules_to_save) is
    used and the other keys are ignored.

    Raises:
        FileNotFoundError: ``init_from`` is not a folder holding a PEFT ``adapter_config.json``.
        ValueError: an ``init_from`` adapter that does not fit the model (PEFT's size mismatch); a name in ``target_modules``, ``target_parameters`` or ``modules_to_save`` matches nothing in
            ``model`` (PEFT would drop it silently, or only warn, and train without that adapter), a
            ``target_modules`` string that is no regular expression or matches no module name (PEFT
            would raise only after loading), or a ``target_parameters`` string; a ``modules_to_save`` module that
            the targets also give LoRA (PEFT's all-linear on a router that ``moe.train_router`` trains in full).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.get("init_from"):
        init_from = adapter_folder(lora["init_from"])
        try:
            model = PeftModel.from_pretrained(model, str(init_from), is_trainable=True)
        except (RuntimeError, ValueError) as err:  # PEFT: "size mismatch for ...", or targets the model lacks
            lines = [line.strip() for line in str(err).splitlines() if line.strip()]
            first = next((line for line in lines if "size mismatch" in line), lines[0] if lines else type(err).__name__)[:300]
            raise ValueError(
                f"lora.init_from={str(init_from)!r}: the adapter does not fit this model ({first}); an adapter continues "
                "on the base it was trained on (its adapter_config.json's base_model_name_or_path)"
            ) from err
        loaded = model.peft_config["default"]
        modules = loaded.target_modules  # a list, or one regular expression
        targets = [modules] if isinstance(modules, str) else sorted(modules or [])
        rank_zero_info(
            f"lora.init_from={str(init_from)!r} (trained on {loaded.base_model_name_or_path}): rank {loaded.r}, alpha "
            f"{loaded.lora_alpha}, targets {targets + list(loaded.target_parameters or [])}, modules_to_save "
            f"{sorted(loaded.modules_to_save or [])} (lora.rank/alpha/targets/modules_to_save ignored)"
        )
        return model
    target_modules = lora["target_modules"]
    leaves = [name for name, m in model.named_modules() if next(m.children(), None) is None]
    if not isinstance(target_modules, str):
        _check_lora_targets("lora.target_modules", target_modules, leaves)
    elif target_modules.lower() != "all-linear":  # PEFT's shorthand, any case
        _check_lora_regex("lora.target_modules", target_modules, [name for name, _ in model.named_modules() if name], leaves)
    else:
        target_modules = all_linear_targets(model)
    if isinstance(lora.get("target_parameters"), str):  # PEFT takes a list only (TypeError for a str)
        name = lora["target_parameters"]
        raise ValueError(f"lora.target_parameters={name!r}: expected a list of parameter names, such as lora.target_parameters=[{name}]")
    _check_lora_targets("lora.target_parameters", lora.get("target_parameters") or [], [
        name for name, p in model.named_parameters() if p.dim() == 3
    ])
    modules_to_save = lora.get("modules_to_save") or []
    if isinstance(modules_to_save, str):
        raise ValueError(f"lora.modules_to_save={modules_to_save!r}: expected a list of module names, such as lora.modules_to_save=[{modules_to_save}]")
    _check_lora_targets("lora.modules_to_save", modules_to_save, [name for name, _ in model.named_modules() if name])
    config = LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        target_parameters=list(lora["target_parameters"]) if lora.get("target_parameters") else None,
        modules_to_save=list(modules_to_save) or None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    try:
        return get_peft_model(model, config)
    except TypeError as err:  # PEFT wrapped a module both as a LoRA target and as a trained copy
        if "modules_to_save cannot be applied" not in str(err) or not modules_to_save:
            raise
        raise ValueError(
            f"lora.modules_to_save={list(modules_to_save)} (moe.train_router adds the routers there): PEFT's lora.target_modules="
            f"{lora['target_modules']} already puts LoRA on one of them ({err}); name the targets instead (e.g. lora=moe)"
        ) from err


def all_linear_targets(model: torch.nn.Module) -> str | list[str]:
    """``lora.target_modules=all-linear`` for ``model``: PEFT's ``all-linear`` (every ``nn.Linear`` and GPT-2
    ``Conv1D`` but the output layer) without the subclasses of ``nn.Linear`` that transformers defines with a
    ``forward`` that is not a linear map of the last dim (`_runs_as_linear`), which PEFT's LoRA layer would run as
    one: Phi-MoE's and Llama 4's routers (they return a tuple), DeepSeek-V4's grouped output projection (a training
    step of each failed with them wrapped). Subclasses that compute ``F.linear`` (Falcon's) and quantised linears
    (bitsandbytes' ``Linear4bit``) are kept, as PEFT wraps them.

    Returns:
        ``"all-linear"`` where nothing is left out (PEFT expands it), else the module names to target: a layer
        suffix (``q_proj``) where no left-out module shares it, else the full names; the left-out ones are logged.
    """
    from transformers.pytorch_utils import Conv1D

    output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    linear = [(n, m) for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, Conv1D)) and m is not output]
    verdicts: dict[type, bool] = {}
    left_out = {}
    for name, module in linear:
        cls = type(module)
        if cls is torch.nn.Linear or not isinstance(module, torch.nn.Linear) or not cls.__module__.startswith("transformers."):
            continue
        if cls.forward is not torch.nn.Linear.forward and not verdicts.setdefault(cls, _runs_as_linear(module)):
            left_out[name] = cls.__name__
    if not left_out:
        return "all-linear"
    targets = set()
    for name, _ in linear:
        if name in left_out:
            continue
        suffix = name.rsplit(".", 1)[-1]
        shared = any(n == suffix or n.endswith("." + suffix) for n in left_out)
        targets.add(name if shared else suffix)
    kinds = sorted({f"{n.rsplit('.', 1)[-1]} ({cls})" for n, cls in left_out.items()})
    rank_zero_info(
        f"lora.target_modules=all-linear: leaving out {', '.join(kinds)}: nn.Linear subclasses whose forward is not a "
        "plain linear map, which PEFT's LoRA would run as one"
    )
    return sorted(targets)


def _runs_as_linear(module: torch.nn.Linear) -> bool:
    """Whether ``module``'s own forward on a random [2, 3, in_features] input returns ``F.linear`` of it (a tensor
    within 1e-3); a weight that is not a 16/32-bit float (quantised: its layer's business) counts as linear."""
    weight = module.weight
    if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.device.type == "meta":
        return True
    x = torch.randn(2, 3, module.in_features, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    try:  # the random state kept: a router may draw jitter noise in training mode
        with torch.no_grad(), torch.random.fork_rng(devices=[weight.device] if weight.is_cuda else []):
            y = module(x)
    except Exception:  # noqa: BLE001 - a forward that takes no [..., in_features] input is no linear map of it
        return False
    expected = torch.nn.functional.linear(x, weight, module.bias)
    return isinstance(y, torch.Tensor) and y.shape == expected.shape and torch.allclose(y.float(), expected.float(), rtol=1e-3, atol=1e-3)


def active_module(module: torch.nn.Module) -> torch.nn.Module:
    """The module a PEFT ``modules_to_save`` wrapper (``ModulesToSaveWrapper``) runs now: the active
    adapter's trainable copy, or the original where adapters are disabled or none is active (as its
    ``forward`` decides); any other module as it is."""
    from peft.utils.other import ModulesToSaveWrapper

    if not isinstance(module, ModulesToSaveWrapper):
        return module
    active = module.active_adapters
    if module.disable_adapters or not active or any(name not in module.modules_to_save for name in active):
        return module.original_module
    return module.modules_to_save[active[0]]


def _check_lora_targets(key: str, targets: list[str], names: list[str]) -> None:
    """Refuse a LoRA target that matches none of ``names`` as PEFT matches a list: the whole name,
    or its dotted suffix (``q_proj`` matches ``model.layers.0.self_attn.q_proj``).

    Raises:
        ValueError: naming ``key``, the unmatched targets and the model's own suffixes to choose from (for
            ``lora.target_modules``, also the ``lora`` config groups whose targets the model has).
    """
    def matched(target: str) -> bool:
        return any(n == target or n.endswith("." + target) for n in names)

    unmatched = [t for t in targets if not matched(t)]
    if key == "lora.target_modules" and any(t.lower() == "all-linear" for t in unmatched):
        raise ValueError(f"{key}: all-linear is a name for PEFT's shorthand, not a layer: pass it alone, {key}=all-linear")
    if unmatched:
        groups = _lora_groups() if key == "lora.target_modules" else {}
        fitting = [group for group, group_targets in groups.items() if group_targets and all(map(matched, group_targets))]
        hint = f"; the lora groups that fit this model: {', '.join(f'lora={g}' for g in fitting)}" if fitting else ""
        raise ValueError(f"{key}: {unmatched} are not in the model; its layers have: {_layer_suffixes(names)}{hint}")


def _lora_groups() -> dict[str, list[str]]:
    """The ``lora`` config group's options and their ``target_modules`` (configs/lora/*.yaml)."""
    import yaml

    from lightning_ft.config import config_dir

    groups = {}
    for path in sorted((Path(config_dir()) / "lora").glob("*.yaml")):
        targets = (yaml.safe_load(path.read_text()) or {}).get("target_modules")
        groups[path.stem] = targets if isinstance(targets, list) else []
    return groups


def _check_lora_regex(key: str, pattern: str, names: list[str], leaves: list[str]) -> None:
    """Refuse a LoRA target string that matches none of ``names`` as PEFT matches a string: a regular
    expression that must match a module's whole name (``re.fullmatch``, PEFT 0.21
    ``check_target_module_exists``), so ``q_proj`` matches nothing where the list ``[q_proj]`` matches
    every ``...self_attn.q_proj``. PEFT would raise its ``NoMatchingPeftModuleError`` after loading.

    Args:
        key: the config key, for the message.
        pattern: the string, not ``all-linear``.
        names: the module names PEFT tries (every named module but the root).
        leaves: the leaf module names, for the suggested list form.

    Raises:
        ValueError: naming ``key``: ``pattern`` is not a regular expression, or it matches no name;
            then the list form to use and the layers' own suffixes.
    """
    try:
        if any(re.fullmatch(pattern, n) for n in names):
            return
    except re.error as err:
        raise ValueError(f"{key}={pattern!r}: a string is a regular expression over full module names, and this one is not valid ({err})") from err
    as_name = [n for n in leaves if n == pattern or n.endswith("." + pattern)]
    example = (as_name or [n for n in leaves if re.search(r"\.\d+\.", n)] or leaves or ["none"])[0]
    listed = pattern if as_name else re.sub(r"^.*\.\d+\.", "", example)
    raise ValueError(
        f"{key}={pattern!r} matches no module: a string is a regular expression over full module names "
        f"(such as {example}); for module names use a list, such as {key}=[{listed}]; its layers have: {_layer_suffixes(leaves)}"
    )


def _layer_suffixes(names: list[str]) -> str:
    """The names without their layer prefix (``model.layers.3.``), what a target list holds, comma-separated."""
    choices = sorted({re.sub(r"^.*\.\d+\.", "", n) for n in names if re.search(r"\.\d+\.", n)}) or sorted(names)
    return ", ".join(choices) or "none"


def _skip_adapter_input_casts(model: torch.nn.Module) -> None:
    """Stop PEFT casting each LoRA layer's input to the adapter dtype (fp32) under mixed precision.

    Autocast casts both operands of every adapter matmul to the autocast dtype anyway, so the cast
    to fp32 and back costs a copy of the layer input each way per LoRA layer and pass (forward,
    recompute, and the cast's backward) for the same result (with LoRA dropout, the dropout mask
    is applied in the input's dtype instead of fp32). Tested to give bit-identical loss and
    gradients under bf16 autocast.
    Source: PEFT 0.21 ``LoraLayer.cast_input_dtype_enabled`` (``peft.helpers.disable_input_dtype_casting``).
    """
    for module in model.modules():
        if isinstance(module, BaseTunerLayer):
            module.cast_input_dtype_enabled = False


def fused_lora_classes() -> tuple[type, ...]:
    """The PEFT LoRA layer classes whose forward `_fused_lora_forward` may replace: ``lora.Linear``, and
    ``lora.bnb.Linear4bit`` (a 4-bit base) where bitsandbytes is installed (PEFT defines it only then)."""
    from peft.tuners.lora import bnb as peft_bnb
    from peft.tuners.lora.layer import Linear

    return (Linear, peft_bnb.Linear4bit) if hasattr(peft_bnb, "Linear4bit") else (Linear,)


def _is_linear4bit(layer: torch.nn.Module) -> bool:
    """Whether ``layer`` is exactly bitsandbytes' ``nn.Linear4bit`` (checked by name: bitsandbytes is optional)."""
    cls = type(layer)
    return cls.__name__ == "Linear4bit" and cls.__module__.startswith("bitsandbytes.")


def lora_linear_adapters(module: torch.nn.Module) -> frozenset[str]:
    """The adapters of a PEFT ``lora.Linear`` (or ``lora.bnb.Linear4bit``) for which `lora_linear` (`qlora_linear`)
    is PEFT's forward, whenever that adapter is the only active one, adapters are enabled and not merged, and
    the call has no extra arguments.

    That is: no variant (DoRA), no dropout, no LoRA bias, on a plain ``nn.Linear`` base layer, its fp8 form
    (`lightning_ft.strategies.fp8.Fp8Linear`) or bitsandbytes' ``Linear4bit`` (not ``fan_in_fan_out``, no
    forward hooks or replaced ``forward``: the fused op reads its weight directly) whose weight and bias are
    frozen. These do not change while a model trains; which adapter is active, merging and disabling do, and
    are checked at every call (and, for a 4-bit base, its compute dtype and layout: `_fused_lora_forward`).
    """
    base = module.base_layer
    if (
        module.fan_in_fan_out
        or (type(base) not in (torch.nn.Linear, Fp8Linear) and not _is_linear4bit(base))
        or base._forward_hooks
        or base._forward_pre_hooks
        or "forward" in base.__dict__
        or any(p.requires_grad for p in base.parameters())
    ):
        return frozenset()
    return frozenset(
        name
        for name in module.lora_A
        if name not in module.lora_variant
        and type(module.lora_dropout[name]) is torch.nn.Identity
        and module.lora_B[name].bias is None
    )


def _fused_lora_forward(self: torch.nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    active = self.active_adapters
    if args or kwargs or len(active) != 1 or self.disable_adapters or self.merged:
        return type(self).forward(self, x, *args, **kwargs)
    (name,) = active
    lora_A = self.lora_A[name]
    scaling = self.scaling[name]
    # an adapter checked at patch time (re-created under its name: a new lora_A module), a non-zero
    # scaling (PEFT's 0 · NaN stays NaN), and, without autocast, PEFT's dtype (it computes the
    # adapter in the adapter's dtype)
    ours = self._lightning_ft_lora.get(name) is lora_A and scaling != 0
    if not ours or (x.dtype != lora_A.weight.dtype and not torch.is_autocast_enabled(x.device.type)):
        return type(self).forward(self, x, *args, **kwargs)
    base = self.base_layer
    if _is_linear4bit(base):
        weight = quant4bit_weight(base)
        device = x.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
        # bitsandbytes computes in the layer's compute dtype: fused only where that is ours
        if weight is None or base.compute_dtype not in (None, dtype):
            return type(self).forward(self, x, *args, **kwargs)
        # fp8 compute where strategy.fp8 left the weight's e4m3 scales (`lightning_ft.strategies.fp8.convert_4bit_to_fp8`)
        return qlora_linear(x, weight, base.bias, lora_A.weight, self.lora_B[name].weight, scaling, fp8_scale_4bit(base))
    keep = kept.active(self._lightning_ft_keep) if self._lightning_ft_keep else None
    if keep is not None and not _output_keepable(self):
        keep = None
    weight_scale = getattr(base, "weight_scale", None)  # an fp8 base (`lightning_ft.strategies.fp8.Fp8Linear`)
    weight = base.weight if weight_scale is None else base.weight_fp8
    lora_B = self.lora_B[name].weight
    return lora_linear(x, weight, base.bias, lora_A.weight, lora_B, scaling, keep=keep, weight_scale=weight_scale)


def _output_keepable(module: torch.nn.Module) -> bool:
    """Whether a kept output of this LoRA layer (`lightning_ft.strategies.kept`) stays right, checked per call (the
    forward and its recompute decide alike): its base weight and bias frozen (the kept path computes no gradient
    for them) and no forward hook that could change the output in place (it is a view of the kept buffer)."""
    frozen = not any(p.requires_grad for p in module.base_layer.parameters())
    return frozen and not module._forward_hooks and not torch.nn.modules.module._global_forward_hooks
