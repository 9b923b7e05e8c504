"""Structured configs: the schema Hydra checks every run's config against.

`fit.yaml` lists ``fit_schema`` first in its defaults, so a misspelt key (``data.max_token=``) or a
wrong type fails at composition with Hydra's error naming the key; one added with ``+`` (which Hydra
lets through) is refused when the run starts (`unknown_schema_keys`). Group options (``model=``,
``data=``, ...) are YAML files under ``configs/``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Mapping
from datetime import datetime
from dataclasses import dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


#: keys of the ``model`` config that the ``strategy`` config group owns now → their new names
MOVED_KEYS = {
    "model.cuda_graphs": "strategy.cuda_graphs",
    "model.cuda_graphs_keep_attention": "strategy.keep_attention",
    "model.cuda_graphs_keep_projections": "strategy.keep_projections",
    "model.cuda_graphs_keep_max_gib": "strategy.keep_max_gib",
    "model.activation_offload": "strategy.activation_offload",
}


@dataclass
class ModelConfig:
    """``model=``: which network to fine-tune and how to build it."""

    name_or_path: Optional[str] = None  # local checkpoint folder or hub name (from_pretrained)
    init: str = "pretrained"  # pretrained | random (random weights from `config`, for benchmarks)
    config: dict[str, Any] = field(default_factory=dict)  # HF config values (whole config for init=random)
    tokenizer: Optional[str] = None  # default: name_or_path; `builtin` = the project's own BPE tokenizer
    dtype: str = "float32"  # float32 | bfloat16 | float16: the weights' dtype
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    attention: str = "auto"  # auto | varlen | flex | sdpa packed attention (auto: varlen on CUDA in bf16/fp16, else sdpa)
    trust_remote_code: bool = False
    quantization: str = "none"  # none | nf4: the frozen linear layers in 4 bits (QLoRA; bitsandbytes' NF4 + double quantisation; pip install -e ".[qlora]"), MoE experts too with moe.backend=triton | mxfp4: gpt-oss's experts in MXFP4 (moe.backend=triton)


@dataclass
class StrategyConfig:
    """``strategy=``: how a training step runs on its devices (the lightning_ft Strategy: one device,
    ``strategy=ddp`` or ``strategy=fsdp2``; `lightning_ft.strategies.strategy`)."""

    cuda_graphs: Any = "auto"  # true | false | auto: replay each checkpointed decoder layer from CUDA graphs in training (CUDA, model.gradient_checkpointing, attention auto|cudnn|varlen|sdpa, no dropout, packed rows; skipped under fsdp2); auto: where the run allows them, else eager (one line says why)
    keep_attention: bool = True  # with cuda_graphs: keep attention's output and softmax statistics for the backward (skips its recompute; per layer, while it fits)
    keep_projections: bool = True  # with cuda_graphs: keep the projections' outputs (LoRA q/k/v/o..., MoE experts' gate/up) for the backward (skips those GEMMs' recompute; per layer, while it fits)
    keep_max_gib: Optional[float] = None  # with cuda_graphs: cap the kept outputs (all kinds together, GiB, in layer order); null: the memory plan's, else while 90% of the GPU's memory holds
    activation_offload: bool = False  # with cuda_graphs: each layer's checkpointed input waits in pinned host memory for the backward (copies overlapped with compute)
    memory_budget_gib: Any = "auto"  # GPU memory a step may use (GiB) for the memory plan of what is kept, offloaded or recomputed; auto: free memory less a margin; null: no plan (off CUDA: never a plan)
    host_budget_gib: Any = "auto"  # pinned host memory the memory plan may offload to (GiB); auto: the host's available memory less 25%, shared by the node's processes; null: no limit
    fp8: bool = False  # frozen base weights of the LoRA linear layers (and, on moe.backend=triton, MoE experts) in e4m3 (per-output-channel scales, the experts one per expert; half their memory), their GEMMs in fp8 (Hopper, sm90+; not with strategy=fsdp2)
    fp8_lm_head: bool = False  # with fp8: the frozen lm_head in e4m3 too (half its memory), its logits and input-gradient GEMMs in fp8 in the chunked linear cross-entropy (kernels.fused_linear_cross_entropy); a head tied to the input embeddings or trained (lora.modules_to_save) stays as it is


@dataclass
class DataConfig:
    """``data=``: where the training rows come from and how they are packed."""

    path: str = MISSING  # .jsonl/.json/.parquet file, `datasets` name, or builtin:<task> (required: `???` in a YAML file would not override a default)
    format: str = "auto"  # auto | qa | instruction | chat | prompt_completion | text
    split: str = "train"
    max_tokens: int = 1024  # token budget of a packed micro-batch: memory grows with it
    train_on_prompt: bool = False
    overflow: str = "truncate"  # truncate | drop examples longer than max_tokens
    num_examples: Optional[int] = None  # first N rows (builtin tasks: N generated rows)
    val_fraction: float = 0.0  # share of the packed rows held out for validation
    val_path: Optional[str] = None  # or a separate validation file (every row used)
    max_no_target_fraction: float = 0.5  # stop if more examples than this have no target token after masking
    system_prompt: Optional[str] = None
    num_workers: int = 0


@dataclass
class LoraConfig:
    """``lora=``: PEFT LoRA adapters (``lora=none``: full fine-tuning)."""

    enabled: bool = True
    rank: int = 16
    alpha: float = 32.0
    dropout: float = 0.0
    target_modules: Any = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    target_parameters: Optional[list[str]] = None  # 3-D expert weights, e.g. mlp.experts.gate_up_proj
    modules_to_save: Optional[list[str]] = None  # whole modules trained and saved in the adapter (PEFT), e.g. [embed_tokens, lm_head]; costs a copy of each
    init_from: Optional[str] = None  # a PEFT adapter folder to continue training


@dataclass
class KernelsConfig:
    """``kernels=``: fused Triton kernels patched into the model (``none``: stock transformers)."""

    rms_norm: bool = False
    rope: bool = False
    swiglu: bool = False
    lora: bool = False  # each PEFT LoRA linear layer in three matmuls (kernels/lora.py)
    fused_linear_cross_entropy: bool = False  # never materialises the [T, vocab] logits


@dataclass
class MoeConfig:
    """``moe=``: how Mixture-of-Experts layers run (``hf``: stock transformers experts)."""

    backend: str = "hf"  # hf | auto | native_torch | grouped_mm | triton (lightning_ft.model.moe)
    train_router: bool = False  # train the routers (with LoRA: saved in the adapter through lora.modules_to_save)
    # grouped_mm: frozen expert weights hold their LoRA factors in spare rows and columns, so LoRA
    # joins the expert GEMMs (faster steps for R*(N+C) more elements per expert)
    lora_slots: bool = True
    # the experts of longer rows run over the tokens in chunks of this many (one chunk's working set at a time):
    # auto (chunks of at most 2 GiB of gate/up output, in checkpointed layers: no extra compute) | a token count | null: never
    chunk_tokens: Any = "auto"


@dataclass
class TrainConfig:
    """``train.``: what the training loop does when a step goes wrong."""

    on_nonfinite: str = "stop"  # NaN/Inf loss or gradient: stop (the last good checkpoint is kept) | skip the step


@dataclass
class EvalConfig:
    """``eval.``: validation (when ``data.val_fraction`` or ``data.val_path`` gives validation data)."""

    every_n_steps: Optional[int] = None  # validate every N optimizer steps (default: every epoch end); always at the end
    limit_batches: Optional[int] = None  # each validation runs the first N packed rows (per process; null: all of them)
    generate: bool = False  # exact-match accuracy of greedy generations (GSM8K style: the text after `####`)
    num_examples: int = 32  # validation examples generated for (each costs max_new_tokens forward passes)
    max_new_tokens: int = 64


@dataclass
class FitConfig:
    """The whole config of ``python -m lightning_ft fit``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    optimizer: Any = None  # a `_partial_` optimizer
    scheduler: Any = None  # a `_partial_` LR scheduler taking the optimizer (and num_training_steps where its signature has it), or null
    trainer: dict[str, Any] = field(default_factory=dict)  # lightning.Trainer arguments
    callbacks: dict[str, Any] = field(default_factory=dict)  # name → `_target_` callback (null removes one)
    logger: Any = None  # a `_target_` Lightning logger, or null
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    device: str = "auto"  # auto | gpu | cpu: the options of trainer, precision, kernels and moe nobody chose (lightning_ft.device)
    seed: int = 42
    ckpt_path: Optional[str] = None  # resume: `last` or a checkpoint file
    run_dir: str = "."  # where outputs go: the Hydra run directory
    optimized_metric: Optional[str] = None  # a summary.json key the task returns (for sweepers such as Optuna)


