"""Running the real CLI from tests, and test-only Lightning callbacks it loads by ``_target_``.

The callbacks are added to a run with ``+callbacks.<name>._target_=cli_helpers.<Class>``; `run_cli`
puts this folder on ``PYTHONPATH`` (the DDP ranks Lightning launches inherit it).
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import torch

from lightning_ft.strategies.fsdp2 import full_tensor

TESTS_DIR = Path(__file__).resolve().parent

_EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:")

#: a small, fast run of the built-in default: 60 arithmetic rows packed into 15 rows of ≤ 128 tokens, as many
#: epochs as the test's ``trainer.max_steps=N`` needs (the default stops after one epoch)
FAST = ("callbacks.progress_bar=null", "data.num_examples=60", "data.max_tokens=128", "trainer.log_every_n_steps=1",
        "trainer.max_epochs=-1")


def run_cli(
    run_dir: Path, *overrides: str, ok: bool = True, timeout: int = 300, preexec_fn=None, cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """``python -m lightning_ft fit hydra.run.dir=<run_dir> <overrides>`` in ``cwd`` (default: ``run_dir``); asserts its
    exit status (0 when ``ok``). ``preexec_fn`` runs in the child before the command (e.g. a `resource.setrlimit`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    flags = [o for o in overrides if o.startswith("-")]  # Hydra's flags (-m) go before the overrides
    cmd = [sys.executable, "-m", "lightning_ft", "fit", *flags, f"hydra.run.dir={run_dir}", *(o for o in overrides if o not in flags)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.run(cmd, cwd=cwd or run_dir, env=env, capture_output=True, text=True, timeout=timeout, preexec_fn=preexec_fn)
    # every process's exception line (a second rank's traceback may be far from the end), then the tails
    errors = "\n".join(line for line in proc.stderr.splitlines() if _EXCEPTION_LINE.match(line))
    output = f"exceptions raised:\n{errors}\n---\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    assert (proc.returncode == 0) == ok, f"exit status {proc.returncode}\n{output}"
    return proc


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def assert_first_step_grads_close(got: dict, expected: dict) -> None:
    """Gradients of a first optimizer step (`DumpGradients`) agree to fp32 rounding of another summation order."""
    assert got.keys() == expected.keys() and expected
    for name, g in expected.items():
        scale = g.abs().max().item()
        if "lora_A" in name:  # lora_B is still zero at the first step, so lora_A's gradient is exactly zero
            assert scale == 0 and got[name].abs().max() == 0, name
            continue
        assert scale > 0, name
        torch.testing.assert_close(got[name], g, rtol=1e-6, atol=1e-6 * scale, msg=name)


class CrashAtStep(L.Callback):
    """Ends the process abruptly (``os._exit``: no cleanup, like a kill) once ``step`` optimizer steps are done.

    It fires at the start of the next micro-batch, so step ``step``'s checkpoint has been written
    (ModelCheckpoint saves in ``on_train_batch_end``).
    """

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(17)


class DumpGradients(L.Callback):
    """Saves the gradients of the first optimizer step to ``<path>/rank<r>.pt`` (after DDP's all-reduce or
    FSDP2's reduce-scatter, gathered whole; before clipping)."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == 0:
            self.path.mkdir(parents=True, exist_ok=True)
            grads = {n: full_tensor(p.grad).detach().clone() for n, p in pl_module.named_parameters() if p.grad is not None}
            torch.save(grads, self.path / f"rank{trainer.global_rank}.pt")


class NonFiniteAtStep(L.Callback):
    """Makes optimizer step ``step``'s loss NaN: the (frozen) LM head is NaN during that step only."""

    def __init__(self, step: int):
        self.step = step
        self._saved: torch.Tensor | None = None

    def _head(self, pl_module) -> torch.Tensor:
        return pl_module.hf_model.get_output_embeddings().weight

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step + 1 == self.step and self._saved is None:
            with torch.no_grad():
                self._saved = self._head(pl_module).clone()
                self._head(pl_module).fill_(math.nan)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._saved is not None:
            with torch.no_grad():
                self._head(pl_module).copy_(self._saved)
            self._saved = None


class BypassLora(L.Callback):
    """A patched forward that skips an adapter (the MoE-LoRA failure): ``module`` calls only its base layer."""

    def __init__(self, module: str):
        self.module = module

    def on_train_start(self, trainer, pl_module) -> None:
        layer = pl_module.model.base_model.model.get_submodule(self.module)
        layer.forward = layer.base_layer.forward


class SignalAtStep(L.Callback):
    """Sends this process ``signal_name`` (SIGTERM: as a scheduler does; SIGINT: Ctrl-C) once ``step``
    optimizer steps are done, as each training batch starts (every process of a DDP run signals itself, as
    ``kill -TERM -<pgid>`` does; with ``rank``, that process alone); with ``in_validation``, as the first validation
    batch after ``step`` starts."""

    def __init__(self, step: int, signal_name: str = "SIGTERM", in_validation: bool = False, rank: int | None = None):
        self.step = step
        self.signal_name = signal_name
        self.in_validation = in_validation
        self.rank = rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self.in_validation:
            self._signal(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if self.in_validation and not trainer.sanity_checking:
            self._signal(trainer)

    def _signal(self, trainer) -> None:
        if trainer.global_step >= self.step and self.rank in (None, trainer.global_rank):
            import signal

            if self.signal_name == "SIGINT" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
                # A script that starts the tests in the background (`cmd &` without job control) starts every
                # process with SIGINT ignored, and Python then installs no KeyboardInterrupt handler. Ctrl-C
                # comes from a terminal, where Python's own handler is in place: put that one back.
                signal.signal(signal.SIGINT, signal.default_int_handler)
            os.kill(os.getpid(), getattr(signal, self.signal_name))


class OutOfMemoryAtStep(L.Callback):
    """Raises the CPU allocator's out-of-memory RuntimeError once ``step`` optimizer steps are done."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:118] . DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 123456789 bytes.")


class DumpTrainedModel(L.Callback):
    """At the end of training: the loss of a fixed packed batch as the running strategy computes it (every rank
    takes part) and the whole trained model's weights, gathered, saved by rank 0 to ``path``."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        from lightning_ft.data.packing import collate_packed

        g = torch.Generator().manual_seed(0)
        docs = [(ids, ids) for ids in (torch.randint(3, 200, (n,), generator=g).tolist() for n in (23, 9, 40))]
        pl_module.eval()  # no LoRA dropout
        with torch.no_grad():
            loss_sum = pl_module.loss_sum(collate_packed(docs).to(pl_module.device)).cpu()
        pl_module.train()
        weights = get_model_state_dict(pl_module.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if trainer.is_global_zero:
            torch.save({"docs": docs, "loss_sum": loss_sum, "weights": weights}, self.path)


class DumpLogits(L.Callback):
    """At the end of training: the trained model's logits (eval mode, fp32 on the host) for a fixed batch of
    token ids, saved with the ids to ``path``: the reference an exported model is compared with."""

    def __init__(self, path: str):
        self.path = Path(path)

    def on_train_end(self, trainer, pl_module) -> None:
        ids = torch.randint(3, 200, (2, 24), generator=torch.Generator().manual_seed(0))
        pl_module.model.eval()
        with torch.no_grad():
            logits = pl_module.model(input_ids=ids.to(pl_module.device)).logits.float().cpu()
        pl_module.model.train()
        torch.save({"input_ids": ids, "logits": logits}, self.path)


class StopAtStep(L.Callback):
    """Asks the loop to stop (``trainer.should_stop``, as a Timer or early stopping does) once ``step`` optimizer
    steps are done."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            trainer.should_stop = True


class SignalInSetup(L.Callback):
    """Sends this process SIGTERM in Lightning's ``setup`` hook: after the data is set up, before the model is built
    (a scheduler's SIGTERM while a run loads)."""

    def setup(self, trainer, pl_module, stage) -> None:
        import signal

        os.kill(os.getpid(), signal.SIGTERM)
