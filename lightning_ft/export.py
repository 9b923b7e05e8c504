"""``python -m lightning_ft export RUN_DIR``: a run's weights as files that transformers, PEFT and vLLM load.

Writes into ``--output`` (default ``RUN_DIR/export``), all at once (a temporary folder renamed into
place at the end; an existing export is replaced only with ``--force``, and never a folder that holds
anything but an export's ``adapter/``, ``base/`` and ``merged/``, nor the run folder itself):

- ``adapter/``: the PEFT LoRA adapter with the tokenizer; ``peft.PeftModel.from_pretrained`` loads it
  over the base that ``adapter_config.json``'s ``base_model_name_or_path`` names.
- ``base/`` (runs with ``model.init=random``): the random base the run trained on, rebuilt from its
  seed, as a Hugging Face model folder; the adapter's ``base_model_name_or_path`` is this folder's
  absolute path. A pretrained run's adapter names ``model.name_or_path``.
- ``merged/`` (``--merge``): the adapter merged into the base (PEFT's ``merge_and_unload``), in the
  base's dtype (a ``model.quantization=nf4`` base dequantised to ``model.dtype`` first, `dequantize_linears`:
  the LoRA update is added to the weights it was trained over, not rounded back into 4 bits; a ``model.quantization=mxfp4``
  run's experts likewise, `lightning_ft.model.mxfp4.dequantize_experts`, and a ``nf4`` run's NF4 experts,
  `lightning_ft.model.nf4_experts.dequantize_experts`), as a plain Hugging Face folder: ``config.json``, safetensors shards, the tokenizer and
  ``generation_config.json``; ``AutoModelForCausalLM.from_pretrained`` and vLLM load it as they load
  the base. A full fine-tuning run (``lora=none``) has no adapter: ``--merge`` writes its model.

The weights come from ``--checkpoint``: ``last`` (``checkpoints/last.ckpt``; the default, falling back
to the run's ``adapter/`` when the run kept no checkpoint), ``best`` (the checkpoint callback's best
checkpoint by its ``monitor``: with the default ``callbacks.checkpoint.monitor=step``, the newest step checkpoint), ``adapter`` (the run's ``adapter/``, written when training finished), or a path to a
``.ckpt`` file or a PEFT adapter folder. The model is rebuilt from the run's ``config.json`` by
`lightning_ft.model.build.ModelBuilder`, as ``fit`` builds it, with every kernel and the MoE patch off
and transformers' own SDPA attention: the saved model is stock transformers. A random base is drawn
on the kind of device the run drew it on (random draws differ between the CPU and CUDA, and may
between GPU models): a GPU run's random base is exported on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_ft.atomic import atomic_folder

if TYPE_CHECKING:
    from lightning_ft.model.build import BuiltModel

log = logging.getLogger(__name__)

PROG = "python -m lightning_ft export"
CHECKPOINT_CHOICES = ("last", "best", "adapter")
#: the run's config as composed (`lightning_ft.callbacks.summary.CONFIG_FILE`, not imported: it pulls in Lightning)
RUN_CONFIG = "config.json"


class ExportError(ValueError):
    """A run folder, checkpoint or output the export cannot use; the message says what to do."""


def parser() -> argparse.ArgumentParser:
    """The export command's flags."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Write a run's PEFT adapter (and with --merge a merged Hugging Face model) for inference.",
        epilog="example: python -m lightning_ft export outputs/<date>/<run> --merge",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run folder written by `python -m lightning_ft fit`")
    p.add_argument("--merge", action="store_true", help="also write merged/: the adapter merged into the base (plain transformers)")
    p.add_argument("--output", type=Path, default=None, help="the export folder (default: RUN_DIR/export)")
    p.add_argument(
        "--checkpoint", default=None, metavar="last|best|adapter|PATH",
        help="the weights: last (default; the run's adapter/ when it kept no checkpoint), best (the checkpoint "
        "callback's best by its monitor; with the default monitor, step, the newest step checkpoint), adapter, "
        "or a .ckpt file or PEFT adapter folder",
    )
    p.add_argument("--force", action="store_true", help="replace an existing export folder")
    p.add_argument("--verbose", action="store_true", help="also log how the model is built (the lines fit logs), not only warnings")
    return p


