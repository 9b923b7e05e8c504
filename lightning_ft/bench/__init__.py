"""Side-by-side training-step benchmarks: ``python -m lightning_ft bench +bench=<preset>``.

`runner` composes the config, runs every (system, sequence length) pair in a fresh subprocess
(`worker`), alternating systems, and writes JSON rows, a markdown table and PNG plots. `systems`
holds how each system builds a model and takes a training step; `flops` counts the work for MFU.
"""
