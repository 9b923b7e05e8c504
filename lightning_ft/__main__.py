"""Command line: ``python -m lightning_ft fit [hydra overrides]`` (or the ``lightning-ft`` script).

Examples::

    python -m lightning_ft fit                                   # built-in default (tiny model, CPU)
    python -m lightning_ft fit +experiment=qwen3_moe            # Qwen3-30B-A3B shape on a GPU
    python -m lightning_ft fit data.path=train.jsonl lora.rank=8
    python -m lightning_ft fit -m lora.rank=4,8                 # a Hydra sweep
    python -m lightning_ft fit --cfg job                         # print the composed config
    python -m lightning_ft bench +bench=llama8b                 # side-by-side step benchmark (GPU)
    python -m lightning_ft bench report                         # benchmarks/RESULTS.md from benchmarks/results.csv
    python -m lightning_ft export outputs/<date>/<time> --merge  # the run's PEFT adapter and a merged HF model

Errors: a config that does not compose prints ``error:`` with Hydra's message and then our hints (a
close key name, the options of a group). An error the project raises on purpose (bad config values,
bad data, a missing model path, a stopped run) prints as one ``error: ...`` line without a traceback
and exits with status 1; Ctrl-C or SIGTERM prints one ``interrupted: ...`` line (with the command that resumes
the run where a checkpoint exists) and exits with status 130 or 143 (128 + the signal). ``HYDRA_FULL_ERROR=1`` shows Hydra's
report with the traceback instead; in a sweep (``-m``) such an error fails the job and the sweeper goes on.
Any other exception shows its traceback. A run refused before it wrote anything removes the run
folder Hydra created for it (`lightning_ft.run_dir.remove_unused_run_dir`).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
import warnings
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any, NoReturn

from hydra.errors import CompactHydraException

from lightning_ft.config import COMMAND_CONFIGS

_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_task_started = False  # a failure before the task starts is a composition error
_argv0 = sys.argv[0]  # the program; `main` shows Hydra's argument parser the command's name instead until the task starts

PROG = "python -m lightning_ft"
#: each command (and subcommand) and its line in ``python -m lightning_ft --help``
COMMANDS = {
    "fit": "fine-tune a causal LM (LoRA or full) on packed batches; the default command",
    "bench": "time training steps beside stock transformers + PEFT and peers (GPU; +bench=tiny_cpu: CPU)",
    "bench report": "benchmarks/RESULTS.md and its plots from the results table",
    "export": "a run's PEFT adapter, and with --merge a merged Hugging Face model (vLLM, transformers)",
}
#: the first words of the commands
_NAMES = [name for name in COMMANDS if " " not in name]
EXAMPLES = """examples:
  python -m lightning_ft fit                          # built-in default: tiny Qwen3-MoE, generated arithmetic, CPU, ~20 s
  python -m lightning_ft fit data=jsonl data.path=train.jsonl lora.rank=8
  python -m lightning_ft bench +bench=tiny_cpu        # the benchmark's CPU preset
  python -m lightning_ft bench report                 # RESULTS.md from the results table (--help: its flags)
  python -m lightning_ft export outputs/<date>/<time> --merge   # adapter/ and merged/ in the run's export/

`python -m lightning_ft fit --help` (or `bench --help`) lists a command's config groups and options;
`bench report --help` and `export --help` list their flags."""
#: the Hydra plugin an override needs: its module, its name, how to install it (an extra of pyproject.toml)
PLUGINS = {
    choice: ("hydra_plugins.hydra_optuna_sweeper", "Hydra's Optuna sweeper (hydra-optuna-sweeper)", 'pip install -e ".[optuna]"')
    for choice in ("hparams_search=optuna", "hydra/sweeper=optuna")
}


class RunError(CompactHydraException):
    """A failure whose message says everything (Hydra prints it without a traceback)."""


def command_parser() -> argparse.ArgumentParser:
    """The command line above the commands: ``--help`` and an unknown command (a command's own arguments are Hydra's)."""
    commands = "".join(f"\n  {name:<14}{summary}" for name, summary in COMMANDS.items())
    return argparse.ArgumentParser(
        prog=PROG, usage=f"%(prog)s {{{','.join(_NAMES)}}} [key=value ...] [+experiment=NAME] [-m]",
        description=f"Fast, lean fine-tuning of Hugging Face causal LMs (Lightning + Hydra).\n\ncommands:{commands}",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def missing_plugin(overrides: list[str]) -> str | None:
    """What to install for an override that picks a Hydra plugin that is not installed (`PLUGINS`; Hydra itself
    would only say that it cannot find ``hydra/sweeper/optuna``), else None."""
    for choice in (item.lstrip("+") for item in overrides):
        if choice in PLUGINS:
            module, name, install = PLUGINS[choice]
            try:
                found = importlib.util.find_spec(module) is not None
            except ModuleNotFoundError:  # not even its namespace package (hydra_plugins)
                found = False
            if not found:
                return f"error: {choice} needs {name}, which is not installed: {install}"
    return None


def _start_task() -> None:
    """Composition is done: later failures are the task's, and ``sys.argv[0]`` is the real one again (Lightning
    starts a multi-device job's other ranks with it)."""
    global _task_started
    if not _task_started:
        _plain_warnings()
    _task_started = True
    sys.argv[0] = _argv0
    if isinstance(sys.stderr, _HeldStderr):
        sys.stderr.stream.write(sys.stderr.take())


