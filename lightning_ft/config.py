"""Structured configs: the schema Hydra checks every run's config against.

`fit.yaml` lists ``fit_schema`` first in its defaults, so a misspelt key (``data.max_token=``) or a
wrong type fails at composition with Hydra's error naming the key. Group options (``model=``,
``data=``, ...) are YAML files under ``configs/``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore


@dataclass
class ModelConfig:
    """``model=``: which network to fine-tune and how to build it."""

    name_or_path: Optional[str] = None  # local checkpoint folder or hub name (from_pretrained)
    init: str = "pretrained"  # pretrained | random (random weights from `config`, for benchmarks)
    config: dict[str, Any] = field(default_factory=dict)  # HF config values (whole config for init=random)
    tokenizer: Optional[str] = None  # default: name_or_path; `builtin` = the project's own BPE tokenizer
    dtype: str = "float32"  # float32 | bfloat16 | float16: the weights' dtype
    gradient_checkpointing: bool = False  # recompute activations in backward: less memory, ~1/3 more compute
    trust_remote_code: bool = False


@dataclass
class DataConfig:
    """``data=``: where the training rows come from and how they are packed."""

    path: str = "builtin:arithmetic"  # .jsonl/.json/.parquet file, `datasets` name, or builtin:<task>
    format: str = "auto"  # auto | qa | instruction | chat | text
    split: str = "train"
    max_tokens: int = 1024  # token budget of a packed micro-batch: memory grows with it
    train_on_prompt: bool = False
    overflow: str = "truncate"  # truncate | drop examples longer than max_tokens
    num_examples: Optional[int] = None  # first N rows (builtin tasks: N generated rows)
    val_fraction: float = 0.0
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
    init_from: Optional[str] = None  # a PEFT adapter folder to continue training


@dataclass
class KernelsConfig:
    """``kernels=``: fused Triton kernels patched into the model (``none``: stock transformers)."""

    rms_norm: bool = False
    rope: bool = False
    swiglu: bool = False
    fused_linear_cross_entropy: bool = False  # never materialises the [T, vocab] logits


@dataclass
class MoeConfig:
    """``moe=``: how Mixture-of-Experts layers run (``hf``: stock transformers experts)."""

    backend: str = "hf"  # hf | auto | native_torch | grouped_mm | triton (lightning_ft.modules.moe)
    train_router: bool = False


@dataclass
class FitConfig:
    """The whole config of ``python -m lightning_ft fit``."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    moe: MoeConfig = field(default_factory=MoeConfig)
    optimizer: Any = None  # a `_partial_` optimizer
    scheduler: Any = None  # a `_partial_` LR scheduler taking (optimizer, num_training_steps), or null
    trainer: dict[str, Any] = field(default_factory=dict)  # lightning.Trainer arguments
    callbacks: dict[str, Any] = field(default_factory=dict)  # name → `_target_` callback (null removes one)
    logger: Any = None  # a `_target_` Lightning logger, or null
    seed: int = 42
    ckpt_path: Optional[str] = None  # resume: `last` or a checkpoint file
    run_dir: str = "."  # where outputs go: the Hydra run directory


def config_dir() -> str:
    """Absolute path of the Hydra configs: the installed ``lightning_ft.configs`` package data, or
    ``configs/`` beside the package in a source checkout used through ``PYTHONPATH``."""
    spec = importlib.util.find_spec("lightning_ft.configs")
    if spec is not None and spec.submodule_search_locations:
        return str(Path(list(spec.submodule_search_locations)[0]).resolve())
    return str(Path(__file__).resolve().parent.parent / "configs")


def register_configs() -> None:
    """Register `FitConfig` as ``fit_schema`` in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="fit_schema", node=FitConfig)
