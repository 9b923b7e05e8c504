"""Lightning callbacks (progress bar, throughput, gradient check, generation eval, step checkpoints and SIGTERM at a step's end,
end-of-run summary, Hydra's record of a run) and the Hydra sweep summary."""