def _plain_warnings() -> None:
    """Warnings this package raises print as ``warning: <message>``: their text says what happened and what to do,
    so Python's ``<file>:<line>: UserWarning:`` prefix and the source line add nothing for a user. Warnings
    from elsewhere keep the format they had (Lightning's, Python's)."""
    previous = warnings.formatwarning

    def format_warning(message, category, filename, lineno, line=None) -> str:
        if _in_package(filename):
            return f"warning: {message}\n"
        return previous(message, category, filename, lineno, line)

    warnings.formatwarning = format_warning


def _fit_task(cfg) -> Any:
    """Run `lightning_ft.fit.fit` on the config with ``device`` resolved (`lightning_ft.device.resolve_device`);
    returns ``summary[cfg.optimized_metric]`` when that is set (for sweepers)."""
    _start_task()
    from lightning_ft.callbacks.sigterm import SigtermAtStepEnd
    from lightning_ft.device import resolve_device
    from lightning_ft.errors import TrainingStopped
    from lightning_ft.fit import fit

    from lightning_ft.run_dir import remove_unused_run_dir

    sigterm = SigtermAtStepEnd()
    sigterm.raise_until_training()  # Hydra made the run folder: a SIGTERM from here on is reported and removes it
    _pin_sweep_dir()
    try:
        cfg = resolve_device(cfg)
        summary = fit(cfg, sigterm)
    except (ValueError, FileNotFoundError, ModuleNotFoundError, TrainingStopped) as err:
        remove_unused_run_dir()
        if not _raised_by_us(err):
            raise
        _report(err)
    except BaseException:
        remove_unused_run_dir()
        raise
    finally:
        sigterm.restore()  # (fit restored it already where it ran)
    return summary.get(cfg.optimized_metric) if cfg.optimized_metric else None


def _pin_sweep_dir() -> None:
    """In a sweep, pass this sweep's folder on to the ranks Lightning starts for a multi-device job.

    Lightning starts ranks 1, 2, ... with this process's command line (``sys.argv``) plus
    ``hydra.run.dir``; in a sweep each of them runs the same sweep in step with this process, and
    would otherwise evaluate the default ``hydra.sweep.dir`` (``multirun/<date>/<run_name>``) again, with
    its own process id, and write its log and config.json into a second sweep folder.
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN and not any(a.startswith("hydra.sweep.dir=") for a in sys.argv[1:]):
        sys.argv.append(f'hydra.sweep.dir="{hydra_cfg.sweep.dir}"')


def _report(err: BaseException) -> NoReturn:
    """End the command on ``err``, an error this package raised on purpose (its message says what to fix).

    Ctrl-C or SIGTERM (`lightning_ft.errors.Interrupted`): its one line, exit status 130 or 143. Otherwise ``error: <message>``
    and status 1, printed here rather than by Hydra, which would wrap it in "Error executing job with
    overrides" and HYDRA_FULL_ERROR advice. Raised to Hydra as a `RunError` instead with ``HYDRA_FULL_ERROR=1``
    (Hydra then shows the traceback) and in a sweep (the sweeper records the failed job and goes on).
    """
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    from lightning_ft.errors import Interrupted

    if isinstance(err, Interrupted):
        sys.stderr.write(f"{err}\n")
        raise SystemExit(err.exit_status)
    if os.environ.get("HYDRA_FULL_ERROR") == "1" or HydraConfig.get().mode == RunMode.MULTIRUN:
        raise RunError(f"error: {err}") from err
    sys.stderr.write(f"error: {err}\n")
    raise SystemExit(1)


def _raised_by_us(err: BaseException) -> bool:
    """Whether ``err`` was raised in this package (a message we wrote), not deep in a library."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and _in_package(tb.tb_frame.f_code.co_filename)


def _in_package(filename: str) -> bool:
    """Whether a source file is this package's (also when it is imported through a symbolic link)."""
    return os.path.realpath(filename).startswith(_PACKAGE_DIR + os.sep)