def config_dir() -> str:
    """Absolute path of the Hydra configs: the installed ``lightning_ft.configs`` package data, or
    ``configs/`` beside the package in a source checkout used through ``PYTHONPATH``."""
    spec = importlib.util.find_spec("lightning_ft.configs")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return str(Path(__file__).resolve().parent.parent / "configs")


#: each command's primary config (``configs/<name>.yaml``)
COMMAND_CONFIGS = {"fit": "fit", "bench": "benchmark"}
#: the group each command adds with ``+group=NAME``: not in its defaults list, so that the ``+`` works
ADDED_GROUPS = {"fit": "experiment", "bench": "bench"}


def run_name(environ: Mapping[str, str] | None = None) -> str:
    """The last part of the default run folder (``hydra.run.dir``: ``outputs/<date>/<run_name>``) and
    sweep folder (``hydra.sweep.dir``), Hydra's resolver ``${lightning_ft.run_name:}``; resolved once
    per job and cached like Hydra's ``${now:}`` (a sweep's jobs share their sweep's value).

    Runs started together get folders of their own:

    - in a SLURM job step (``srun``: ``SLURM_STEP_ID`` set): ``slurm-<job>.<step>``, where ``<job>`` is
      ``<array job>_<task>`` for an array task (SLURM's ``%A_%a``) or the job id: different for every
      job, array task and step, and the same for every task of one step (the ranks of a multi-node job
      share one folder);
    - otherwise: the local time to the millisecond and the process id, ``HH-MM-SS.mmm_p<pid>``, with
      ``_slurm-<job>`` before the pid in a SLURM batch script.

    Args:
        environ: the environment to read the SLURM variables from (default: ``os.environ``).
    """
    env = os.environ if environ is None else environ
    job = env.get("SLURM_JOB_ID")
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    if job and env.get("SLURM_STEP_ID"):
        return f"slurm-{job}.{env['SLURM_STEP_ID']}"
    now = datetime.now()
    return f"{now:%H-%M-%S}.{now.microsecond // 1000:03d}" + (f"_slurm-{job}" if job else "") + f"_p{os.getpid()}"


