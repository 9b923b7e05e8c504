#!/usr/bin/env bash
# The main job on the GPU machine for a few steps, as a user would type it, with random weights:
#   bash benchmarks/fit_smoke_gpu.sh OUT_DIR [EXPERIMENT] [overrides...]
# Writes OUT_DIR/<experiment>.summary.json and the loss curve (the run folder stays in /tmp: the
# adapter and checkpoint of the 30B shape are gigabytes).
set -euo pipefail
out=${1:?usage: fit_smoke_gpu.sh OUT_DIR [EXPERIMENT] [overrides...]}
experiment=${2:-qwen3_moe}
shift $(( $# < 2 ? $# : 2 ))
run=/tmp/lightning_ft_runs/$experiment
rm -rf "$run"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python -c "import torch, transformers, peft, lightning; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, 'lightning', lightning.__version__)"
/usr/bin/time -v python -m lightning_ft fit +experiment="$experiment" hydra.run.dir="$run" \
  callbacks.progress_bar=null callbacks.checkpoint.every_n_train_steps=100000 "$@" 2>&1 | tail -40
mkdir -p "$out"
python - "$run/summary.json" "$@" > "$out/$experiment.summary.json" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({k: v for k, v in s.items() if k != "config"} | {"model_config": s["config"]["model"], "overrides": sys.argv[2:]}, indent=2))
PY
cp "$run/loss_curve.png" "$out/$experiment.loss_curve.png"
cat "$out/$experiment.summary.json"