def _bench_task(cfg) -> None:
    _start_task()
    from lightning_ft.bench.runner import run_bench
    from lightning_ft.errors import BenchFailed
    from lightning_ft.run_dir import remove_unused_run_dir

    try:
        run_bench(cfg)
    except (ValueError, BenchFailed) as err:
        remove_unused_run_dir()
        if not _raised_by_us(err):
            raise
        _report(err)
    except BaseException:
        remove_unused_run_dir()
        raise


ALLOCATOR_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


def default_allocator_settings(environ: MutableMapping[str, str]) -> None:
    """Let PyTorch's CUDA caching allocator grow segments in place, unless the user configured it.

    Sets ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` when none of `ALLOCATOR_VARIABLES`
    is set (a user's setting, including ``expandable_segments:False``, is kept), except on Windows,
    WSL and NVIDIA Tegra boards, where the CUDA virtual-memory calls it is built on fail (Unsloth
    sets the same default with the same exceptions: https://github.com/unslothai/unsloth/issues/3511
    and /2401). It must happen before CUDA is initialised, so the command line does it first; DDP
    ranks inherit the environment. Why: with fixed-size segments the allocator reserves many GiB more
    than it hands out on long rows (Qwen3-30B-A3B at 32K and 64K tokens, 48 layers, offloaded
    checkpoints); expandable segments give part of that back at the same step time. PyTorch's notes
    on the setting: "CUDA memory management" in the CUDA semantics docs.
    """
    if any(name in environ for name in ALLOCATOR_VARIABLES):
        return
    release = os.uname().release.lower() if hasattr(os, "uname") else ""
    if os.name == "nt" or "microsoft" in release or "WSL_DISTRO_NAME" in environ or os.path.exists("/etc/nv_tegra_release"):
        return
    environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"


class _ClosedPipeGuard:
    """A text stream (sys.stdout or sys.stderr) that, once its reader has closed the pipe, drops what is written
    instead of raising `BrokenPipeError`: the stream's descriptor is pointed at os.devnull (as Python's documentation
    of SIGPIPE suggests), so the interpreter's flush at exit goes nowhere too. Everything else is the stream's."""

    def __init__(self, stream):
        self._stream, self._closed = stream, False

    def write(self, text: str) -> int:
        if not self._closed:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._drop()
        return len(text)

    def flush(self) -> None:
        if not self._closed:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._drop()

    def _drop(self) -> None:
        self._closed = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self._stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def main(argv: list[str] | None = None) -> None:
    """Dispatch ``argv[0]`` (a command; ``fit`` when omitted) to its Hydra app with the other arguments.

    Output piped into a reader that closes early (``fit ... | head``, ``fit --help | head``) costs the command
    nothing: what is written after is dropped (`_ClosedPipeGuard`), so a training run goes on, finishes and
    reports its status as if its output had been read; no `BrokenPipeError` traceback."""
    streams = sys.stdout, sys.stderr
    # a stream Python set to None (its descriptor closed at start: `fit >&-`) stays None: print() skips it then
    sys.stdout, sys.stderr = (None if s is None else _ClosedPipeGuard(s) for s in streams)
    try:
        _main(argv)
    finally:
        sys.stdout, sys.stderr = streams


def _main(argv: list[str] | None) -> None:
    default_allocator_settings(os.environ)
    import hydra

    from lightning_ft.config import config_dir, register_configs

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["bench", "report"]:  # plain flags, not Hydra's config
        from lightning_ft.bench.report import main as report_main

        raise SystemExit(report_main(argv[2:]))
    if argv[:1] == ["export"]:  # plain flags too
        from lightning_ft.export import main as export_main

        raise SystemExit(export_main(argv[1:]))
    if argv and argv[0] in ("-h", "--help"):
        command_parser().print_help()
        return
    if argv and argv[0] in COMMAND_CONFIGS:
        command, overrides = argv[0], argv[1:]
    elif not argv or "=" in argv[0] or argv[0].startswith(("-", "+")):
        # no command: `fit` (this is also how Lightning relaunches the other ranks under DDP)
        command, overrides = "fit", argv
    else:
        command_parser().error(f"unknown command {argv[0]!r} (choose from {', '.join(_NAMES)})")
    if error := missing_plugin(overrides):
        raise SystemExit(error)
    register_configs()
    # Hydra's argument parser names the program after sys.argv[0] (`__main__.py`); `_start_task` puts it back
    sys.argv = [f"{PROG} {command}", *overrides]
    task = {"fit": _fit_task, "bench": _bench_task}[command]
    app = hydra.main(version_base="1.3", config_path=config_dir(), config_name=COMMAND_CONFIGS[command])(task)
    real_stderr = sys.stderr
    sys.stderr = _held = _HeldStderr(real_stderr)
    try:
        app()
    except SystemExit as exit_:
        if exit_.code not in (0, None) and not _task_started:
            from lightning_ft.config import override_hints, report_key_hints

            report = _held.take()
            if unwritable := _unwritable_run_folder(report):
                real_stderr.write(unwritable)
                raise
            hints = override_hints(overrides, command)
            hints = [h for h in report_key_hints(report, command, overrides) if h not in hints] + hints  # keys in a YAML file
            real_stderr.write(_composition_error(report, bool(hints[:-1])))
            real_stderr.write("".join(f"hint: {line}\n" for line in hints))
        raise
    except KeyboardInterrupt as err:  # Ctrl-C (or SIGTERM) before the Trainer ran (Lightning handles them in it)
        from lightning_ft.errors import SigtermBeforeTraining

        name, status = ("SIGTERM", 143) if isinstance(err, SigtermBeforeTraining) else ("Ctrl-C (SIGINT)", 130)
        real_stderr.write(_held.take() + f"interrupted: stopped by {name} before training started\n")
        raise SystemExit(status) from None
    finally:
        real_stderr.write(_held.take())
        sys.stderr = real_stderr


