"""Every YAML file in configs/ composes with Hydra's compose API, under each command that reads it.

One case per file and command: the primary configs (``fit.yaml``, ``benchmark.yaml``) as they are;
each option of a group the command reads (`lightning_ft.config.config_groups`) selected on top of its
primary config (``+group=option`` for the group the command adds, `ADDED_GROUPS`); the ``hydra/``
files through ``return_hydra_config=True``. A file that no case composes fails
`test_every_config_file_has_a_case`, so a new file cannot go untested.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import OmegaConf

from lightning_ft.config import ADDED_GROUPS, COMMAND_CONFIGS, config_dir, config_groups, register_configs

CONFIG_DIR = Path(config_dir())
#: options that need an optional extra, and the module that extra installs
NEEDS = {"hparams_search/optuna.yaml": "hydra_plugins.hydra_optuna_sweeper"}


def _cases() -> list[tuple[str, str, list[str]]]:
    """(file relative to configs/, command, overrides) for every file a command reads."""
    cases = []
    for command, primary in COMMAND_CONFIGS.items():
        cases.append((f"{primary}.yaml", command, []))
        for group, options in config_groups(command).items():
            plus = "+" if group == ADDED_GROUPS[command] else ""
            cases += [(f"{group}/{option}.yaml", command, [f"{plus}{group}={option}"]) for option in options]
    return cases


CASES = _cases()


def _compose(command: str, overrides: list[str]):
    register_configs()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return compose(config_name=COMMAND_CONFIGS[command], overrides=overrides, return_hydra_config=True)


@pytest.mark.parametrize(("path", "command", "overrides"), CASES, ids=[f"{c}:{p}" for p, c, _ in CASES])
def test_config_composes(path: str, command: str, overrides: list[str]):
    module = NEEDS.get(path)
    if module is not None and importlib.util.find_spec(module.split(".")[0]) is None:
        pytest.skip(f"{path} needs {module} (an optional extra of pyproject.toml)")
    try:
        cfg = _compose(command, overrides)
        OmegaConf.to_container(cfg, resolve=False)
    except Exception as err:  # noqa: BLE001 - any failure names the file
        pytest.fail(f"configs/{path} does not compose under `{command}` with {overrides}: {type(err).__name__}: {err}")
    finally:
        GlobalHydra.instance().clear()
    assert cfg.hydra.help.app_name == f"python -m lightning_ft {command}"  # hydra/help/lightning_ft.yaml applied


def test_every_config_file_has_a_case():
    files = {str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml")}
    covered = {path for path, _, _ in CASES} | {"hydra/help/lightning_ft.yaml"}  # the latter: every case's hydra config
    assert sorted(files - covered) == [], "configs/ files that no command composes"


def test_every_config_folder_is_a_listed_package():
    """pyproject.toml lists each folder of configs/ as a package: a folder left out still installs its YAML
    (package-data) but makes setuptools warn at every install."""
    import tomllib

    repo = Path(__file__).resolve().parents[1]
    packages = set(tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {
        ".".join(("lightning_ft.configs", *path.relative_to(repo / "configs").parts))
        for path in [repo / "configs", *(repo / "configs").rglob("*")]
        if path.is_dir() and path.name != "__pycache__"
    }
    assert folders - packages == set(), f"add these to [tool.setuptools] packages in pyproject.toml: {sorted(folders - packages)}"