def main(argv: list[str]) -> int:
    """Run the command; returns its exit status (an `ExportError` prints one line and returns 1; Ctrl-C one line
    and 130).

    Logs this module's lines (what is loaded) and every library's warnings; the model build's INFO lines
    (attention, kernels, parameter counts: a training run's report) and transformers' progress bars for the
    weights it writes only with ``--verbose``. Prints each folder written on stdout."""
    import warnings

    import lightning  # noqa: F401  adds its own console handler (removed below: with the root's, each line would print twice)
    from transformers.utils import logging as hf_logging

    args = parser().parse_args(argv)
    logging.getLogger("lightning").handlers.clear()
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    log.setLevel(logging.INFO)
    # Lightning's loggers (rank_zero_info) have levels and handlers of their own
    quieted = {} if args.verbose else {name: logging.getLogger(name).level for name in ("lightning.fabric", "lightning.pytorch")}
    for name in quieted:
        logging.getLogger(name).setLevel(logging.WARNING)
    bars = hf_logging.is_progress_bar_enabled()
    if not args.verbose:  # transformers' "Writing model shards" bars, one per folder
        hf_logging.disable_progress_bar()
    warnings.filterwarnings("ignore", message=r".*is_gradient_checkpointing.* deprecated", category=FutureWarning)
    try:
        written = export(args.run_dir, merge=args.merge, output=args.output, checkpoint=args.checkpoint, force=args.force)
    except (ExportError, OSError) as err:  # OSError: a write the checks could not foresee (a full disk, a read-only mount)
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # one line, as fit prints; exit status 128 + SIGINT, as a shell gives
        print(f"{PROG}: interrupted: stopped by Ctrl-C (SIGINT); an export folder is written whole or not at all, so "
              "none was left half-written: run the command again", file=sys.stderr)
        return 130
    finally:
        for name, level in quieted.items():
            logging.getLogger(name).setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


EXPORT_FOLDERS = ("adapter", "base", "merged")  # what an export folder holds
#: files a file browser leaves in any folder it shows (macOS Finder, Windows Explorer), and macOS's ``._*`` (AppleDouble)
#: companions on network and USB volumes: replaced with an export
OS_METADATA = (".DS_Store", "Thumbs.db", "desktop.ini")


def _os_metadata(name: str) -> bool:
    return name in OS_METADATA or name.startswith("._")


def _check_output(output: Path, run_dir: Path, force: bool) -> None:
    """Refuse an ``output`` whose replacement would delete anything but an earlier export: the run folder or a
    folder holding it, a file, or (even with ``force``) a folder with entries other than `EXPORT_FOLDERS` (and
    `OS_METADATA`); and one that cannot be written (its parent is no folder, or not writable), before anything loads."""
    if output == run_dir or run_dir.is_relative_to(output):
        raise ExportError(f"--output {output} holds the run folder {run_dir}: replacing it would delete the run; "
                          "choose a folder of its own (the default is RUN_DIR/export)")
    parent = next((p for p in output.parents if p.exists()), None)  # the folder that holds what will be made
    if parent is None or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = "is a file" if parent is not None and not parent.is_dir() else "is not writable"
        raise ExportError(f"--output {output}: {parent} {why}; choose a folder that can be written")
    if not output.exists():
        return
    if not output.is_dir():
        raise ExportError(f"--output {output} is a file: choose a folder")
    if not force:
        raise ExportError(f"{output} exists: pass --force to replace it, or --output another folder")
    export = lambda p: p.name in EXPORT_FOLDERS and p.is_dir() and not p.is_symlink()  # noqa: E731
    if others := sorted(p.name for p in output.iterdir() if not export(p) and not _os_metadata(p.name)):
        raise ExportError(f"--output {output} is not an earlier export (it holds {', '.join(others[:5])}"
                          f"{', ...' if len(others) > 5 else ''}): --force replaces only a folder of "
                          f"{', '.join(f'{name}/' for name in EXPORT_FOLDERS)}; choose another --output")