class _HeldStderr:
    """``sys.stderr`` while Hydra composes the config: what is written is held (Hydra's report of a config that
    does not compose, rewritten by `_composition_error`) until the task starts (`_start_task`), and passed on
    from then on, also through logging handlers that took this object as their stream."""

    def __init__(self, stream: Any):
        self.stream, self.held, self.holding = stream, [], True

    def write(self, text: str) -> int:
        if self.holding:
            self.held.append(text)
            return len(text)
        return self.stream.write(text)

    def take(self) -> str:
        """What was held (emptied), and pass every later write on."""
        text, self.held, self.holding = "".join(self.held), [], False
        return text

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


#: OmegaConf's refusals of a value for a typed key (the type's name in group 1), and those names → ours
_WRONG_TYPE = (r"Value .* of type '\w+' could not be converted to (\w+)", r"Value .* is not a valid (bool) \(type \w+\)")
_TYPE_NAMES = {"Integer": "an integer", "Float": "a number", "bool": "true or false", "String": "a string"}
#: lines of Hydra's report of a config that does not compose that say nothing to a user of this command
_HYDRA_ADVICE = ("Set the environment variable HYDRA_FULL_ERROR=1", "full_key:", "reference_type=", "object_type=")


def _unwritable_run_folder(report: str) -> str | None:
    """For Hydra's ``report`` of a run folder (or its log file) it could not write before the task started (a read-only
    or full file system, no permission): one ``error:`` line naming the path, the reason and the key to change; else
    None."""
    found = re.search(r"^(?:OSError|PermissionError|NotADirectoryError|FileExistsError): \[Errno \d+\] (.+?): '(.+)'$", report, re.M)
    if found is None or "hydra" not in report.lower():
        return None
    return (f"error: {found[2]}: {found[1]} (Hydra writes the run folder and its log there before the run starts); set "
            "hydra.run.dir=<a folder that can be written> (or run from one)\n")


def _composition_error(report: str, hinted: bool) -> str:
    """Hydra's ``report`` of a config that does not compose as ``error: <its message>`` without its
    HYDRA_FULL_ERROR advice and OmegaConf's type details; where our hints name the override (``hinted``),
    only its first line (Hydra's "To append to your config use +key=..." would add a key nothing reads, and
    the hint lists the options); a value of the wrong type for a typed key as ``error: <key>=<value>: expected
    an integer`` (OmegaConf's `_WRONG_TYPE` wording: "Value ... could not be converted to Integer"). A report
    with a traceback or without Hydra's advice (an argument error) is returned as it is."""
    if "Traceback (most recent call last)" in report or _HYDRA_ADVICE[0] not in report:
        return report
    lines = [line for line in report.splitlines() if line.strip() and not line.strip().startswith(_HYDRA_ADVICE)]
    if len(lines) >= 2 and (override := re.fullmatch(r"Error merging override (\S+?=.*)", lines[0])):
        for pattern in _WRONG_TYPE:  # a value of the wrong type for a typed key (lora.rank=eight): said as our checks say it
            if wanted := re.fullmatch(pattern, lines[1]):
                return f"error: {override[1]}: expected {_TYPE_NAMES.get(wanted[1], wanted[1].lower())}\n"
    return "error: " + "\n".join(lines[:1] if hinted else lines) + "\n"


if __name__ == "__main__":
    main()
