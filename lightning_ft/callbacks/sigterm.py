"""SIGTERM stops training at the end of the optimizer step in progress, on every process at once."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import Any, Callable

import lightning as L
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from lightning_ft.callbacks.checkpoint import training_ends_after_this_batch
from lightning_ft.errors import SigtermBeforeTraining

log = logging.getLogger(__name__)


class SigtermAtStepEnd(Callback):
    """Takes over SIGTERM while training: the signal is noted, and every process stops together at the end of
    the optimizer step in progress (after a validation under way), where `StepCheckpoint` saves that step.

    Lightning 2.6's own handler acts where each process notices the signal. With gradient accumulation that
    can be mid-step, where no checkpoint can be written (half-accumulated gradients are not in one), so
    the run stopped with nothing saved since the last periodic checkpoint; in a validation it dropped
    that validation's result; and with several processes, each signalled one runs a collective inside
    the signal handler (a broadcast from rank 0), so a SIGTERM sent to every process (a scheduler
    stopping a job, ``kill -TERM -<pgid>``) left them waiting on each other for good.

    Here the handler only notes the signal (and calls any handler installed before Lightning's, e.g. a job
    launcher's). At each optimizer step's end (the batch that stepped) and at the end of a validation that
    follows one, the processes agree (`Strategy.reduce_boolean_decision`: one all-reduce of a flag, so a
    signal to any one process stops them all) and, when one was signalled, set Lightning's ``received_sigterm``
    on all of them, so that its training loop raises ``SIGTERMException`` after that batch on every process
    alike. During a validation the flag is held back until it ends, so a validation that has begun finishes
    and its loss is logged and kept: a scheduler's grace period must cover the rest of a step and a validation
    (``eval.limit_batches`` bounds the latter). A signal during the last step lets the run finish. The cost is
    that all-reduce once per step where there are several processes (Lightning already broadcasts its flag
    every batch), nothing otherwise. The handler is in place from the sanity-check validation on; Lightning
    restores the handlers it found when training ends.

    Source: Lightning's ``_SignalConnector`` and ``_TrainingEpochLoop.on_advance_end`` (2.6), whose
    ``received_sigterm`` this sets (a private attribute; the behaviour is held by the SIGTERM tests of
    ``tests/test_fit_guarantees.py``).
    """

    def __init__(self) -> None:
        self._signalled = False
        self._step_at_batch_start = 0
        self._stepped = False  # the current training batch finished an optimizer step
        self._others: list[Callable[..., Any]] = []
        self._before_training: Any = None  # the handler `raise_until_training` replaced, while its own is in place

    def raise_until_training(self) -> None:
        """From now until training starts (Lightning's ``on_fit_start``; or `restore`), SIGTERM raises
        `lightning_ft.errors.SigtermBeforeTraining`: loading the tokenizer, the data and the model can take minutes,
        and the default action ended the process there with no message and no summary.json. (Lightning's own
        handler comes later, after ``on_fit_start``, and takes over what was there before this one.)"""
        if threading.current_thread() is threading.main_thread() and self._before_training is None:
            self._before_training = signal.signal(signal.SIGTERM, self._raise)

    def restore(self) -> None:
        """Put back the SIGTERM handler `raise_until_training` replaced (where it is still in place)."""
        if self._before_training is not None:
            if signal.getsignal(signal.SIGTERM) == self._raise:
                signal.signal(signal.SIGTERM, self._before_training)
            self._before_training = None

    @staticmethod
    def _raise(signum: int, frame: FrameType | None) -> None:
        raise SigtermBeforeTraining("stopped by SIGTERM before training started")

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.restore()

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._signalled = False

    @override
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._install(trainer)

    def _install(self, trainer: L.Trainer) -> None:
        if threading.current_thread() is not threading.main_thread():  # signal handlers can only be set there
            return
        current = signal.getsignal(signal.SIGTERM)
        if current == self._note:
            return
        # Lightning's handler is a composite of its own notifier and whatever was installed before it: keep the latter
        connector = trainer._signal_connector
        handlers = getattr(current, "signal_handlers", [current])
        self._others = [h for h in handlers if callable(h) and getattr(h, "__self__", None) is not connector]
        signal.signal(signal.SIGTERM, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        if not self._signalled:
            log.info("SIGTERM: training stops at the end of the optimizer step in progress (a validation under way "
                     "finishes first), where a checkpoint is saved")
        self._signalled = True
        for handler in self._others:
            handler(signum, frame)

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        self._stepped = False

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stepped = trainer.global_step != self._step_at_batch_start
        if self._stepped:
            self._decide(trainer)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:  # hold the stop back: the evaluation loop would end this validation early
            trainer._signal_connector.received_sigterm = False

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # a validation that follows a micro-batch of an unfinished step (a cadence that does not fall on step ends)
        # leaves the decision to that step's end
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING and self._stepped:
            self._decide(trainer)

    def _decide(self, trainer: L.Trainer) -> None:
        """Every process calls this at the same point (a collective where there are several)."""
        stop = trainer.strategy.reduce_boolean_decision(self._signalled, all=False) if trainer.world_size > 1 \
            else self._signalled
        if not stop:
            return
        self._signalled = True
        if training_ends_after_this_batch(trainer):
            return  # the last step is done: the run finishes as if no signal had come
        trainer._signal_connector.received_sigterm = True
