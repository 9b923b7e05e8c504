"""Data: formats, tokenization, packing (`PackedBatch`) and the Lightning data module."""
