"""The LightningModule and the model-side hot path (attention, patching)."""