def export(
    run_dir: Path, merge: bool = False, output: Path | None = None, checkpoint: str | None = None, force: bool = False,
) -> dict[str, Path]:
    """Write the run's adapter (and base, merged model) into ``output``; see the module docstring.

    Args:
        run_dir: a folder written by ``fit`` (it holds ``config.json``).
        merge: also write ``merged/``.
        output: the export folder (default ``run_dir/export``).
        checkpoint: ``last``, ``best``, ``adapter`` or a path (None: ``last``, else the run's ``adapter/``).
        force: replace an existing ``output`` that holds an earlier export (`EXPORT_FOLDERS` and `OS_METADATA` only).

    Returns:
        ``{"adapter" | "base" | "merged": folder}`` of what was written (final paths).

    Raises:
        ExportError: not a run folder, no checkpoint to export, an existing ``output`` without
            ``force``, an ``output`` that is not an earlier export or that holds the run folder, a
            checkpoint that does not fit the run's model, a full fine-tuning run without ``merge``, or a
            random base drawn on CUDA with no CUDA device here.
        FileNotFoundError: a ``checkpoint`` path that does not exist.
    """
    run_dir = Path(run_dir).expanduser().resolve()
    cfg = run_config(run_dir)
    output = (Path(output).expanduser() if output is not None else run_dir / "export").resolve()
    _check_output(output, run_dir, force)
    source = weights_source(run_dir, cfg, checkpoint)
    from lightning_ft.run_dir import run_in_progress  # (it imports Lightning: not at the module's top)

    if run_in_progress(run_dir):
        log.warning("%s: the run is still training; exporting %s, its weights so far", run_dir, source)
    lora = bool(cfg["lora"].get("enabled", True))
    if not lora and not merge:
        raise ExportError("the run trained every weight (lora=none): it has no adapter; --merge writes its model")

    import torch

    from lightning_ft.data.tokenization import load_tokenizer
    from lightning_ft.model.build import DTYPES
    from lightning_ft.model.quantization import dequantize_linears

    adapter_tokenizer = run_dir / "adapter" / "tokenizer_config.json"
    if adapter_tokenizer.is_file():  # the tokenizer the run trained with, as the run saved it
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(adapter_tokenizer.parent))
    else:
        tokenizer = load_tokenizer(cfg["model"].get("tokenizer") or cfg["model"]["name_or_path"])
    device = base_device(run_dir, cfg)
    log.info("export: %s with the trained weights of %s", _base_description(cfg), source)
    from_folder = source.is_dir()
    with torch.device(device):
        built = build_stock_model(cfg, vocab_size=len(tokenizer), lora=lora and not from_folder, device=device,
                                  on_cuda=trained_on_cuda(run_dir, cfg))
    model = load_weights(built.model, source, lora)
    model.eval()

    written: dict[str, Path] = {}
    random_base = cfg["model"].get("init") == "random"
    with atomic_folder(output) as tmp:  # a crash or a full disk leaves the previous export (or none)
        if lora:
            peft_config = model.peft_config["default"]
            peft_config.base_model_name_or_path = str(output / "base") if random_base else _base_name(cfg["model"]["name_or_path"])
            model.save_pretrained(tmp / "adapter", save_embedding_layers=False)  # LoRA leaves the embeddings as they are
            tokenizer.save_pretrained(tmp / "adapter")
            written["adapter"] = output / "adapter"
            model = _unload_to_base(model)
        _for_inference(model, tokenizer)
        if lora and random_base:
            _save_model(model, tokenizer, tmp / "base")
            written["base"] = output / "base"
        if merge:
            dtype = cfg["model"].get("dtype", "float32")
            layers = dequantize_linears(model, DTYPES[dtype])  # model.quantization=nf4: merge into the weights trained over
            counts = {"linear layers": layers, "expert weights": built.nf4_experts_dequantized}  # experts: as it was built
            if dequantized := [f"{n} NF4 {what}" for what, n in counts.items() if n]:
                log.info("export: merged/ in %s: %s of the base dequantised before the adapter is merged", dtype, " and ".join(dequantized))
            if lora:
                from peft import PeftModel

                # the adapter just written, over the base: merging it checks that it loads as a user loads it
                model = PeftModel.from_pretrained(model, str(tmp / "adapter")).merge_and_unload()
            _save_model(model, tokenizer, tmp / "merged")
            written["merged"] = output / "merged"
    if lora and not random_base and cfg["model"].get("config"):
        log.warning(
            "the run set model.config values over the checkpoint's (%s): the adapter's base is %s as it is, so load it "
            "with those values (the merged model has them)",
            ", ".join(cfg["model"]["config"]), cfg["model"]["name_or_path"],
        )
    return written


#: what the export reads of the run's config (dotted keys, resolved); other keys may hold interpolations only Hydra resolves
RUN_KEYS = ("model", "lora", "seed", "trainer.accelerator", "callbacks.checkpoint.dirpath", "moe.backend", "moe.train_router")