def register_configs() -> None:
    """Register `FitConfig` as ``fit_schema`` in Hydra's ConfigStore, the ``lightning_ft.groups``
    resolver of the ``--help`` page (`groups_help`) and the ``lightning_ft.run_name`` resolver of the
    default run folders (`run_name`, cached like Hydra's ``now``); idempotent."""
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="fit_schema", node=FitConfig)
    OmegaConf.register_new_resolver("lightning_ft.groups", groups_help, replace=True)
    OmegaConf.register_new_resolver("lightning_ft.run_name", run_name, use_cache=True, replace=True)


def config_groups(command: str, search_dirs: tuple[Path, ...] = ()) -> dict[str, list[str]]:
    """The config groups ``command`` reads (its primary config's defaults list and its `ADDED_GROUPS`
    group) and their options (the YAML file stems under `config_dir` and under each of ``search_dirs``, a
    user's ``hydra.searchpath`` folders: `searchpath_dirs`), sorted."""
    from omegaconf import DictConfig

    roots = (Path(config_dir()), *search_dirs)
    defaults = _primary_config(command).get("defaults", [])
    read = {str(next(iter(entry))) for entry in defaults if isinstance(entry, DictConfig)} | {ADDED_GROUPS[command]}
    options = {name: sorted({f.stem for root in roots for f in (root / name).glob("*.yaml")}) for name in sorted(read)}
    return {name: found for name, found in options.items() if (Path(config_dir()) / name).is_dir() or found}


def searchpath_dirs(overrides: list[str]) -> tuple[Path, ...]:
    """The local folders of a ``hydra.searchpath=[file://DIR, ...]`` override (``pkg://`` entries are left out)."""
    dirs: list[Path] = []
    for item in overrides:
        key, _, value = item.partition("=")
        if key.lstrip("+") != "hydra.searchpath":
            continue
        for entry in value.strip("[] ").split(","):
            entry = entry.strip().strip("'\"")
            if entry.startswith("file://"):
                dirs.append(Path(entry.removeprefix("file://")))
            elif entry and "://" not in entry:
                dirs.append(Path(entry))
    return tuple(dirs)


