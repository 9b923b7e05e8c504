"""``device=auto``: the GPU path (bf16, the fused kernels, our MoE path) where a CUDA GPU is present, else the CPU path.

Four config groups depend on the device. Their options in ``configs/fit.yaml``'s defaults list are the
CPU path's; `resolve_device` runs when ``fit`` starts and, on a GPU, composes the config again with
the GPU path's options for every group that neither the command line nor a config it chose (an
experiment, ``hparams_search=...``) picked, exactly as if they had been typed:

    group       CPU path   GPU path (what the GPU experiments in configs/experiment/ select)
    trainer     cpu        gpu
    precision   fp32       bf16
    kernels     none       all   (an architecture without a patch table runs those pieces stock; the start log says which)
    moe         hf         auto  (hf for a dense model: there are no experts to route)

``device=gpu`` asks for the GPU path (an error without a CUDA GPU), ``device=cpu`` (or
``trainer.accelerator=cpu`` on the command line) for the CPU path on a machine with a GPU. Gradient
checkpointing stays the model config's choice (``model.gradient_checkpointing``; the GPU model configs
and ``model=pretrained`` switch it on). CUDA graphs are ``strategy.cuda_graphs=auto`` by default: on for
the GPU path where the run allows them (checkpointing, an attention backend they record, no dropout,
packed rows, not under FSDP2), else off, in one line from the model builder that says which and why
(`lightning_ft.model.build`); the GPU model configs set ``true``, which refuses a run that does not
allow them. One line says what was picked. ``--cfg job`` prints the config before this choice.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from lightning_ft.errors import check_choice

log = logging.getLogger(__name__)

DEVICES = ("auto", "gpu", "cpu")
CPU_PATH = {"trainer": "cpu", "precision": "fp32", "kernels": "none", "moe": "hf"}
GPU_PATH = {"trainer": "gpu", "precision": "bf16", "kernels": "all", "moe": "auto"}


def device_choices(
    device: str, chosen: dict[str, str], model_type: str | None, why: str | None = None, keys: list[str] | None = None
) -> tuple[dict[str, str], str]:
    """The options of the device-dependent groups that nobody chose, and the line that says so.

    Args:
        device: ``auto``, ``gpu`` or ``cpu`` (the ``device`` key).
        chosen: the groups picked on the command line or by a config (`chosen_groups`), with their options; they
            are kept (the line names them with their options).
        model_type: the model's ``model_type`` (None: unknown); on the GPU path ``moe=auto`` needs an
            MoE architecture with a patch table.
        why: what the line gives as the reason (default: the GPUs found, none, or ``device=...``).
        keys: single keys of these groups set on the command line (`group_keys`), named right after the options.

    Returns:
        ``({group: option}, line)``: the options of `CPU_PATH` or `GPU_PATH` for the groups not in ``chosen``.

    Raises:
        ValueError: an unknown ``device``, or ``device=gpu`` where ``torch.cuda.is_available()`` is False.
    """
    import torch

    check_choice("device", device, DEVICES)
    cuda = torch.cuda.is_available()
    if device == "gpu" and not cuda:
        raise ValueError("device=gpu: no CUDA GPU here (torch.cuda.is_available() is False); device=cpu or device=auto runs on the CPU")
    on_gpu = device == "gpu" or (device == "auto" and cuda)
    picked = dict(GPU_PATH if on_gpu else CPU_PATH)
    if on_gpu:
        from lightning_ft.model.patching import has_moe_path

        if not has_moe_path(model_type):
            picked["moe"] = "hf"
    picked = {group: option for group, option in picked.items() if group not in chosen}
    settings = " ".join(f"{group}={option}" for group, option in picked.items()) or "nothing left to pick"
    if keys:
        settings += f", overridden by {' '.join(keys)}"
    kept = f"; kept as chosen: {', '.join(f'{group}={chosen[group]}' for group in sorted(chosen))}" if chosen else ""
    if on_gpu:
        why = why or (f"{torch.cuda.device_count()} CUDA GPU(s)" if device == "auto" else "device=gpu")
        line = f"device: the GPU path ({why}): {settings}{kept} (device=cpu: the CPU path)"
    else:
        why = why or ("no CUDA GPU here" if device == "auto" else "device=cpu")
        line = f"device: the CPU path ({why}): {settings}{kept}; fine for the tiny default, slow for real models"
    return picked, line


def chosen_groups(overrides: list[str], choices: dict[str, Any], config_dir: str) -> set[str]:
    """The device-dependent groups picked on the command line (``overrides``: ``trainer=gpu``, ``+kernels=all``) or
    by the configs chosen for the other groups (``override /trainer: gpu`` in ``configs/<group>/<option>.yaml``'s
    defaults list, as the experiments do); ``choices`` is Hydra's ``runtime.choices``."""
    groups = set(CPU_PATH)
    chosen = {item.split("=", 1)[0].lstrip("+~") for item in overrides if "=" in item} & groups
    for group, option in choices.items():
        path = Path(config_dir) / str(group) / f"{option}.yaml"
        if group in groups or option is None or not path.is_file():
            continue
        for entry in OmegaConf.load(path).get("defaults") or []:
            if isinstance(entry, DictConfig):
                chosen |= {str(key).removeprefix("override").strip().lstrip("/") for key in entry} & groups
    return chosen


