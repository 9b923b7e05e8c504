"""`HydraRecord`: Hydra's record of a job (``.hydra/config.yaml``, ``hydra.yaml``, ``overrides.yaml``), written
so that a run refused by `lightning_ft.fit.fit` does not replace the record of the run its folder holds.

Hydra writes these files into the job's output folder (``hydra.output_subdir``) before the task starts, so
before any of fit's checks: a resume refused because its config differs from the interrupted run's
overwrote that run's record with the refused overrides. ``configs/fit.yaml`` sets ``hydra.output_subdir:
null`` and fit writes the same three files, with the text Hydra writes (``hydra.yaml`` says
``output_subdir: .hydra``), into ``.hydra/`` itself:

- at once where the folder has no ``.hydra/`` (a new run folder, a sweep's job folder): as Hydra does,
  and nothing is replaced;
- otherwise when training starts, as ``config.json`` (`RunSummary`): a run refused by a check, a resume
  that fails before training resumes and the re-run of a finished run leave the folder's record as it was;
  a resume that trains records its own overrides, as it did when Hydra wrote them.

``hydra.output_subdir`` set to a folder (on the command line or in a config), or to ``null`` on the
command line, keeps Hydra's own behaviour: that folder written before the task, or none.
"""

from __future__ import annotations

import copy
from pathlib import Path

import lightning as L
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict, read_write
from typing_extensions import override

from lightning_ft.atomic import write_text_atomic

SUBDIR = ".hydra"  # Hydra's default hydra.output_subdir


class HydraRecord(L.Callback):
    """The text of this job's three files, written into ``folder`` by `write`, or when training starts
    (on the global rank 0) when added to the Trainer's callbacks.

    Args:
        folder: ``<hydra.runtime.output_dir>/.hydra``.
        files: file name → text.
    """

    def __init__(self, folder: Path, files: dict[str, str]):
        self.folder = folder
        self.files = files

    @classmethod
    def of_job(cls, cfg: DictConfig) -> HydraRecord | None:
        """The record of the running Hydra job whose task config is ``cfg``, as Hydra writes it
        (`hydra.core.utils.run_job`); None outside a Hydra app (`fit` called directly) and where
        ``hydra.output_subdir`` is left to Hydra (set to a folder, or to null on the command line)."""
        if not HydraConfig.initialized():
            return None
        hydra_cfg = copy.deepcopy(HydraConfig.instance().cfg)  # the `hydra` node under its own key, as Hydra saves it
        hydra = hydra_cfg.hydra
        if hydra.output_subdir is not None or any(
            o.lstrip("+~").split("=")[0] == "hydra.output_subdir" for o in hydra.overrides.hydra
        ):
            return None
        with read_write(hydra), open_dict(hydra):
            hydra.output_subdir = SUBDIR  # what it would say had Hydra written the files
        files = {
            "config.yaml": OmegaConf.to_yaml(cfg),
            "hydra.yaml": OmegaConf.to_yaml(hydra_cfg),
            "overrides.yaml": OmegaConf.to_yaml(hydra.overrides.task),
        }
        return cls(Path(hydra.runtime.output_dir) / SUBDIR, files)

    def write(self) -> None:
        """Write the files (each through a temporary file and a rename: never half of one)."""
        self.folder.mkdir(parents=True, exist_ok=True)
        for name, text in self.files.items():
            write_text_atomic(self.folder / name, text)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.is_global_zero:
            self.write()
