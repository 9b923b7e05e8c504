"""lightning_ft: fast, lean LoRA fine-tuning of Hugging Face causal LMs with Lightning and Hydra."""

import logging

__version__ = "0.1.0"

# bitsandbytes' CPU backend warns at import (peft imports it) when it cannot fetch an optional CPU GEMM kernel
# from the Hugging Face hub (offline, or the `kernels` package refusing an untrusted repository); its own
# fallback runs instead and lightning_ft's QLoRA path uses neither, so the warning is only noise here.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