def _primary_config(command: str) -> Any:
    from omegaconf import OmegaConf

    return OmegaConf.load(Path(config_dir()) / f"{COMMAND_CONFIGS[command]}.yaml")


def command_schema(command: str) -> type:
    """The schema of ``command``'s config, for hints and checks: `FitConfig` for ``fit``; for ``bench`` a
    dataclass of ``configs/benchmark.yaml``'s top-level keys (any value) and `FitConfig`'s fields of the
    groups it reads (``model``, ``lora``, ...), so that a key missing from either is found as in ``fit``."""
    from dataclasses import fields, make_dataclass
    from typing import get_type_hints

    if command == "fit":
        return FitConfig
    types, groups = get_type_hints(FitConfig), config_groups(command)
    shared = [(f.name, types[f.name], field(default_factory=f.default_factory)) for f in fields(FitConfig) if f.name in groups]
    keys = [(str(k), Any, None) for k in _primary_config(command) if k not in ("defaults", "hydra") and k not in groups]
    return make_dataclass(f"{command.capitalize()}Config", keys + shared)


def groups_help(config_name: str) -> str:
    """The config groups section of ``--help`` (``configs/hydra/help/lightning_ft.yaml``) for the command whose
    primary config is ``config_name``, a ``+`` before the group it adds; Hydra's own section lists every
    folder under ``configs/`` for each command (bench's presets under fit, fit's data under bench)."""
    command = next(c for c, name in COMMAND_CONFIGS.items() if name == config_name)
    added = ADDED_GROUPS[command]
    return "".join(f"{'+' if name == added else ''}{name}: {', '.join(options)}\n" for name, options in config_groups(command).items())


def trainer_key_hint(name: str) -> list[str]:
    """``trainer.<name>``: [] for a `lightning.Trainer` argument, else one line naming the closest ones."""
    import difflib
    import inspect

    import lightning as L

    known = sorted(set(inspect.signature(L.Trainer.__init__).parameters) - {"self"})
    if name in known:
        return []
    close = difflib.get_close_matches(name, known, n=3)
    return [f"trainer.{name}: not an argument of lightning.Trainer" + (f"; did you mean {', '.join('trainer.' + c for c in close)}?" if close else "")]


def override_hints(overrides: list[str], command: str = "fit") -> list[str]:
    """Hints for command-line overrides of ``command`` that failed to compose (printed after Hydra's error).

    For ``group=option`` with an unknown option (a group of `config_groups`, e.g. ``+bench=``): the
    closest options and all of them; for ``+group=option`` of a group in the defaults list: without the
    ``+``; for a group only the other command reads (``fit +bench=``, ``bench +experiment=``): that
    command. For ``a.b=value`` with a key that is not in the command's schema (`command_schema`):
    `key_hint`; for fit's ``trainer.<name>`` that is not a `lightning.Trainer` argument, the closest
    ones; for ``optimizer.<name>`` / ``scheduler.<name>`` that its ``_target_`` does not take, the closest arguments
    (`callable_key_hint`). Other keys under free-form nodes (``callbacks.``, ``model.config.``) are not
    checked here; Hydra's own message says to add them with ``+``. The last hint is always how to see the composed config.
    """
    import difflib
    import re

    from omegaconf import OmegaConf

    groups = config_groups(command, searchpath_dirs(overrides))
    other_groups = {other: config_groups(other) for other in COMMAND_CONFIGS if other != command}
    schema = OmegaConf.structured(command_schema(command))
    hints = []
    for item in overrides:
        if "=" not in item and not item.startswith(("-", "~")):  # the rest of a value the shell split at a space
            hints.append(f"{item}: not a key=value override; a value with spaces goes in quotes with its key: "
                         "'data.path=\"my data/train.jsonl\"'")
            continue
        if item.startswith("-") or "=" not in item:
            continue
        typed, value = item.split("=", 1)
        if hint := parse_hint(item):
            hints.append(hint)
            continue
        key = typed.lstrip("+~")
        if key.startswith("hydra"):
            continue
        if key in groups:
            unknown = [v for v in re.split(r"[,\s]+", value.strip("[]() ")) if v and v != "null" and v not in groups[key]]
            if typed.startswith("+") and not typed.startswith("++") and key != ADDED_GROUPS[command]:
                hints.append(f"{typed}={value}: `{key}` is in `{command}`'s defaults list: {key}={value}, without the +")
            elif unknown:
                close = sorted({c for v in unknown for c in difflib.get_close_matches(v, groups[key], n=1)})
                suggestion = f"did you mean {', '.join(close)}? " if close else ""
                hints.append(f"{typed}={','.join(unknown)}: not an option of the `{key}` group; {suggestion}options: {', '.join(groups[key])}")
            continue
        if other := next((c for c, read in other_groups.items() if key in read), None):
            hints.append(f"{typed}: `{key}` is a config group of `python -m lightning_ft {other}`, not of `{command}`")
            continue
        node = key.split(".")[0]
        if node == "trainer" and key.count(".") == 1 and node in schema:
            hints += trainer_key_hint(key.split(".")[1])
        elif node in CALLABLE_NODES and key.count(".") == 1 and node in schema:
            hints += callable_key_hint(key, command, overrides)
        elif hint := key_hint(key, schema):
            hints.append(hint)
    hints.append(
        f"`python -m lightning_ft {command} --cfg job [overrides]` prints the composed config; "
        f"`python -m lightning_ft {command} --help` lists the config groups and their options"
    )
    return hints


