"""``device=auto``: the GPU path where CUDA is present (resolved with `torch.cuda.is_available` patched), else the CPU path."""

import sys
from pathlib import Path

import pytest
import torch

from lightning_ft.config import config_dir
from lightning_ft.device import CPU_PATH, GPU_PATH, chosen_groups, device_choices, group_keys

EXPERIMENTS = sorted(p.stem for p in (Path(config_dir()) / "experiment").glob("*.yaml"))


@pytest.fixture
def cuda(monkeypatch):
    """A machine with one CUDA GPU, as far as the resolution can tell. The patch tables are imported first: with CUDA
    faked, bitsandbytes (imported by them) would take its CUDA path on a CPU-only torch."""
    import lightning_ft.model.patching  # noqa: F401

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)


def test_the_gpu_path_where_cuda_is_present(cuda):
    picked, line = device_choices("auto", {}, "qwen3_moe")
    assert picked == GPU_PATH == {"trainer": "gpu", "precision": "bf16", "kernels": "all", "moe": "auto"}
    assert line.startswith("device: the GPU path (1 CUDA GPU(s)): trainer=gpu precision=bf16 kernels=all moe=auto")
    assert device_choices("auto", {}, "llama")[0] == {**GPU_PATH, "moe": "hf"}  # dense: no experts to route
    # no patch table: kernels=all still, its pieces run stock (the start log names them); no MoE path
    assert device_choices("auto", {}, "starcoder2")[0] == {**GPU_PATH, "moe": "hf"}
    picked, line = device_choices("auto", {"trainer": "gpu", "kernels": "none"}, "qwen3_moe")  # what the user chose stays
    assert picked == {"precision": "bf16", "moe": "auto"} and "kept as chosen: kernels=none, trainer=gpu" in line
    assert group_keys(["kernels.lora=true", "+moe.lora_slots=false", "kernels=none", "trainer.max_steps=2"]) == [
        "kernels.lora=true", "moe.lora_slots=false"]  # single keys of the groups, named right after the options
    line = device_choices("auto", {}, "qwen3_moe", keys=["kernels.lora=false"])[1]
    assert "kernels=all moe=auto, overridden by kernels.lora=false (device=cpu: the CPU path)" in line
    assert device_choices("cpu", {}, "qwen3_moe")[0] == CPU_PATH


def test_the_cpu_path_without_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    picked, line = device_choices("auto", {}, "qwen3_moe")
    assert picked == CPU_PATH == {"trainer": "cpu", "precision": "fp32", "kernels": "none", "moe": "hf"}
    assert line.startswith("device: the CPU path (no CUDA GPU here)")
    with pytest.raises(ValueError, match="device=gpu: no CUDA GPU here"):
        device_choices("gpu", {}, "qwen3_moe")
    with pytest.raises(ValueError, match="device=tpu: expected one of auto, gpu, cpu"):
        device_choices("tpu", {}, None)


def _picks(experiment: str) -> dict:
    """The groups an experiment picks (``override /group: option`` in its defaults list)."""
    from omegaconf import OmegaConf

    path = Path(config_dir()) / "experiment" / f"{experiment}.yaml"
    return {str(k).removeprefix("override /"): v for entry in OmegaConf.load(path).get("defaults") or [] for k, v in entry.items()}


GPU_EXPERIMENTS = [e for e in EXPERIMENTS if _picks(e).get("trainer") == "gpu"]


def test_there_are_gpu_experiments_to_compare_with():
    assert {"llama3_8b", "qwen3_moe"} <= set(GPU_EXPERIMENTS)


@pytest.mark.parametrize("experiment", GPU_EXPERIMENTS)
def test_the_gpu_path_picks_what_the_gpu_experiments_pick(experiment, cuda):
    """What device=auto picks on a GPU for the experiment's model is what the experiment picks (moe: hf where it picks none)."""
    from omegaconf import OmegaConf

    picks = _picks(experiment)
    model_type = OmegaConf.load(Path(config_dir()) / "model" / f"{picks['model']}.yaml").model.config.model_type  # @package _global_
    auto = device_choices("auto", {}, model_type)[0]
    assert {g: picks.get(g, CPU_PATH[g] if g == "moe" else None) for g in auto} == auto
    assert chosen_groups([], {"experiment": experiment}, config_dir()) == set(auto) & set(picks)


def test_fit_on_a_gpu_composes_the_gpu_path_and_keeps_explicit_choices(cuda, tmp_path, monkeypatch):
    """The command line end to end up to `fit` (replaced by a recorder): the config composed again with the GPU path."""
    from lightning_ft import __main__ as cli
    from lightning_ft import fit as fit_module

    seen = []
    monkeypatch.setattr(fit_module, "fit", lambda cfg, sigterm=None: seen.append(cfg) or {})
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # main would set it
    for run, overrides in (
        ("auto", []), ("chosen", ["trainer=cpu", "trainer.max_steps=3"]), ("cpu", ["device=cpu"]), ("accelerator", ["trainer.accelerator=cpu"]),
    ):
        cli.main(["fit", f"hydra.run.dir={tmp_path / run}", *overrides])
    auto, chosen, cpu, accelerator = seen
    assert (auto.trainer.accelerator, auto.trainer.precision, auto.model.dtype) == ("gpu", "bf16-mixed", "bfloat16")
    assert auto.kernels.rms_norm and auto.kernels.fused_linear_cross_entropy and auto.moe.backend == "auto"
    assert (chosen.trainer.accelerator, chosen.trainer.max_steps, chosen.model.dtype) == ("cpu", 3, "bfloat16")
    for cfg in (cpu, accelerator):
        assert (cfg.trainer.accelerator, cfg.model.dtype, cfg.kernels.rms_norm, cfg.moe.backend) == ("cpu", "float32", False, "hf")