def run_config(run_dir: Path) -> dict[str, Any]:
    """The `RUN_KEYS` of the run's config (``config.json``, written when training starts), resolved with
    ``run_dir`` as the run folder (so a moved or copied folder reads its own checkpoints).

    Raises:
        ExportError: ``run_dir`` is not a folder, holds no ``config.json`` (not a run folder, or a run that
            stopped before training started), or a key that does not resolve.
    """
    from omegaconf import OmegaConf

    if not run_dir.is_dir():
        raise ExportError(f"{run_dir}: no such folder; expected a run folder of `python -m lightning_ft fit` (outputs/<date>/<run>)")
    config_file = run_dir / RUN_CONFIG
    if not config_file.is_file():
        runs = sorted(p.parent.name + "/" for p in run_dir.glob("*/" + RUN_CONFIG))
        hint = f"it holds run folders: {', '.join(runs[:3])}{', ...' if len(runs) > 3 else ''}" if runs else (
            "a run folder of `python -m lightning_ft fit` holds one from the start of training")
        raise ExportError(f"{run_dir}: not a run folder (no {RUN_CONFIG}; {hint})")
    cfg = OmegaConf.create(json.loads(config_file.read_text()))
    cfg.run_dir = str(run_dir)
    resolved: dict[str, Any] = {}
    for key in RUN_KEYS:
        try:
            value = OmegaConf.select(cfg, key, throw_on_resolution_failure=True)
            resolved[key] = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        except Exception as err:  # an interpolation OmegaConf cannot resolve outside Hydra
            raise ExportError(f"{config_file}: {key} does not resolve ({err})") from err
    if not isinstance(resolved["model"], dict) or not isinstance(resolved["lora"], dict):
        raise ExportError(f"{config_file}: no model or lora settings; not the config of a `fit` run")
    return resolved


def checkpoint_dir(run_dir: Path, cfg: dict[str, Any]) -> Path:
    """Where the run's checkpoint callback wrote (``callbacks.checkpoint.dirpath``; default ``run_dir/checkpoints``)."""
    return Path(cfg.get("callbacks.checkpoint.dirpath") or run_dir / "checkpoints")


def weights_source(run_dir: Path, cfg: dict[str, Any], checkpoint: str | None) -> Path:
    """The ``.ckpt`` file or PEFT/model folder that ``--checkpoint`` names.

    Raises:
        ExportError: the run has no such checkpoint (naming what it has), or a ``.ckpt`` file that does not read as
            one (`lightning_ft.run_dir.check_checkpoint_readable`).
        FileNotFoundError: a path that does not exist.
    """
    source = _weights_source(run_dir, cfg, checkpoint)
    if source.is_file():
        _check_readable(source)
    return source


def _check_readable(checkpoint: Path) -> None:
    """`lightning_ft.run_dir.check_checkpoint_readable`, its refusal as an `ExportError`."""
    from lightning_ft.run_dir import check_checkpoint_readable

    try:
        check_checkpoint_readable(checkpoint)
    except ValueError as error:
        raise ExportError(str(error)) from None


def _weights_source(run_dir: Path, cfg: dict[str, Any], checkpoint: str | None) -> Path:
    ckpt_dir, adapter = checkpoint_dir(run_dir, cfg), run_dir / "adapter"
    last = ckpt_dir / "last.ckpt"
    has_adapter = (adapter / "adapter_config.json").is_file() or (adapter / "config.json").is_file()
    if checkpoint is None:
        if last.is_file():
            return last
        if has_adapter:
            log.info("export: no %s; the weights of %s (written when training finished)", last, adapter)
            return adapter
        checkpoint = "last"
    if checkpoint in ("last", "best") and not last.is_file():
        kept = sorted(p.name for p in ckpt_dir.glob("*.ckpt")) if ckpt_dir.is_dir() else []
        has = f"it has {', '.join(kept)}: pass --checkpoint {ckpt_dir / kept[-1]}" if kept else (
            "the run stopped before its first checkpoint (callbacks.checkpoint.every_n_train_steps)")
        also = "; --checkpoint adapter exports the adapter/ written when training finished" if has_adapter else ""
        raise ExportError(f"{run_dir}: no checkpoint {last} to export ({has}){also}")
    if checkpoint == "last":
        return last
    if checkpoint == "best":
        import torch

        _check_readable(last)  # read for the best checkpoint's name
        state = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
        best = next((s["best_model_path"] for s in state.get("callbacks", {}).values() if s.get("best_model_path")), None)
        if not best or not (ckpt_dir / Path(best).name).is_file():
            raise ExportError(f"{last}: names no best checkpoint that exists in {ckpt_dir} (best_model_path={best!r}); use --checkpoint last")
        return ckpt_dir / Path(best).name  # the file of the same name here: the run folder may have been moved
    if checkpoint == "adapter":
        if not has_adapter:
            raise ExportError(f"{adapter}: no adapter written (the run did not finish training); use --checkpoint last")
        return adapter
    path = Path(checkpoint).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"--checkpoint {checkpoint}: no such file or folder (expected {', '.join(CHECKPOINT_CHOICES)} or a path)")
    if path.is_dir() and not ((path / "adapter_config.json").is_file() or (path / "config.json").is_file()):
        raise ExportError(f"--checkpoint {checkpoint}: a folder that is neither a PEFT adapter (adapter_config.json) nor a model (config.json)")
    return path.resolve()


