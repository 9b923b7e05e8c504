"""`FinetuneModule`: the LightningModule that builds, patches and trains a Hugging Face causal LM.

Loss (exact normalisation): an optimizer step covers ``k`` micro-batches on each of ``W`` ranks.
Its loss is the sum of all token losses of the step divided by ``N``, the number of target tokens
in the whole step (``PackedBatch.step_target_tokens``, counted on the host by the data module):

    loss_step = Σ_ranks Σ_micro Σ_tokens ce(token) / N

Lightning divides each micro-batch's returned loss by ``k`` before backward and DDP (or FSDP2)
averages gradients over ``W`` ranks, so each micro-batch returns ``loss_sum · k · W / N``. This
equals one big batch holding every micro-batch of the step (not the mean of per-micro-batch means).

Before every optimizer step (``on_before_optimizer_step``) the step's loss and a non-finite flag
(loss or any gradient NaN/Inf) are summed over ranks. A step without target tokens, or a
non-finite one with ``train.on_nonfinite=skip``, is skipped: the optimizer leaves the weights and
its moments alone (the LR schedule still advances); both are counted in ``skipped_steps``. With
``train.on_nonfinite=stop`` a non-finite step raises `TrainingStopped` without updating the
weights, so the last checkpoint written is the last good one.

Where the optimizer skips a step on the device (fused torch Adam or AdamW, `_skips_on_device`;
AdamW ``fused=True`` is the config's default; the ``found_inf`` contract of `torch.amp.GradScaler`) the
flag is handed to it as ``found_inf`` and the step is queued without waiting: the host reads the
loss and the flag (copied to pinned memory, behind a CUDA event) only after the update is queued
(``optimizer_step``), so the GPU never idles while the host decides. Measured at 12 layers of
Qwen3-30B-A3B, 8K tokens: the sync before the update left the GPU idle ~2.4 ms per step, the host
launching the update (benchmarks/RESULTS.md, session 11). Other optimizers read the flag first,
one device sync before the update, and skip by setting the gradients to None. A skipped step
logs ``train/loss`` as NaN (summary.json: null). Gradient clipping under bf16-mixed works with a
fused optimizer (`configure_gradient_clipping`; Lightning refuses it, for fp16's GradScaler).

Checkpoints also hold every rank's RNG states (restored at ``on_train_start``), the per-step
losses and the skip counters, so a resumed run replays an uninterrupted one exactly.
"""

from __future__ import annotations

import inspect
import logging
import random
import re
from functools import partial
from pathlib import Path
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from peft.tuners.tuners_utils import BaseTunerLayer
from torchmetrics import SumMetric
from typing_extensions import override

from lightning_ft.data.packing import PackedBatch
from lightning_ft.data.tokenization import IGNORE_INDEX
from lightning_ft.errors import TrainingStopped, check_local_path
from lightning_ft.kernels.linear_cross_entropy import fused_linear_cross_entropy
from lightning_ft.model.attention import register_packed_attention, resolve_attention_backend
from lightning_ft.strategies.cuda_graphs import apply_cuda_graphs, check_cuda_graphs, keep_max_bytes
from lightning_ft.model.moe import apply_moe, augment_expert_weights
from lightning_ft.model.patching import apply_kernels
from lightning_ft.strategies.fsdp2 import full_tensor, local_tensor, shard_model

log = logging.getLogger(__name__)