CALLABLE_NODES = {"optimizer": "optimizer", "scheduler": "optimizer"}  # node: the group whose options set it


def callable_key_hint(key: str, command: str, overrides: list[str]) -> list[str]:
    """``optimizer.<name>`` or ``scheduler.<name>``: one line naming the closest arguments when ``name`` is neither an
    argument of the node's ``_target_`` (as the last ``optimizer=`` option, or the defaults list's, sets it) nor a key
    of the node; [] otherwise, and wherever the target is not known from the files alone (set on the command line or
    by an experiment, a file that does not load, a callable taking ``**kwargs``)."""
    import difflib
    import inspect

    from hydra.utils import get_method
    from omegaconf import DictConfig, OmegaConf

    node, name = key.split(".")
    group = CALLABLE_NODES[node]
    keys = [item.split("=", 1)[0].lstrip("+~") for item in overrides]
    if f"{node}._target_" in keys or "experiment" in keys:
        return []
    chosen = [item.split("=", 1)[1] for item, k in zip(overrides, keys) if k == group and "=" in item]
    option = chosen[-1] if chosen else next(
        (str(e[group]) for e in _primary_config(command).get("defaults", []) if isinstance(e, DictConfig) and group in e), None)
    found = [root / group / f"{option}.yaml" for root in (Path(config_dir()), *searchpath_dirs(overrides))]
    try:
        config = OmegaConf.load(next(f for f in found if f.is_file()))[node]
        target = config["_target_"]
        parameters = inspect.signature(get_method(target)).parameters
    except Exception:  # no such file or node, no _target_, one that does not import: Hydra's message stands alone
        return []
    if name in config or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return []
    known = [n for n in parameters if n not in ("params", "optimizer")]  # what the code passes itself
    if name in known:
        return []
    close = difflib.get_close_matches(name, known, n=3)
    return [f"{key}: not an argument of {target} ({group}={option})"
            + (f"; did you mean {', '.join(f'{node}.{c}' for c in close)}?" if close else f"; arguments: {', '.join(known)}")]