def trained_on_cuda(run_dir: Path, cfg: dict[str, Any]) -> bool:
    """Whether the run trained on CUDA: ``summary.json``'s ``device``, else ``trainer.accelerator`` other than ``cpu``."""
    summary_file = run_dir / "summary.json"
    device = json.loads(summary_file.read_text()).get("device") if summary_file.is_file() else None
    return str(device).startswith("cuda") if device else (cfg.get("trainer.accelerator") or "cpu") != "cpu"


def base_device(run_dir: Path, cfg: dict[str, Any]) -> str:
    """Where to build the model: ``cpu``, but ``cuda`` for a random base that the run drew on CUDA
    (``summary.json``'s ``device``, else ``trainer.accelerator`` other than ``cpu``).

    Raises:
        ExportError: a random base drawn on CUDA, and no CUDA device here.
    """
    import torch

    if cfg["model"].get("init") != "random" or not trained_on_cuda(run_dir, cfg):
        return "cpu"
    if not torch.cuda.is_available():
        raise ExportError(
            f"the run's random base weights were drawn on CUDA from seed {cfg.get('seed')} and are rebuilt the same way: "
            "export on a machine with a CUDA GPU (the CPU draws other numbers)"
        )
    return "cuda"


def build_stock_model(cfg: dict[str, Any], vocab_size: int, lora: bool, device: str, on_cuda: bool = False) -> BuiltModel:
    """The run's model as ``fit`` builds it (`ModelBuilder`, same config and seed) with stock transformers
    modules: no kernel or MoE patch, no CUDA graphs or gradient checkpointing, transformers' SDPA attention;
    ``model.quantization=mxfp4``'s experts dequantised (the values the run trained over), and ``nf4``'s where the
    run kept them in NF4 (``moe.backend=triton`` or ``grouped_mm``, or ``auto`` on CUDA: `holds_nf4_experts`; how many:
    ``BuiltModel.nf4_experts_dequantized``).

    Args:
        lora: with the run's PEFT LoRA layers (to load a ``.ckpt``), else the plain model.
        on_cuda: the run trained on CUDA (`trained_on_cuda`).
    """
    import torch

    from lightning_ft.config import MOVED_KEYS
    from lightning_ft.model.build import ModelBuilder, holds_nf4_experts, nf4_experts_backend
    from lightning_ft.strategies.strategy import Execution

    stock = {"gradient_checkpointing": False, "attention": "sdpa"}  # and no CUDA graphs (the strategy's cuda_graphs=false)
    model = {k: v for k, v in cfg["model"].items() if f"model.{k}" not in MOVED_KEYS}  # a config written before they moved
    builder = ModelBuilder(
        model={**model, **stock},
        lora={**cfg["lora"], "enabled": lora},
        kernels={},
        moe={"backend": "hf", "train_router": bool(cfg.get("moe.train_router"))},  # trained routers: in modules_to_save
        vocab_size=vocab_size,
        seed=cfg.get("seed"),
        execution=Execution(cuda_graphs=False),
        dense_experts=True,  # model.quantization=mxfp4 or nf4: the stock experts read dense weights
        experts_in_nf4=holds_nf4_experts(nf4_experts_backend(cfg.get("moe.backend") or "hf", on_cuda)),  # as the run held them
    )
    return builder(device=torch.device(device))