GRAPH_TOKEN_MULTIPLE = 256  # graphed rows are padded to a multiple of this many tokens (`FinetuneModule.pad_for_graphs`)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_causal_lm(
    name_or_path: str | None,
    init: str = "pretrained",
    config: dict[str, Any] | None = None,
    dtype: str = "float32",
    vocab_size: int | None = None,
    attn_implementation: str | None = None,
    trust_remote_code: bool = False,
) -> torch.nn.Module:
    """Build a transformers causal LM from a checkpoint or, with random weights, from a config.

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

    Raises:
        ValueError: bad ``init``/``dtype``, no checkpoint and no ``model_type``, a config that is
            not a causal LM, a ``config`` value of the wrong type for transformers (naming
            ``model.config.<key>`` and the type expected), a ``config`` key that is a near miss of a
            field (``num_hidden_layer``), or an embedding table smaller than the tokenizer.
        FileNotFoundError: ``name_or_path`` is neither a local checkpoint (a folder with a
            ``config.json``) nor a reachable hub name.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if init not in ("pretrained", "random"):
        raise ValueError(f"model.init={init!r}: expected 'pretrained' or 'random'")
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: expected one of {list(_DTYPES)}")
    overrides = dict(config or {})
    check_local_path("model.name_or_path", name_or_path)
    if name_or_path:
        folder = Path(name_or_path).expanduser()
        if folder.is_dir() and not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: no config.json in that folder, so not a model checkpoint")
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
    if hf_config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not trust_remote_code:
        raise ValueError(
            f"model {name_or_path or hf_config.model_type!r}: a {hf_config.model_type!r} config is not a causal LM "
            f"(transformers has no AutoModelForCausalLM class for it)"
        )
    if vocab_size is not None:
        if init == "random" and "vocab_size" not in overrides and not name_or_path:
            hf_config.vocab_size = -(-vocab_size // 64) * 64
        elif hf_config.vocab_size < vocab_size:
            raise ValueError(
                f"the model's vocab_size {hf_config.vocab_size} is smaller than the tokenizer's {vocab_size} tokens"
            )
    kwargs = {"dtype": _DTYPES[dtype], "attn_implementation": attn_implementation}
    if init == "random":
        return AutoModelForCausalLM.from_config(hf_config, trust_remote_code=trust_remote_code, **kwargs)
    device = torch.get_default_device()
    if device.type != "cpu":
        kwargs["device_map"] = str(device)
    return AutoModelForCausalLM.from_pretrained(
        name_or_path, config=hf_config, trust_remote_code=trust_remote_code, **kwargs
    )


def _check_config_keys(hf_config: Any, overrides: dict[str, Any]) -> None:
    """Refuse a ``model.config`` key that is a near miss of a field of the model's config class (a typo:
    transformers stores any extra key as an attribute that nothing reads); log the other keys the class
    does not declare (a model may read them with a default, as Qwen3-MoE reads ``head_dim``).

    Raises:
        ValueError: a key within a character or two of a declared field (``num_hidden_layer``).
    """
    import difflib

    cls = type(hf_config)
    known = set(cls().to_dict()) | set(getattr(cls, "attribute_map", {}))
    for key in overrides:
        if key in known or key == "model_type":
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.85)
        if close:
            raise ValueError(f"model.config.{key}: {cls.__name__} has no such field; did you mean model.config.{close[0]}?")
        log.info("model.config.%s: not a declared field of %s; set on the config as given", key, cls.__name__)


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


def add_lora(model: torch.nn.Module, lora: dict[str, Any]) -> torch.nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (or load an existing adapter to train further).

    ``lora`` keys: ``rank``, ``alpha``, ``dropout``, ``target_modules`` (a list of module names,
    ``all-linear``, or, as PEFT reads any other string, a regular expression that must match a
    module's whole name), ``target_parameters`` (a list of names of 3-D expert parameters, e.g.
    ``mlp.experts.gate_up_proj``; optional), ``init_from`` (a PEFT adapter folder; optional).
    With ``init_from`` the adapter's own configuration (rank, alpha, targets) is used and the other
    keys are ignored.

    Raises:
        FileNotFoundError: ``init_from`` is not a folder holding a PEFT ``adapter_config.json``.
        ValueError: a name in ``target_modules`` or ``target_parameters`` matches nothing in
            ``model`` (PEFT would drop it silently, or only warn, and train without that adapter), a
            ``target_modules`` string that is no regular expression or matches no module name (PEFT
            would raise only after loading), or a ``target_parameters`` string.
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.get("init_from"):
        init_from = Path(lora["init_from"]).expanduser()
        if not (init_from / "adapter_config.json").is_file():
            raise FileNotFoundError(
                f"lora.init_from={lora['init_from']!r}: no adapter_config.json there; expected a folder written by "
                "PEFT's save_pretrained (such as <run_dir>/adapter)"
            )
        model = PeftModel.from_pretrained(model, str(init_from), is_trainable=True)
        loaded = model.peft_config["default"]
        modules = loaded.target_modules  # a list, or one regular expression
        targets = [modules] if isinstance(modules, str) else sorted(modules or [])
        rank_zero_info(
            f"lora.init_from={str(init_from)!r}: rank {loaded.r}, alpha {loaded.lora_alpha}, targets "
            f"{targets + list(loaded.target_parameters or [])} (lora.rank/alpha/targets ignored)"
        )
        return model
    target_modules = lora["target_modules"]
    leaves = [name for name, m in model.named_modules() if next(m.children(), None) is None]
    if not isinstance(target_modules, str):
        _check_lora_targets("lora.target_modules", target_modules, leaves)
    elif target_modules.lower() != "all-linear":  # PEFT's shorthand, any case
        _check_lora_regex("lora.target_modules", target_modules, [name for name, _ in model.named_modules() if name], leaves)
    if isinstance(lora.get("target_parameters"), str):  # PEFT takes a list only (TypeError for a str)
        name = lora["target_parameters"]
        raise ValueError(f"lora.target_parameters={name!r}: expected a list of parameter names, such as lora.target_parameters=[{name}]")
    _check_lora_targets("lora.target_parameters", lora.get("target_parameters") or [], [
        name for name, p in model.named_parameters() if p.dim() == 3
    ])
    config = LoraConfig(
        r=lora["rank"],
        lora_alpha=lora["alpha"],
        lora_dropout=lora["dropout"],
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        target_parameters=list(lora["target_parameters"]) if lora.get("target_parameters") else None,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, config)


def _check_lora_targets(key: str, targets: list[str], names: list[str]) -> None:
    """Refuse a LoRA target that matches none of ``names`` as PEFT matches a list: the whole name,
    or its dotted suffix (``q_proj`` matches ``model.layers.0.self_attn.q_proj``).

    Raises:
        ValueError: naming ``key``, the unmatched targets and the model's own suffixes to choose from.
    """
    unmatched = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if unmatched:
        raise ValueError(f"{key}: {unmatched} match nothing in the model; its layers have: {_layer_suffixes(names)}")


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


def check_model_switches(model: dict[str, Any], no_cuda: str | None = None, hint: str = "") -> None:
    """The model switches that need each other or CUDA, from the config (`fit` checks them before writing anything).

    Args:
        model: the ``model`` config.
        no_cuda: why no CUDA device will run the model (e.g. ``"trainer.accelerator=cpu"``), or None.
        hint: appended to the no-CUDA error.

    Raises:
        ValueError: ``model.activation_offload`` without ``model.cuda_graphs``, ``model.cuda_graphs``
            where ``no_cuda`` says why it cannot run, naming every key to change, or a
            ``model.cuda_graphs_keep_max_gib`` that is not a number of GiB >= 0.
    """
    keep_max_bytes(model.get("cuda_graphs_keep_max_gib"))
    offload = bool(model.get("activation_offload"))
    if offload and not model.get("cuda_graphs"):
        raise ValueError("model.activation_offload=true needs model.cuda_graphs=true (the graphed layers offload their inputs)")
    if model.get("cuda_graphs") and no_cuda:
        keys = "model.cuda_graphs=false" + (" model.activation_offload=false" if offload else "")
        raise ValueError(f"model.cuda_graphs=true needs a CUDA device ({no_cuda}): set {keys}{hint}")


def _use_cuda_graphs(
    model: dict[str, Any],
    lora: dict[str, Any],
    attention: str,
    device: torch.device,
    trainer: L.Trainer | None,
    moe_backend: str | None = None,
) -> bool:
    """Whether ``model.cuda_graphs=true`` applies, checked from the config before the model is built.

    Skipped (with a warning) under FSDP2. `check_cuda_graphs`, which `apply_cuda_graphs` runs again
    on the built model, runs here on the config first, so a bad combination fails before 60 GB of
    weights are loaded.

    Raises:
        ValueError: off CUDA, or what `check_cuda_graphs` refuses.
    """
    if trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy):
        rank_zero_warn(
            "model.cuda_graphs=true (and with it model.activation_offload) is skipped under strategy=fsdp2 (FSDP2 "
            "gathers each layer's weights at new addresses every step); set model.cuda_graphs=false to silence this"
        )
        return False
    check_model_switches(model, no_cuda=None if device.type == "cuda" else f"the model is on {device}")
    dropout = lora.get("dropout", 0.0) if lora.get("enabled", True) else 0.0
    router_logits = bool((model.get("config") or {}).get("output_router_logits", False))
    check_cuda_graphs(bool(model.get("gradient_checkpointing")), attention, dropout, moe_backend, router_logits)
    return True


class FinetuneModule(L.LightningModule):
    """Fine-tunes a transformers causal LM on `PackedBatch` micro-batches.

    The model is built in `configure_model` (on the target device), with the packed attention
    backend of ``model.attention`` registered (`lightning_ft.model.attention`; ``auto`` is resolved
    and logged), optional gradient checkpointing, then LoRA through PEFT (or every weight
    trainable with ``lora.enabled=false``), then the fused kernels switched on in ``kernels``
    (`lightning_ft.model.patching`), then with ``model.cuda_graphs`` each decoder layer replayed
    from CUDA graphs (`lightning_ft.strategies.cuda_graphs`); under ``strategy=fsdp2`` the finished model is then sharded
    and `loss_sum` becomes the root unit's forward (`lightning_ft.strategies.fsdp2`). Checkpoints
    hold only the trainable weights.

    Args:
        model: the ``model`` config group (see `lightning_ft.config.ModelConfig`).
        lora: the ``lora`` config group.
        kernels: the ``kernels`` config group: ``rms_norm``, ``rope``, ``swiglu``, ``lora``,
            ``fused_linear_cross_entropy`` switches (all off = stock transformers + PEFT).
        moe: the ``moe`` config group: ``backend`` (``hf`` = stock transformers experts, or
            ``auto``/``native_torch``/``grouped_mm``/``triton``, see `lightning_ft.model.moe`)
            ``train_router`` and ``lora_slots`` (grouped_mm: `augment_expert_weights`).
        optimizer: a partial optimizer taking the trainable parameters (Hydra ``_partial_``).
        scheduler: a partial LR scheduler taking the optimizer, or None; it gets ``num_training_steps``
            (Lightning's ``estimated_stepping_batches``) only where its signature has that argument
            (`scheduler_kwargs`): ``transformers.get_constant_schedule_with_warmup`` needs none.
        vocab_size: the tokenizer's size (for random-init models).
        on_nonfinite: ``stop`` or ``skip`` (``train.on_nonfinite``): what a NaN/Inf loss or gradient does.

    Raises:
        ValueError: an unknown ``on_nonfinite``, or a ``scheduler`` that needs arguments it is not
            given (`scheduler_kwargs`), before the model is built.
    """

    def __init__(
        self,
        model: dict[str, Any],
        lora: dict[str, Any],
        kernels: dict[str, bool] | None = None,
        moe: dict[str, Any] | None = None,
        optimizer: Callable[..., torch.optim.Optimizer] = partial(torch.optim.AdamW, lr=2e-4),
        scheduler: Callable[..., Any] | None = None,
        vocab_size: int | None = None,
        on_nonfinite: str = "stop",
    ):
        super().__init__()
        if on_nonfinite not in ("stop", "skip"):
            raise ValueError(f"train.on_nonfinite={on_nonfinite!r}: expected 'stop' or 'skip'")
        self.model_cfg = dict(model)
        self.lora_cfg = dict(lora)
        self.kernels_cfg = dict(kernels or {})
        self.moe_cfg = dict(moe or {})
        if scheduler is not None:
            scheduler_kwargs(scheduler, 1)  # refuse missing arguments now, not after the model loads
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.vocab_size = vocab_size
        self.on_nonfinite = on_nonfinite
        self.model: torch.nn.Module | None = None
        self.strict_loading = False  # checkpoints hold the trainable weights only
        self.step_losses: list[float | None] = []  # per optimizer step; None for a skipped step
        self.skipped_steps = {"no_target_tokens": 0, "nonfinite": 0}
        self._step_loss_sum = torch.zeros(())
        self._step_target_tokens = 0
        self._pending_step: _PendingStep | None = None
        self._graph_tokens: int | None = None  # with graphed varlen layers: the token count rows are padded to
        self._rng_states_to_restore: dict[str, Any] | None = None
        self.val_loss_sum = SumMetric()
        self.val_tokens = SumMetric()

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        cfg = self.model_cfg
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.get_default_device()
        dtype = _DTYPES.get(cfg.get("dtype", "float32"))
        attention, why = resolve_attention_backend(cfg.get("attention", "auto"), device, dtype)
        moe_backend = self.moe_cfg.get("backend", "hf")
        check_model_switches(cfg)
        cuda_graphs = cfg.get("cuda_graphs") and _use_cuda_graphs(
            cfg, self.lora_cfg, attention, device, self._trainer, moe_backend
        )
        rank_zero_info(f"attention: {attention} ({why})")
        model = load_causal_lm(
            cfg.get("name_or_path"),
            init=cfg.get("init", "pretrained"),
            config=cfg.get("config"),
            dtype=cfg.get("dtype", "float32"),
            vocab_size=self.vocab_size,
            attn_implementation=register_packed_attention(attention),
            trust_remote_code=cfg.get("trust_remote_code", False),
        )
        model.config.use_cache = False
        if cfg.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_cfg.get("enabled", True):
            model = add_lora(model, self.lora_cfg)
            if self._trainer is not None and "mixed" in str(self.trainer.precision):
                _skip_adapter_input_casts(model)
        if moe_backend != "hf":
            backend = apply_moe(model, backend=moe_backend, train_router=self.moe_cfg.get("train_router", False))
            rank_zero_info(f"moe: {backend} experts backend")
            sharded = self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy)
            lora_slots = backend == "grouped_mm" and self.moe_cfg.get("lora_slots", True) and not sharded
            if lora_slots and (augmented := augment_expert_weights(model)):
                rank_zero_info(f"moe: {augmented} expert weights hold their LoRA factors in spare rows and columns (LoRA joins the GEMMs)")
            if cuda_graphs:  # `auto` resolved to native_torch (a GPU without a grouped_mm kernel)
                _use_cuda_graphs(cfg, self.lora_cfg, attention, device, self._trainer, backend)
        for line in apply_kernels(model, self.kernels_cfg):
            rank_zero_info(f"kernel {line}")
        if cuda_graphs:
            offload = bool(cfg.get("activation_offload", False))
            layers = apply_cuda_graphs(
                model,
                keep_attention=cfg.get("cuda_graphs_keep_attention", True),
                activation_offload=offload,
                keep_projections=cfg.get("cuda_graphs_keep_projections", True),
                keep_max_gib=cfg.get("cuda_graphs_keep_max_gib"),
            )
            rank_zero_info(f"cuda graphs: {layers} decoder layers replayed from CUDA graphs in training")
            if attention == "varlen":
                self._graph_tokens = 0
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
        self.model = model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(f"model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable")
        if self._trainer is not None and isinstance(self.trainer.strategy, ModelParallelStrategy):
            # last: fully_shard sees the finished model (patched forwards, checkpointed layers)
            shard_model(self, model, self.trainer.strategy.device_mesh, self.trainer.precision)

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model under the PEFT wrapper (the model itself without LoRA)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def loss_sum(self, batch: PackedBatch) -> torch.Tensor:
        """Sum of the next-token cross-entropy over the target tokens of ``batch`` (fp32 scalar).

        With ``kernels.fused_linear_cross_entropy`` (and a plain linear LM head) the logits are
        never materialised (`lightning_ft.kernels.linear_cross_entropy`).
        """
        hf = self.hf_model
        backbone = getattr(hf, hf.base_model_prefix)
        hidden_1TH = backbone(
            input_ids=batch.input_ids, position_ids=batch.position_ids, packed_batch=batch, use_cache=False
        ).last_hidden_state
        head = hf.get_output_embeddings()
        if self.kernels_cfg.get("fused_linear_cross_entropy") and type(head) is torch.nn.Linear and head.bias is None:
            # targets of position t are labels[t + 1]; the last position has none
            targets_1T = F.pad(batch.labels[:, 1:], (0, 1), value=IGNORE_INDEX)
            loss_sum, _ = fused_linear_cross_entropy(hidden_1TH.flatten(0, 1), head.weight, targets_1T.flatten())
            return loss_sum
        logits = head(hidden_1TH[:, :-1]).float()
        return F.cross_entropy(
            logits.flatten(0, 1), batch.labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    def pad_for_graphs(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` padded (`PackedBatch.padded`) to the token count its CUDA graphs are recorded for.

        With graphed layers and varlen attention, a row of several documents: T rounded up to a
        multiple of `GRAPH_TOKEN_MULTIPLE` (but not past the data module's ``max_tokens``, when
        there is one), and never below the largest count padded to so far, so that packed rows
        (filled to ``data.max_tokens`` but each one a little short of it) all run at one count and
        replay one set of graphs per document-count bucket (`lightning_ft.strategies.cuda_graphs`)
        instead of each length running eagerly the first time and filling the signatures. Measured
        on GSM8K packed to 4096 tokens: 926 rows had 327 layouts; padded, 7, three of them 98% of
        the rows (the padding is 0.8% of the tokens). A row of one document is left alone: it keeps
        SDPA's causal kernel (cuDNN on Hopper, faster than flash-attention 2's varlen), its graphs
        per exact length. Otherwise ``batch`` itself.
        """
        if self._graph_tokens is None or batch.num_docs == 1:
            return batch
        multiple = GRAPH_TOKEN_MULTIPLE
        tokens = max(self._graph_tokens, -(-batch.num_tokens // multiple) * multiple)
        limit = getattr(getattr(self._trainer, "datamodule", None), "max_tokens", None)
        if isinstance(limit, int) and batch.num_tokens <= limit:
            tokens = min(tokens, limit)
        self._graph_tokens = tokens
        return batch.padded(tokens)

    @override
    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        loss_sum = self.loss_sum(self.pad_for_graphs(batch))
        self._step_loss_sum = self._step_loss_sum.to(loss_sum.device) + loss_sum.detach()
        self._step_target_tokens = batch.step_target_tokens
        if batch.step_target_tokens == 0:  # every label of the step is masked: contributes zero (and is skipped)
            return loss_sum * 0.0
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / batch.step_target_tokens
        return loss_sum * scale

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # every micro-batch of the step has run backward (and DDP has averaged the gradients)
        step = self.trainer.global_step + 1
        nonfinite = ~torch.isfinite(self._step_loss_sum)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        # fp16 mixed precision: a GradScaler already skips steps whose gradients overflowed
        if scaler is None:
            # under FSDP2 each rank checks its own shards; the flag is summed over ranks below
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            if grads:
                nonfinite = nonfinite | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).float()).all()
        totals = torch.stack([self._step_loss_sum.float(), nonfinite.float()])
        if self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        self._step_loss_sum = torch.zeros((), device=self._step_loss_sum.device)
        self._pending_step = None
        if scaler is None and self._step_target_tokens and _skips_on_device(optimizer):
            # the optimizer skips the update itself where found_inf == 1 (weights, moments and step count)
            optimizer.found_inf = (totals[1] > 0).float()
            self._pending_step = _PendingStep(step, optimizer, totals)
            return
        self._finish_step(step, *totals.tolist(), optimizer)  # one host sync, before the update

    def _finish_step(self, step: int, loss_sum: float, nonfinite_ranks: float, optimizer: Any, queued: bool = False) -> None:
        """Stop, skip or log the step from its host values; ``queued``: the update is already queued
        on the device, which skips it where the step was non-finite (``found_inf``)."""
        if nonfinite_ranks:
            if self.on_nonfinite == "stop":
                raise TrainingStopped(self._nonfinite_message(step))
            rank_zero_warn(f"optimizer step {step}: non-finite loss or gradient; the step is skipped (train.on_nonfinite=skip)")
            self.skipped_steps["nonfinite"] += 1
            if not queued:
                optimizer.zero_grad(set_to_none=True)
            self._log_skipped()
            return
        if self._step_target_tokens == 0:
            self.skipped_steps["no_target_tokens"] += 1
            optimizer.zero_grad(set_to_none=True)
            self._log_skipped()
            return
        loss = loss_sum / self._step_target_tokens
        self.log("train/loss", host_scalar(loss), prog_bar=True)
        self.step_losses.append(loss)

    def _log_skipped(self) -> None:
        # NaN, not nothing: the loggers would otherwise write the previous step's loss for this step
        self.log("train/loss", host_scalar(float("nan")), prog_bar=True)
        self.step_losses.append(None)

    @override
    def configure_gradient_clipping(
        self, optimizer: torch.optim.Optimizer, gradient_clip_val: float | None = None, gradient_clip_algorithm: str | None = None
    ) -> None:
        plugin = self.trainer.precision_plugin
        if isinstance(plugin, MixedPrecision) and plugin.scaler is None and gradient_clip_val:
            # bf16-mixed has no GradScaler, so nothing is unscaled inside a fused optimizer, but
            # Lightning's MixedPrecision.clip_gradients refuses every fused optimizer (fp16's case):
            # clip as its base class does (torch's clip_grad_norm_ / clip_grad_value_)
            algorithm = GradClipAlgorithmType((gradient_clip_algorithm or "norm").lower())
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    def _nonfinite_message(self, step: int) -> str:
        # every rank gets here together (the flag was summed over ranks): gathering FSDP2 shards is safe
        bad = [n for n, p in self.model.named_parameters() if p.grad is not None and not torch.isfinite(full_tensor(p.grad)).all()]
        shown = ", ".join(bad[:8]) + (f" and {len(bad) - 8} more" if len(bad) > 8 else "")
        ckpt = self.trainer.checkpoint_callback
        last = (ckpt.last_model_path or ckpt.best_model_path) if ckpt is not None else ""
        kept = f"the last good checkpoint is {last} (resume with ckpt_path=last)" if last else "no checkpoint was written yet"
        if bad:
            where = f"{len(bad)} tensors with non-finite gradients: {shown}"
        elif self.trainer.world_size > 1:
            where = "no non-finite gradient on this rank: the loss or another rank's gradients"
        else:
            where = "the loss; no gradient is non-finite"
        return (
            f"non-finite loss or gradient at optimizer step {step} ({where}); training stopped without "
            f"updating the weights (train.on_nonfinite=stop), {kept}. Lower optimizer.lr, check the data, or set "
            "train.on_nonfinite=skip to skip such steps"
        )

    @override
    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        pending, self._pending_step = self._pending_step, None
        if pending is not None:  # the update is queued: now read what on_before_optimizer_step flagged
            self._finish_step(pending.step, *pending.read(), optimizer, queued=True)
        # Free the gradients now. Lightning zeroes them in the next step's closure, after its
        # training_step and before its backward, so they would sit through that forward: one copy of
        # every trainable tensor (measured 0.6 GiB on 12 layers of Qwen3-30B-A3B with LoRA on the experts).
        optimizer.zero_grad(set_to_none=True)

    @override
    def on_train_start(self) -> None:
        if self._rng_states_to_restore is not None:
            _set_rng_states(self._rng_states_to_restore)
            self._rng_states_to_restore = None

    @override
    def on_train_batch_end(self, outputs: Any, batch: PackedBatch, batch_idx: int) -> None:
        max_steps = self.trainer.max_steps
        if max_steps > 0 and self.trainer.global_step >= max_steps:
            # ask the loop to stop now: Lightning then runs validation once more (if there is any)
            self.trainer.should_stop = True

    @override
    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        self.val_loss_sum.update(self.loss_sum(batch))
        self.val_tokens.update(batch.num_target_tokens)

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss_sum.compute() / self.val_tokens.compute().clamp(min=1)
        self.log_dict({"val/loss": loss, "val/perplexity": loss.exp()}, prog_bar=True)
        self.val_loss_sum.reset()
        self.val_tokens.reset()

    @override
    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        kwargs = scheduler_kwargs(self.scheduler_factory, self.trainer.estimated_stepping_batches)
        scheduler = self.scheduler_factory(optimizer, **kwargs)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["step_losses"] = self.step_losses
        checkpoint["skipped_steps"] = dict(self.skipped_steps)
        # every rank's RNG states (dropout draws differ per rank); a collective: all ranks save together
        states = _rng_states()
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * self.trainer.world_size
            torch.distributed.all_gather_object(gathered, states)
            checkpoint["rng_states"] = gathered
        else:
            checkpoint["rng_states"] = [states]

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.step_losses = list(checkpoint.get("step_losses", []))
        self.skipped_steps.update(checkpoint.get("skipped_steps", {}))
        states = checkpoint.get("rng_states")
        if states is None:
            return
        if len(states) != self.trainer.world_size:
            rank_zero_warn(
                f"the checkpoint holds RNG states of {len(states)} ranks, this run has {self.trainer.world_size}: "
                "random draws (dropout) will differ from the interrupted run; resume with the same trainer.devices to replay it"
            )
            return
        self._rng_states_to_restore = states[self.trainer.global_rank]


def scheduler_kwargs(scheduler: Callable[..., Any], num_training_steps: int) -> dict[str, Any]:
    """The keyword arguments `FinetuneModule.configure_optimizers` passes ``scheduler`` besides the
    optimizer: ``num_training_steps`` where its signature takes it (by name or ``**kwargs``), else
    none. A schedule that does not depend on the run's length (``get_constant_schedule_with_warmup``,
    torch's ``StepLR``) gets no ``num_training_steps``; one that does (the cosine default) gets it.

    Raises:
        ValueError: naming ``scheduler._target_`` and the arguments it still lacks (set them under
            ``scheduler.``).
    """
    func = getattr(scheduler, "func", scheduler)  # Hydra's _partial_: a functools.partial
    target = f"{getattr(func, '__module__', '')}.{getattr(func, '__qualname__', func)}".lstrip(".")
    try:
        signature = inspect.signature(scheduler)
    except (TypeError, ValueError):  # no signature to read (a builtin): pass it as before
        return {"num_training_steps": num_training_steps}
    params = signature.parameters.values()
    takes = any(p.name == "num_training_steps" or p.kind is p.VAR_KEYWORD for p in params)
    kwargs = {"num_training_steps": num_training_steps} if takes else {}
    try:
        signature.bind(object(), **kwargs)  # the optimizer
    except TypeError as err:
        missing = [p.name for p in list(params)[1:] if p.default is p.empty and p.name not in kwargs
                   and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not missing:  # e.g. it takes no optimizer
            raise ValueError(f"scheduler._target_={target}: cannot be called with the optimizer ({err})") from None
        hint = " ".join(f"+scheduler.{name}=..." for name in missing)
        raise ValueError(f"scheduler._target_={target}: needs {', '.join(missing)}, which nothing sets: add {hint}") from None
    return kwargs


def host_scalar(value: float) -> torch.Tensor:
    """``value`` as a float32 tensor on the host, for ``self.log``.

    Why: Lightning turns a logged Python number into a tensor on the module's device, a blocking
    copy (the host waits for every kernel queued before it, on the H200 the optimizer's update), and
    its progress bar and loggers read it back with ``.item()``: two host syncs per logged value and
    step. A host tensor stays on the host (Lightning moves a logged tensor nowhere). Not for
    ``sync_dist=True`` under NCCL, whose all-reduce needs the tensor on the GPU (these values need no
    reduction: the loss is summed over ranks before it is logged, tokens/s counts all ranks' tokens).
    """
    return torch.tensor(value, dtype=torch.float32)


def _skips_on_device(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` skips a step itself where ``found_inf`` is 1, leaving its state as if the
    step had not run: fused torch Adam/AdamW (``_step_supports_amp_scaling``). Not fused SGD: its
    first step makes the momentum buffers with ``empty_like`` and, skipped, leaves them unwritten
    (NaN weights after the next step; found by a new-user run with torch 2.13).
    """
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and getattr(optimizer, "_step_supports_amp_scaling", False)


class _PendingStep:
    """An optimizer step queued before its loss and non-finite flag were read on the host.

    ``totals`` ([2] float32: the loss sum and the number of ranks that saw a non-finite value) is
    copied to pinned host memory without blocking, behind a CUDA event: `read` waits for that
    event only, not for the update queued after it. The optimizer's ``found_inf`` is removed once
    read (a later step sets its own).
    """

    def __init__(self, step: int, optimizer: torch.optim.Optimizer, totals: torch.Tensor):
        self.step, self.optimizer = step, optimizer
        self.totals = totals.to("cpu", non_blocking=True)  # pinned when copied from CUDA
        self.copied = None
        if totals.is_cuda:
            self.copied = torch.cuda.Event()
            self.copied.record()

    def read(self) -> list[float]:
        """[loss sum, non-finite ranks] on the host."""
        if self.copied is not None:
            self.copied.synchronize()
        del self.optimizer.found_inf
        return self.totals.tolist()


def _rng_states() -> dict[str, Any]:
    """The RNG states a training step can draw from: Python, NumPy, torch CPU and CUDA (all devices).

    Only tuples, lists, ints, floats, strings and tensors, so that checkpoints load with
    ``torch.load(weights_only=True)``.
    """
    import numpy as np

    name, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_states(states: dict[str, Any]) -> None:
    import numpy as np

    name, keys, pos, has_gauss, cached_gaussian = states["numpy"]
    random.setstate(states["python"])
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached_gaussian))
    torch.set_rng_state(states["torch"])
    if states["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
