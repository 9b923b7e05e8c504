"""lightning_ft: fast, lean LoRA fine-tuning of Hugging Face causal LMs with Lightning and Hydra."""

__version__ = "0.1.0"
