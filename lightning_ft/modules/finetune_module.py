"""`FinetuneModule`: the LightningModule that builds, patches and trains a Hugging Face causal LM.

Loss (exact normalisation): an optimizer step covers ``k`` micro-batches on each of ``W`` ranks.
Its loss is the sum of all token losses of the step divided by ``N``, the number of target tokens
in the whole step (``PackedBatch.step_target_tokens``, counted on the host by the data module):

    loss_step = Σ_ranks Σ_micro Σ_tokens ce(token) / N

Lightning divides each micro-batch's returned loss by ``k`` before backward and DDP averages
gradients over ``W`` ranks, so each micro-batch returns ``loss_sum · k · W / N``. This equals one
big batch holding every micro-batch of the step (not the mean of per-micro-batch means).
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import SumMetric
from typing_extensions import override

from lightning_ft.data.packing import PackedBatch
from lightning_ft.data.tokenization import IGNORE_INDEX
from lightning_ft.kernels.linear_cross_entropy import fused_linear_cross_entropy
from lightning_ft.modules.attention import register_packed_attention
from lightning_ft.modules.moe import apply_moe
from lightning_ft.modules.patching import apply_kernels

log = logging.getLogger(__name__)

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
        attn_implementation: passed to transformers (``lightning_ft`` for packed attention).

    Raises:
        ValueError: bad ``init``/``dtype``, no checkpoint and no ``model_type``, a config that is
            not a causal LM, or an embedding table smaller than the tokenizer.
        FileNotFoundError: ``name_or_path`` is neither a local checkpoint nor a reachable hub name.
    """
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if init not in ("pretrained", "random"):
        raise ValueError(f"model.init={init!r}: expected 'pretrained' or 'random'")
    if dtype not in _DTYPES:
        raise ValueError(f"model.dtype={dtype!r}: expected one of {list(_DTYPES)}")
    overrides = dict(config or {})
    if name_or_path:
        try:
            hf_config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **overrides)
        except OSError as err:
            raise FileNotFoundError(f"model.name_or_path={name_or_path!r}: not a model checkpoint ({err})") from err
    elif init == "random" and "model_type" in overrides:
        hf_config = AutoConfig.for_model(overrides.pop("model_type"), **overrides)
    else:
        raise ValueError("set model.name_or_path, or model.init=random with model.config.model_type")
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


def add_lora(model: torch.nn.Module, lora: dict[str, Any]) -> torch.nn.Module:
    """Wrap ``model`` with PEFT LoRA adapters (or load an existing adapter to train further).

    ``lora`` keys: ``rank``, ``alpha``, ``dropout``, ``target_modules`` (module names or
    ``all-linear``), ``target_parameters`` (names of 3-D expert parameters, e.g.
    ``mlp.experts.gate_up_proj``; optional), ``init_from`` (a PEFT adapter folder; optional).
    """
    from peft import LoraConfig, PeftModel, get_peft_model

    if lora.get("init_from"):
        return PeftModel.from_pretrained(model, lora["init_from"], is_trainable=True)
    target_modules = lora["target_modules"]
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


class FinetuneModule(L.LightningModule):
    """Fine-tunes a transformers causal LM on `PackedBatch` micro-batches.

    The model is built in `configure_model` (on the target device), with the packed attention
    function registered, optional gradient checkpointing, then LoRA through PEFT (or every weight
    trainable with ``lora.enabled=false``), then the fused kernels switched on in ``kernels``
    (`lightning_ft.modules.patching`). Checkpoints hold only the trainable weights.

    Args:
        model: the ``model`` config group (see `lightning_ft.config.ModelConfig`).
        lora: the ``lora`` config group.
        kernels: the ``kernels`` config group: ``rms_norm``, ``rope``, ``swiglu``,
            ``fused_linear_cross_entropy`` switches (all off = stock transformers + PEFT).
        moe: the ``moe`` config group: ``backend`` (``hf`` = stock transformers experts, or
            ``auto``/``native_torch``/``grouped_mm``/``triton``, see `lightning_ft.modules.moe`)
            and ``train_router``.
        optimizer: a partial optimizer taking the trainable parameters (Hydra ``_partial_``).
        scheduler: a partial LR scheduler taking the optimizer and ``num_training_steps``, or None.
        vocab_size: the tokenizer's size (for random-init models).
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
    ):
        super().__init__()
        self.model_cfg = dict(model)
        self.lora_cfg = dict(lora)
        self.kernels_cfg = dict(kernels or {})
        self.moe_cfg = dict(moe or {})
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.vocab_size = vocab_size
        self.model: torch.nn.Module | None = None
        self.strict_loading = False  # checkpoints hold the trainable weights only
        self.step_losses: list[float] = []
        self._step_loss_sum = torch.zeros(())
        self._last_global_step = 0
        self.val_loss_sum = SumMetric()
        self.val_tokens = SumMetric()

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        cfg = self.model_cfg
        model = load_causal_lm(
            cfg.get("name_or_path"),
            init=cfg.get("init", "pretrained"),
            config=cfg.get("config"),
            dtype=cfg.get("dtype", "float32"),
            vocab_size=self.vocab_size,
            attn_implementation=register_packed_attention(),
            trust_remote_code=cfg.get("trust_remote_code", False),
        )
        model.config.use_cache = False
        if cfg.get("gradient_checkpointing"):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora_cfg.get("enabled", True):
            model = add_lora(model, self.lora_cfg)
        if self.moe_cfg.get("backend", "hf") != "hf":
            backend = apply_moe(model, backend=self.moe_cfg["backend"], train_router=self.moe_cfg.get("train_router", False))
            rank_zero_info(f"moe: {backend} experts backend")
        for line in apply_kernels(model, self.kernels_cfg):
            rank_zero_info(f"kernel {line}")
        self.model = model
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        rank_zero_info(f"model: {total / 1e6:.1f}M parameters, {trainable / 1e6:.3f}M trainable")

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

    @override
    def training_step(self, batch: PackedBatch, batch_idx: int) -> torch.Tensor:
        loss_sum = self.loss_sum(batch)
        self._step_loss_sum = self._step_loss_sum.to(loss_sum.device) + loss_sum.detach()
        if batch.step_target_tokens == 0:  # every label of the step is masked: contributes zero
            return loss_sum * 0.0
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / batch.step_target_tokens
        return loss_sum * scale

    @override
    def on_train_start(self) -> None:
        self._last_global_step = self.trainer.global_step

    @override
    def on_train_batch_end(self, outputs: Any, batch: PackedBatch, batch_idx: int) -> None:
        if self.trainer.global_step == self._last_global_step:
            return  # still accumulating
        self._last_global_step = self.trainer.global_step
        # the step's loss: its summed token losses on every rank over the step's target tokens
        loss = self._step_loss_sum * self.trainer.world_size / max(batch.step_target_tokens, 1)
        if self.trainer.world_size > 1:
            loss = self.trainer.strategy.reduce(loss, reduce_op="mean")
        self._step_loss_sum = torch.zeros((), device=loss.device)
        self.log("train/loss", loss, prog_bar=True)
        self.step_losses.append(loss.item())  # one host sync per optimizer step, at its boundary

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
        scheduler = self.scheduler_factory(optimizer, num_training_steps=self.trainer.estimated_stepping_batches)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainable = {f"model.{n}" for n, p in self.model.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["step_losses"] = self.step_losses

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.step_losses = list(checkpoint.get("step_losses", []))
