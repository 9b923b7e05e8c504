"""Lightning callbacks (progress bar, throughput, gradient check, generation eval, end-of-run summary, Hydra's record of a run) and the Hydra sweep summary."""
