"""Lightning callbacks (progress bar, throughput, gradient check, generation eval, end-of-run summary) and the Hydra sweep summary."""
