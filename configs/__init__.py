"""Hydra configs of lightning_ft (installed as package data; see configs/ in the repository)."""
