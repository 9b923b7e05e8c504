"""The logger configs (configs/logger/): a missing package named with its install command; W&B and MLflow offline."""

import importlib.util
import re
import sys

import pytest

from cli_helpers import FAST, run_cli
from lightning_ft.errors import check_logger_installed
from test_cli import _compose


@pytest.mark.parametrize(("logger", "package", "install"), [
    ("wandb", "wandb", 'pip install wandb (or pip install -e ".[wandb]")'),
    ("mlflow", "mlflow", 'pip install mlflow (or pip install -e ".[mlflow]")'),
    ("tensorboard", "tensorboard", "pip install tensorboard"),
])
def test_a_logger_without_its_package_names_the_install_command(logger, package, install, tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name.startswith(package) else find_spec(name, *a))
    cfg = _compose([f"logger={logger}", f"run_dir={tmp_path}"])
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"needs the {package} package, which is not installed: {install}")):
        check_logger_installed(cfg.logger)
    check_logger_installed(_compose([f"run_dir={tmp_path}"]).logger)  # csv: nothing to install
    check_logger_installed(None)


def test_the_cli_says_what_to_install_before_anything_loads(tmp_path, monkeypatch, capsys):
    from lightning_ft import __main__ as cli

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else find_spec(name, *a))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # main would set it
    with pytest.raises(SystemExit) as exit_:
        cli.main(["fit", f"hydra.run.dir={tmp_path / 'run'}", "logger=wandb"])
    assert exit_.value.code == 1
    err = capsys.readouterr().err
    assert "error: logger: lightning.pytorch.loggers.WandbLogger needs the wandb package, which is not installed: pip install wandb" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_wandb_offline_writes_the_run_into_the_run_folder(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="wandb is not installed (pip install -e '.[wandb]'); the missing-package message is tested above")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_cli(tmp_path, *FAST, "trainer.max_steps=2", "logger=wandb", "logger.offline=true")
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))


@pytest.mark.slow
def test_mlflow_writes_the_run_into_the_run_folder(tmp_path):
    pytest.importorskip("mlflow", reason="mlflow is not installed (pip install -e '.[mlflow]'); the missing-package message is tested above")
    run_cli(tmp_path, *FAST, "trainer.max_steps=2", "logger=mlflow")
    assert list((tmp_path / "mlruns").rglob("metrics/train/loss"))
