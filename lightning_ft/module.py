"""`FinetuneModule`: the LightningModule that trains a Hugging Face causal LM made by a `ModelBuilder`.

Loss (exact normalisation): an optimizer step covers ``k`` micro-batches on each of ``W`` ranks.
Its loss is the sum of all token losses of the step divided by ``N``, the number of target tokens
in the whole step (``PackedBatch.step_target_tokens``, counted on the host by the data module):

    loss_step = Σ_ranks Σ_micro Σ_tokens ce(token) / N

Lightning divides each micro-batch's returned loss by ``k`` before backward and DDP (or FSDP2)
averages gradients over ``W`` ranks, so each micro-batch returns ``loss_sum · k · W / N``. This
equals one big batch holding every micro-batch of the step (not the mean of per-micro-batch means).

MoE load-balancing loss (``model.config.output_router_logits``; `lightning_ft.model.router`): each
micro-batch also returns ``router_aux_loss_coef · aux_loss`` (transformers' ``aux_loss`` of its
packed row), so the step trains on the mean of the micro-batches' (and ranks') ``aux_loss`` times
the coefficient, as a transformers model's ``loss`` adds it per forward. ``train/loss`` stays the
token-normalised LM loss (comparable with ``val/loss``); ``train/aux_loss`` logs that step's mean
unscaled ``aux_loss``. Validation computes no ``aux_loss``.

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
(``optimizer_step``), so the GPU never idles while the host decides (a sync before the update
leaves the GPU idle while the host launches the update, a few ms per step on a large MoE model;
benchmarks/RESULTS.md). Other optimizers read the flag first,
one device sync before the update, and skip by setting the gradients to None. A skipped step
logs ``train/loss`` as NaN (summary.json: null). Gradient clipping under bf16-mixed works with a
fused optimizer (`configure_gradient_clipping`; Lightning refuses it, for fp16's GradScaler).

Checkpoints also hold every rank's RNG states (restored at ``on_train_start``), the per-step
losses and the skip counters, so a resumed run replays an uninterrupted one exactly.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import warnings
from functools import partial
from typing import Any, Callable

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.connectors.data_connector import _parse_num_batches
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities import GradClipAlgorithmType
from lightning.pytorch.utilities import rank_zero_warn
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torchmetrics import SumMetric
from typing_extensions import override

from lightning_ft.callbacks.checkpoint import training_ends_after_this_batch
from lightning_ft.data.packing import PackedBatch
from lightning_ft.data.tokenization import IGNORE_INDEX
from lightning_ft.errors import TrainingStopped, check_choice
from lightning_ft.kernels.linear_cross_entropy import fused_linear_cross_entropy, gradient_bytes
from lightning_ft.model.attention import packed_forward
from lightning_ft.model.build import ModelBuilder
from lightning_ft.model.lora import active_module
from lightning_ft.model.router import aux_loss_coef, load_balancing_loss
from lightning_ft.model.support import decoder_of
from lightning_ft.strategies.cuda_graphs import GRAPH_TOKEN_MULTIPLE
from lightning_ft.strategies.fp8 import Fp8Linear
from lightning_ft.strategies.fsdp2 import full_tensor, local_tensor, shard_model

# The validation loss is logged once the torchmetrics sums were synced across processes (`on_validation_epoch_end`):
# Lightning's advice to log it with sync_dist=True under DDP would only average equal values.
warnings.filterwarnings("ignore", message=r"It is recommended to use `self.log\('val/(loss|perplexity)'",
                        category=PossibleUserWarning)


#: train.on_nonfinite: what a NaN/Inf loss or gradient does
ON_NONFINITE = ("stop", "skip")


class FinetuneModule(L.LightningModule):
    """Fine-tunes a transformers causal LM on `PackedBatch` micro-batches.

    The model is made in `configure_model` (on the target device) by the `ModelBuilder` given
    (`lightning_ft.model.build`); under ``strategy=fsdp2`` the finished model is then sharded and
    `loss_terms` becomes the root unit's forward (`lightning_ft.strategies.fsdp2`). Checkpoints hold
    only the trainable weights.

    Args:
        model: the `ModelBuilder` that makes the model to train (called once, in `configure_model`).
        optimizer: a partial optimizer taking the trainable parameters (Hydra ``_partial_``).
        scheduler: a partial LR scheduler taking the optimizer, or None; it gets ``num_training_steps``
            (`training_steps`: Lightning's ``estimated_stepping_batches``) only where its signature has that argument
            (`scheduler_kwargs`): ``transformers.get_constant_schedule_with_warmup`` needs none.
        on_nonfinite: ``stop`` or ``skip`` (``train.on_nonfinite``): what a NaN/Inf loss or gradient does.

    Raises:
        ValueError: an unknown ``on_nonfinite``, or a ``scheduler`` that needs arguments it is not
            given (`scheduler_kwargs`), before the model is built.
    """

    def __init__(
        self,
        model: ModelBuilder,
        optimizer: Callable[..., torch.optim.Optimizer] = partial(torch.optim.AdamW, lr=2e-4),
        scheduler: Callable[..., Any] | None = None,
        on_nonfinite: str = "stop",
    ):
        super().__init__()
        check_choice("train.on_nonfinite", on_nonfinite, ON_NONFINITE)
        self.builder = model
        if scheduler is not None:
            scheduler_kwargs(scheduler, 1)  # refuse missing arguments now, not after the model loads
        self.optimizer_factory = optimizer
        self.scheduler_factory = scheduler
        self.on_nonfinite = on_nonfinite
        self.model: torch.nn.Module | None = None
        self.fused_linear_cross_entropy = False  # set from the built model (`BuiltModel`)
        self.aux_loss_coef: float | None = None  # router_aux_loss_coef where output_router_logits, from the built model
        self.packed = True  # the architecture takes packed rows (`lightning_ft.model.support`)
        self.plain_head = True  # its logits are lm_head(hidden)
        self.strict_loading = False  # checkpoints hold the trainable weights only
        self.step_losses: list[float | None] = []  # per optimizer step; None for a skipped step
        self.skipped_steps = {"no_target_tokens": 0, "nonfinite": 0}
        self._step_loss_sum = torch.zeros(())
        self._step_target_tokens = 0
        self._step_aux_sum = torch.zeros(())  # the step's aux_loss summed over its micro-batches
        self._step_micro_batches = 0
        self._pending_step: _PendingStep | None = None
        self._graph_tokens: int | None = None  # with graphed varlen layers: the token count rows are padded to
        self._rng_states_to_restore: dict[str, Any] | None = None
        self.val_loss_sum = SumMetric()
        self.val_tokens = SumMetric()

    @override
    def configure_model(self) -> None:
        if self.model is not None:
            return
        trainer = self._trainer
        sharded = trainer is not None and isinstance(trainer.strategy, ModelParallelStrategy)
        built = self.builder(
            trainer.strategy.root_device if trainer is not None else torch.get_default_device(),
            precision=str(trainer.precision) if trainer is not None else None,
            sharded=sharded,
            execution=getattr(trainer.strategy, "execution", None) if trainer is not None else None,
        )
        self.model = built.model
        if trainer is not None and (stats := getattr(trainer.datamodule, "stats", None)) is not None:
            warn_positions_past_limit(stats.longest_document, self.hf_model.config)
        if trainer is not None and hasattr(trainer.strategy, "execution"):
            trainer.strategy.execution = built.execution  # `auto` resolved: the memory plan and summary read the bool
        self.fused_linear_cross_entropy = built.fused_linear_cross_entropy
        self.aux_loss_coef = aux_loss_coef(self.hf_model.config)
        self.packed, self.plain_head = built.packed, built.plain_head
        if built.pad_for_graphs:
            self._graph_tokens = 0
        if sharded:
            # last: fully_shard sees the finished model (patched forwards, checkpointed layers)
            shard_model(self, self.model, trainer.strategy.device_mesh, trainer.precision)

    @property
    def hf_model(self) -> torch.nn.Module:
        """The transformers model under the PEFT wrapper (the model itself without LoRA)."""
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def loss_sum(self, batch: PackedBatch) -> torch.Tensor:
        """Sum of the next-token cross-entropy over the target tokens of ``batch`` (fp32 scalar); no ``aux_loss``."""
        return self.loss_terms(batch, aux=False)[0]

    def loss_terms(self, batch: PackedBatch, aux: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The loss sum of ``batch`` (`loss_sum`) and, with ``aux`` and the load-balancing loss on
        (``model.config.output_router_logits``), its unscaled ``aux_loss`` (fp32 scalar, transformers'
        function on this row's router logits: `lightning_ft.model.router.load_balancing_loss`), else None.

        With ``kernels.fused_linear_cross_entropy`` (and a plain linear LM head whose output the model
        uses as its logits, PEFT's ``modules_to_save`` copy of one included) the logits are never
        materialised (`lightning_ft.kernels.linear_cross_entropy`). An architecture that cannot take
        packed rows gets its documents as padded rows (`PackedBatch.padded_rows`); one that changes its
        logits after the head gets them from its own forward (`lightning_ft.model.support`). Under
        ``strategy=fsdp2`` this is the root unit's forward.
        """
        hf = self.hf_model
        if self.packed:
            inputs = {"input_ids": batch.input_ids, "position_ids": batch.position_ids, "packed_batch": batch}
            labels = batch.labels
        else:  # the architecture cannot take packed rows: its documents one per padded row
            inputs = batch.padded_rows()
            labels = inputs.pop("labels")
            del inputs["position_ids"]  # the model's own, as for a document alone (RoBERTa's count from its pad index)
        router_logits = aux and self.aux_loss_coef is not None
        # only a model whose config has output_router_logits takes the argument (a dense one would pass it on)
        if self.aux_loss_coef is not None:
            inputs["output_router_logits"] = router_logits
        with packed_forward() if self.packed else contextlib.nullcontext():  # no transformers mask for a packed row
            if self.plain_head:
                out = decoder_of(hf)(**inputs, use_cache=False)
            else:  # the model changes its logits after the LM head: its own forward makes them
                out = hf(**inputs, use_cache=False)
                logits = out.logits[:, :-1].float()
        aux_loss = load_balancing_loss(hf, out.router_logits) if router_logits else None
        if self.plain_head:
            hidden_BTH = out.last_hidden_state
            if (fused := self._fused_head()) is not None:
                # targets of position t are labels[t + 1]; the last position has none
                targets_BT = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
                weight, weight_scale = fused
                loss_sum, _ = fused_linear_cross_entropy(hidden_BTH.flatten(0, 1), weight, targets_BT.flatten(),
                                                         weight_scale=weight_scale)  # fmt: skip
                return loss_sum, aux_loss
            logits = active_module(hf.get_output_embeddings())(hidden_BTH[:, :-1]).float()
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels[:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
        return loss_sum, aux_loss

    def loss_gradient_bytes(self, batch: PackedBatch) -> int:
        """Bytes the loss of ``batch`` holds for its gradient beyond its no-grad forward (the memory plan's base,
        `lightning_ft.strategies.profiler`): with the chunked linear cross-entropy, its
        `lightning_ft.kernels.linear_cross_entropy.gradient_bytes` over the row's tokens (its padded rows' where the
        architecture takes no packed rows): d hidden in the head's dtype (bf16 over an e4m3 head) and its copy in the
        model's dtype where that differs, plus an e4m3 head's transposed copy and a chunk's e4m3 dz rows; 0 otherwise."""
        if not self.plain_head or (fused := self._fused_head()) is None:
            return 0
        weight, weight_scale = fused
        vocab, hidden = weight.shape
        fp8 = weight_scale is not None
        tokens = batch.num_tokens if self.packed else batch.num_docs * batch.max_seqlen
        return gradient_bytes(tokens, hidden, vocab, 2 if fp8 else weight.element_size(), fp8,
                              hidden_element_size=self.hf_model.dtype.itemsize)  # fmt: skip

    def _fused_head(self) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """The (weight [V, H], row scales [V] fp32 or None) the chunked linear cross-entropy takes: a plain linear LM
        head without bias (PEFT's ``modules_to_save`` copy of one included), e4m3 with its scales under
        ``strategy.fp8_lm_head``; None where ``kernels.fused_linear_cross_entropy`` is off or the head is another module."""
        head = active_module(self.hf_model.get_output_embeddings())
        if not self.fused_linear_cross_entropy or type(head) not in (torch.nn.Linear, Fp8Linear) or head.bias is not None:
            return None
        return (head.weight_fp8, head.weight_scale) if type(head) is Fp8Linear else (head.weight, None)

    def pad_for_graphs(self, batch: PackedBatch) -> PackedBatch:
        """``batch`` padded (`PackedBatch.padded`) to the token count its CUDA graphs are recorded for.

        With graphed layers and varlen attention, a row of several documents: T rounded up to a
        multiple of `GRAPH_TOKEN_MULTIPLE` (but not past the data module's ``max_tokens``, when
        there is one), and never below the largest count padded to so far, so that packed rows
        (filled to ``data.max_tokens`` but each one a little short of it) all run at one count and
        replay one set of graphs per document-count bucket (`lightning_ft.strategies.cuda_graphs`)
        instead of each length running eagerly the first time and filling the signatures (on GSM8K
        packed to 4096 tokens, a few hundred layouts become a handful, for under 1% of the tokens in
        padding). A row of one document is left alone: it keeps
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
        loss_sum, aux_loss = self.loss_terms(self.pad_for_graphs(batch))
        self._step_loss_sum = self._step_loss_sum.to(loss_sum.device) + loss_sum.detach()
        self._step_target_tokens = batch.step_target_tokens
        if aux_loss is not None:
            self._step_aux_sum = self._step_aux_sum.to(aux_loss.device) + aux_loss.detach()
            self._step_micro_batches += 1
        if batch.step_target_tokens == 0:  # every label of the step is masked: contributes zero (and is skipped)
            return loss_sum * 0.0
        scale = self.trainer.accumulate_grad_batches * self.trainer.world_size / batch.step_target_tokens
        if aux_loss is not None and self.aux_loss_coef:
            # Lightning divides by k and DDP averages over W: the step gets coef · (mean aux_loss)
            return loss_sum * scale + self.aux_loss_coef * aux_loss
        return loss_sum * scale

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # every micro-batch of the step has run backward (and DDP has averaged the gradients)
        step = self.trainer.global_step + 1
        aux_mean = self._step_aux_sum.to(self._step_loss_sum.device).float() / max(self._step_micro_batches, 1)
        nonfinite = ~torch.isfinite(self._step_loss_sum) | ~torch.isfinite(aux_mean)
        scaler = getattr(self.trainer.precision_plugin, "scaler", None)
        # fp16 mixed precision: a GradScaler already skips steps whose gradients overflowed
        if scaler is None:
            # under FSDP2 each rank checks its own shards; the flag is summed over ranks below
            grads = [local_tensor(p.grad) for p in self.model.parameters() if p.grad is not None]
            if grads:
                nonfinite = nonfinite | ~torch.isfinite(torch.stack(torch._foreach_norm(grads)).float()).all()
        totals = torch.stack([self._step_loss_sum.float(), nonfinite.float(), aux_mean])
        if self.trainer.world_size > 1:
            totals = self.trainer.strategy.reduce(totals, reduce_op="sum")
        self._step_loss_sum = torch.zeros((), device=self._step_loss_sum.device)
        self._step_aux_sum = torch.zeros((), device=self._step_loss_sum.device)
        self._step_micro_batches = 0
        self._pending_step = None
        if scaler is None and self._step_target_tokens and _skips_on_device(optimizer):
            # the optimizer skips the update itself where found_inf == 1 (weights, moments and step count)
            optimizer.found_inf = (totals[1] > 0).float()
            self._pending_step = _PendingStep(step, optimizer, totals)
            return
        self._finish_step(step, *totals.tolist(), optimizer)  # one host sync, before the update

    def _finish_step(
        self, step: int, loss_sum: float, nonfinite_ranks: float, aux_sum: float, optimizer: Any, queued: bool = False
    ) -> None:
        """Stop, skip or log the step from its host values (``aux_sum``: the ranks' mean ``aux_loss``s
        summed); ``queued``: the update is already queued on the device, which skips it where the step
        was non-finite (``found_inf``)."""
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
        if self.aux_loss_coef is not None:
            self.log("train/aux_loss", host_scalar(aux_sum / self.trainer.world_size))
        self.step_losses.append(loss)

    def _log_skipped(self) -> None:
        # NaN, not nothing: the loggers would otherwise write the previous step's loss for this step
        self.log("train/loss", host_scalar(float("nan")), prog_bar=True)
        if self.aux_loss_coef is not None:
            self.log("train/aux_loss", host_scalar(float("nan")))
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
        # every trainable tensor (large with LoRA on the experts of an MoE model).
        optimizer.zero_grad(set_to_none=True)

    @override
    def on_train_start(self) -> None:
        if self._rng_states_to_restore is not None:
            _set_rng_states(self._rng_states_to_restore)
            self._rng_states_to_restore = None

    @override
    def on_train_batch_end(self, outputs: Any, batch: PackedBatch, batch_idx: int) -> None:
        if training_ends_after_this_batch(self.trainer):
            # ask the loop to stop now: Lightning then runs validation once more (if there is any), also when
            # eval.every_n_steps validates by batch count (which the last batch of the last epoch may not meet)
            self.trainer.should_stop = True

    @override
    def validation_step(self, batch: PackedBatch, batch_idx: int) -> None:
        self.val_loss_sum.update(self.loss_sum(batch))
        self.val_tokens.update(batch.num_target_tokens)

    @override
    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss_sum.compute() / self.val_tokens.compute().clamp(min=1)
        self.log_dict({"val/loss": loss, "val/perplexity": loss.exp()}, prog_bar=True)  # global: compute() synced the sums
        self.val_loss_sum.reset()
        self.val_tokens.reset()

    @override
    def configure_optimizers(self) -> Any:
        params = [p for p in self.model.parameters() if p.requires_grad]
        optimizer = self.optimizer_factory(params)
        if self.scheduler_factory is None:
            return optimizer
        kwargs = scheduler_kwargs(self.scheduler_factory, training_steps(self.trainer))
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


def training_steps(trainer: L.Trainer) -> int | float:
    """The optimizer steps of the run, as Lightning's ``Trainer.estimated_stepping_batches`` counts them
    (``min(ceil(batches per epoch / accumulate_grad_batches) × max_epochs, max_steps)``, the batches cut to
    ``trainer.limit_train_batches``), with the batches per epoch from the datamodule
    (``train_batches_per_epoch``, `PackedDataModule`) where it has them; float("inf") for a run bounded by
    neither steps nor epochs.

    Note: bounded by ``trainer.max_epochs``, Lightning's own count sets up the training loader and
    starts its iterator (and its workers) here, in ``configure_optimizers``, before a resumed run's loop
    state is restored; the loader then never receives its saved position, and a resumed run would train
    the epoch's first rows again (or, with workers, the rows of the epoch the iterator started in).
    """
    count = getattr(trainer.datamodule, "train_batches_per_epoch", None)
    if trainer.max_epochs == -1 or count is None:  # max_epochs=-1: Lightning's count reads max_steps only
        return trainer.estimated_stepping_batches
    batches = _parse_num_batches(RunningStage.TRAINING, count(), trainer.limit_train_batches)
    steps = math.ceil(batches / trainer.accumulate_grad_batches) * max(trainer.max_epochs, 1)
    return steps if trainer.max_steps == -1 else min(steps, trainer.max_steps)


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
    except (TypeError, ValueError):  # no signature to read (a builtin): pass num_training_steps
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
    (NaN weights after the next step, with torch 2.13).
    """
    return isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)) and getattr(optimizer, "_step_supports_amp_scaling", False)


class _PendingStep:
    """An optimizer step queued before its loss and non-finite flag were read on the host.

    ``totals`` ([3] float32: the loss sum, the number of ranks that saw a non-finite value and the
    ranks' mean ``aux_loss``s summed) is
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
        """[loss sum, non-finite ranks, aux_loss sum] on the host."""
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


def warn_positions_past_limit(longest_document: int, config: Any) -> None:
    """Warn (once, rank 0) when a document is longer than the model's ``max_position_embeddings``: its later
    positions lie past the context the model was trained for (RoPE extrapolation), so they train on positions
    the model has not seen. Packed rows restart positions at each document, so only a document's length counts.

    Args:
        longest_document: tokens of the longest document (`lightning_ft.data.datamodule.PackingStats`).
        config: the model's transformers config (``max_position_embeddings`` absent or None: no check).
    """
    limit = getattr(config, "max_position_embeddings", None)
    if isinstance(limit, int) and 0 < limit < longest_document:
        rank_zero_warn(
            f"a document of {longest_document} tokens is longer than the model's max_position_embeddings={limit}: "
            f"positions past {limit} are beyond the context it was trained for; lower data.max_tokens to {limit} to "
            "truncate them, or extend the context on purpose (model.config.rope_parameters)"
        )