def _unload_to_base(peft_model: Any) -> Any:
    """The base model under ``peft_model``: its LoRA layers removed (nothing merged) and each ``modules_to_save``
    module (``lora.modules_to_save``, the routers of ``moe.train_router``) its original, frozen self again. PEFT's
    ``unload()`` leaves the trained copy in its place, which the adapter holds; the base written beside the adapter
    must be the weights the adapter was trained over."""
    from peft.utils import ModulesToSaveWrapper

    prefix = "base_model.model."
    originals = {name.removeprefix(prefix): module.original_module for name, module in peft_model.named_modules()
                 if isinstance(module, ModulesToSaveWrapper)}
    base = peft_model.unload()
    for name, original in originals.items():
        parent, _, child = name.rpartition(".")
        setattr(base.get_submodule(parent), child, original)
    return base


def load_weights(model: Any, source: Path, lora: bool) -> Any:
    """``model`` with the trained weights of ``source`` (a Lightning ``.ckpt`` of the trainable weights, a
    PEFT adapter folder, or a full model folder of a ``lora=none`` run); a PEFT model when ``lora``.

    Raises:
        ExportError: the checkpoint's weights do not match the model rebuilt from the run's config.
    """
    import torch

    if source.is_dir():
        if lora:
            from peft import PeftModel

            if not (source / "adapter_config.json").is_file():
                raise ExportError(f"{source}: not a PEFT adapter folder (no adapter_config.json), and the run trained LoRA adapters")
            return PeftModel.from_pretrained(model, str(source))
        from transformers import AutoModelForCausalLM

        if not (source / "config.json").is_file():
            raise ExportError(f"{source}: not a model folder (no config.json), and the run trained every weight (lora=none)")
        # through transformers: its files may lay weights out otherwise than the modules (MoE experts one by one)
        state = AutoModelForCausalLM.from_pretrained(str(source), dtype=next(model.parameters()).dtype).state_dict()
    else:
        ckpt = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        state = {k.removeprefix("model."): v for k, v in ckpt["state_dict"].items()}
    expected = {n for n, p in model.named_parameters() if p.requires_grad}
    result = model.load_state_dict(state, strict=False)
    missing = sorted(expected & set(result.missing_keys))
    if result.unexpected_keys or missing:
        names = (result.unexpected_keys or missing)[:3]
        raise ExportError(
            f"{source}: its weights do not fit the model rebuilt from the run's config.json "
            f"({len(result.unexpected_keys)} unknown, {len(missing)} missing, e.g. {names}); is it this run's checkpoint?"
        )
    return model


def _base_description(cfg: dict[str, Any]) -> str:
    """The run's base model in words: its ``model.name_or_path``, or the random init's architecture and seed."""
    model = cfg["model"]
    if model.get("init") == "random":
        return f"a random {(model.get('config') or {}).get('model_type', 'model')} base (model.init=random, seed {cfg.get('seed')})"
    return str(model["name_or_path"])


def _base_name(name_or_path: str) -> str:
    """A local checkpoint folder as an absolute path (the adapter loads from any working folder); a hub name as is."""
    path = Path(name_or_path).expanduser()
    return str(path.resolve()) if path.exists() else name_or_path


def _for_inference(model: Any, tokenizer: Any) -> None:
    """Undo the training settings ``fit`` puts in the model: transformers' SDPA attention (not the packed
    attention's registered name, which only this package knows), and `inference_settings` on its configs."""
    model.set_attn_implementation("sdpa" if model._supports_sdpa else "eager")  # gpt-oss (sinks): eager only
    inference_settings(model.config, model.generation_config, tokenizer)


def inference_settings(config: Any, generation_config: Any, tokenizer: Any) -> None:
    """A trained model's config and generation config (changed in place) as a model that serves wants them: the
    KV cache on (``fit`` turns it off), and the tokenizer's special tokens (eos, pad, bos) where a config names
    none (a random-init model's config has none: generation would not stop at the end token)."""
    config.use_cache = True
    for key in ("eos_token_id", "pad_token_id", "bos_token_id"):
        value = getattr(tokenizer, key, None)
        if value is not None:
            for settings in (config, generation_config):
                if settings is not None and getattr(settings, key, None) is None:
                    setattr(settings, key, value)


def _save_model(model: Any, tokenizer: Any, folder: Path) -> None:
    """A Hugging Face model folder: config, safetensors shards, generation config, tokenizer."""
    model.to("cpu").save_pretrained(folder)
    tokenizer.save_pretrained(folder)