def group_keys(overrides: list[str]) -> list[str]:
    """The command line's overrides of single keys of the kernels and moe groups (``kernels.lora=true``), which apply
    on top of whichever option the group gets (``kernels=none`` and ``kernels.lora=true`` run the LoRA kernel): the
    device line names them after the options."""
    keys = [item.lstrip("+~") for item in overrides if "=" in item]
    return [item for item in keys if (key := item.split("=", 1)[0]).partition(".")[0] in ("kernels", "moe") and "." in key]


def model_type_of(model: DictConfig) -> str | None:
    """``model.config.model_type``, else the ``model_type`` of ``model.name_or_path``'s config (None where it cannot be read)."""
    if (model.get("config") or {}).get("model_type"):
        return str(model.config.model_type)
    if not model.get("name_or_path"):
        return None
    try:
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(model.name_or_path, trust_remote_code=bool(model.get("trust_remote_code"))).model_type
    except Exception:  # the model load that follows says what is wrong with the path
        return None


def resolve_device(cfg: DictConfig) -> DictConfig:
    """``cfg`` with the device-dependent groups resolved (`device_choices`), composed again by Hydra with their
    options added to the job's overrides when they differ from the composed ones; logs the line. Outside a
    Hydra job (``fit`` called from Python) ``cfg`` is returned as it is.

    Raises:
        ValueError: what `device_choices` raises.
    """
    from hydra import compose
    from hydra.core.hydra_config import HydraConfig
    from lightning.pytorch.utilities import rank_zero_only
    from omegaconf import open_dict, read_write

    from lightning_ft.config import config_dir

    if not HydraConfig.initialized():
        return cfg
    hydra = HydraConfig.get()
    overrides = list(hydra.overrides.task)
    choices = dict(hydra.runtime.choices)
    import torch

    device, why = str(cfg.get("device", "auto")), None
    if device == "auto" and f"trainer.accelerator={cfg.trainer.get('accelerator')}" in (o.lstrip("+") for o in overrides):
        device, why = ("cpu", "trainer.accelerator=cpu") if cfg.trainer.accelerator == "cpu" else (device, None)
    chosen = {group: str(choices.get(group)) for group in chosen_groups(overrides, choices, config_dir())}
    gpu_path = device == "gpu" or (device == "auto" and torch.cuda.is_available())
    picked, line = device_choices(device, chosen, model_type_of(cfg.model) if gpu_path else None, why, group_keys(overrides))
    if rank_zero_only.rank == 0:  # the processes Lightning starts for the other ranks compose the config again
        log.info(line)
    added = {group: option for group, option in picked.items() if choices.get(group) != option}
    if not added:
        return cfg
    hydra_cfg = HydraConfig.instance().cfg.hydra
    with read_write(hydra_cfg), open_dict(hydra_cfg):  # .hydra/hydra.yaml records the options in use
        hydra_cfg.runtime.choices.update(added)
    return compose(config_name=hydra.job.config_name, overrides=[*overrides, *(f"{g}={o}" for g, o in added.items())])