def parse_hint(item: str) -> str | None:
    """For a command-line override that Hydra's grammar rejects (its error does not say which one): one line
    naming it, Hydra's reason and, for a value with ``=`` in it, how to quote it; None for an override that parses."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    try:
        OverridesParser.create().parse_overrides([item])
    except OverrideParseException as err:
        key, value = item.split("=", 1)
        quote = "" if value[:1] in ("'", '"', "[", "{") else f"; a value with spaces, = or characters other than letters, digits " \
            f"and ._-/ goes in quotes: '{key}=\"{value}\"'"
        return f"{item}: Hydra cannot parse this override ({str(err).splitlines()[0]}){quote}"
    return None


def key_hint(key: str, schema: Any) -> str | None:
    """For a dotted ``key`` missing from ``schema`` (a structured config, `command_schema`): one line with the
    closest keys where it goes astray and all the keys there; None for a key in the schema or under a
    free-form node (``trainer.``, ``model.config.``, ...), where any key may be added."""
    from omegaconf import DictConfig

    if hint := moved_key_hint(key):
        return hint
    node: Any = schema
    path: list[str] = []
    for part in key.split("."):
        if not isinstance(node, DictConfig) or not _is_schema_node(node):
            return None
        if part not in node.keys():  # not `in node`: OmegaConf says False for a key whose value is ??? (data.path)
            close = _close_keys(path, part, node, schema)
            where = ".".join(path) or "the top level"
            suggestion = f"did you mean {', '.join(close)}? " if close else ""
            return f"{key}: no key {part!r} in {where}; {suggestion}keys: {', '.join(node.keys())}"
        node = node._get_node(part)
        path.append(part)
    return None


def _close_keys(path: list[str], part: str, node: Any, schema: Any) -> list[str]:
    """Dotted schema keys a user may have meant by ``<path>.<part>``, missing from ``node`` (the schema node at
    ``path``): the closest keys of ``node`` (difflib), then a key of that very name elsewhere in ``schema``, at
    the top level or in another group (``model.fp8`` → ``strategy.fp8``)."""
    import difflib

    close = [".".join([*path, c]) for c in difflib.get_close_matches(part, [str(k) for k in node.keys()], n=3)]
    if path and part in schema.keys():
        close.append(part)
    groups = [g for g in schema.keys() if g != (path or [None])[0] and _is_schema_node(schema._get_node(g))]
    return close + [f"{g}.{part}" for g in groups if part in schema._get_node(g).keys()]


def moved_key_hint(key: str) -> str | None:
    """For a key the ``strategy`` group owns now (`MOVED_KEYS`): one line naming its new key; else None."""
    if key in MOVED_KEYS:
        return f"{key}: moved to {MOVED_KEYS[key]} (the lightning_ft strategy's options): write {MOVED_KEYS[key]}=..."
    return None


def report_key_hints(report: str, command: str = "fit", overrides: list[str] = ()) -> list[str]:
    """`key_hint` lines for the keys missing from ``command``'s schema that Hydra's report of a config that does
    not compose names (``full_key: model.cuda_graphs``: a YAML file of the user's that sets one), but for a key that
    a command-line override sets or leads to (``foo`` of ``foo.bar=1``: `override_hints` names that one)."""
    import re

    from omegaconf import OmegaConf

    schema = OmegaConf.structured(command_schema(command))
    typed = [item.split("=", 1)[0].lstrip("+~") for item in overrides if "=" in item]
    keys = [k for k in dict.fromkeys(re.findall(r"full_key: (\S+)", report)) if not any(t == k or t.startswith(f"{k}.") for t in typed)]
    return [hint for key in keys if (hint := key_hint(key, schema))]


def unknown_schema_keys(cfg: Any, prefix: str = "", root: Any = None) -> list[str]:
    """Keys of a composed config that are not in the schema (`FitConfig`), each with a close schema key
    (`_close_keys`) or, for a key of `MOVED_KEYS`, its new name.

    Hydra's ``+key=value`` adds a key even under a schema node, where nothing reads it (a misspelt
    ``+data.max_token=`` would be ignored); keys under free-form nodes (``trainer``, ``callbacks``,
    ``model.config``, ``optimizer``, ...) are not checked.

    Args:
        cfg: the composed config, or (in the recursion) its node at ``prefix``.
        prefix: the dotted path of ``cfg`` with a trailing dot ("" at the top level).
        root: the whole composed config (default: ``cfg``).

    Returns:
        ``"<dotted key> (did you mean <key>?)"``, ``"<dotted key> (moved to <key>)"`` or ``"<dotted key>"`` per unknown key.
    """
    from dataclasses import fields

    from omegaconf import DictConfig, OmegaConf

    found = []
    root = cfg if root is None else root
    if not (isinstance(cfg, DictConfig) and _is_schema_node(cfg)):
        return found
    names = [f.name for f in fields(OmegaConf.get_type(cfg))]
    for key in cfg.keys():
        dotted = f"{prefix}{key}"
        if key in names:
            found += unknown_schema_keys(cfg._get_node(key), f"{dotted}.", root)
        elif dotted in MOVED_KEYS:
            found.append(f"{dotted} (moved to {MOVED_KEYS[dotted]})")
        else:
            schema = OmegaConf.structured(OmegaConf.get_type(root))
            close = _close_keys(prefix.split(".")[:-1], str(key), OmegaConf.select(schema, prefix[:-1]) if prefix else schema, schema)
            found.append(dotted + (f" (did you mean {close[0]}?)" if close else ""))
    return found


def _is_schema_node(node: Any) -> bool:
    from omegaconf import OmegaConf

    return is_dataclass(OmegaConf.get_type(node))
