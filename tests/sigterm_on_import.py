"""Importing this module sends the process SIGTERM, as a scheduler may while a run still checks its config: a run's
checks import ``optimizer._target_=sigterm_on_import.AdamW`` to read its arguments."""

import os
import signal

from torch.optim import AdamW  # noqa: F401  the optimizer the run names

os.kill(os.getpid(), signal.SIGTERM)
