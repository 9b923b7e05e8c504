#!/usr/bin/env bash
# Scaling of the main job over the GPUs of one host, through `python -m lightning_ft fit`:
#   bash benchmarks/multi_gpu.sh OUT_DIR EXPERIMENT STRATEGY [STEPS] [overrides...]
#   e.g. bash benchmarks/multi_gpu.sh out llama3_8b ddp 20
#        bash benchmarks/multi_gpu.sh out qwen3_moe fsdp2 12
# N = every GPU the machine has. Three runs of STEPS optimizer steps: N GPUs (one micro-batch per rank
# and step); 1 GPU with the same micro-batch per step (the throughput baseline: scaling efficiency =
# tokens/s per GPU on N GPUs over tokens/s on 1); 1 GPU accumulating N micro-batches (the same global
# batch: its losses must match the N-GPU run's). Writes OUT_DIR/<experiment>_<strategy>.json with, per
# run, tokens/s over all ranks and per GPU, rank 0's peak memory (in training and while building and
# sharding the model) and the per-step losses. NVLink multicast is kept off (the NCCL/NVSHMEM variables below).
set -euo pipefail
usage="usage: multi_gpu.sh OUT_DIR EXPERIMENT STRATEGY [STEPS] [overrides...]  (EXPERIMENT: a configs/experiment name, STRATEGY: ddp or fsdp2, STEPS: optimizer steps, at least 2; default 8)"
(( $# >= 3 )) || { echo "$usage" >&2; exit 2; }
out=$1 experiment=$2 strategy=$3 steps=${4:-8}
[[ $strategy == ddp || $strategy == fsdp2 ]] || { echo "multi_gpu.sh: STRATEGY=$strategy: expected ddp or fsdp2" >&2; exit 2; }
[[ $steps =~ ^[0-9]+$ ]] && (( steps >= 2 )) || { echo "multi_gpu.sh: STEPS=$steps: expected an integer of at least 2 (the first step is not timed)" >&2; exit 2; }
shift $(( $# < 4 ? $# : 4 ))
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
(( gpus >= 2 )) || { echo "multi_gpu.sh: needs at least 2 GPUs, found $gpus" >&2; exit 2; }
mkdir -p "$out"
common=(+experiment="$experiment" callbacks.progress_bar=null callbacks.checkpoint.every_n_train_steps=100000
        trainer.max_steps="$steps" trainer.log_every_n_steps=1 data.num_examples=20000 "$@")
runs=/tmp/lightning_ft_runs/multi_gpu
rm -rf "$runs/$experiment"_*
python -m lightning_ft fit hydra.run.dir="$runs/${experiment}_$gpus" "${common[@]}" \
  strategy="$strategy" trainer.devices="$gpus" 2>&1 | tail -15
python -m lightning_ft fit hydra.run.dir="$runs/${experiment}_1" "${common[@]}" trainer.devices=1 2>&1 | tail -15
python -m lightning_ft fit hydra.run.dir="$runs/${experiment}_1_acc" "${common[@]}" \
  trainer.devices=1 trainer.accumulate_grad_batches="$gpus" 2>&1 | tail -15
python - "$runs/${experiment}_$gpus" "$runs/${experiment}_1" "$runs/${experiment}_1_acc" "$strategy" "$@" \
  > "$out/${experiment}_${strategy}.json" <<'PY'
import json, sys
many, one, one_acc = (json.load(open(f"{d}/summary.json")) for d in sys.argv[1:4])
def row(s):
    world, gib = s["world_size"], lambda key: s[key] / 2**30 if s.get(key) is not None else None
    return {"world_size": world, "strategy": s["config"]["trainer"]["strategy"], "status": s["status"],
            "accumulate_grad_batches": s["config"]["trainer"]["accumulate_grad_batches"],
            "max_tokens": s["config"]["data"]["max_tokens"], "tokens_per_s": s["tokens_per_s"],
            "tokens_per_s_per_gpu": s["tokens_per_s"] / world, "peak_train_gib_rank0": gib("peak_memory_train_bytes"),
            "peak_setup_gib_rank0": gib("peak_memory_setup_bytes"), "step_losses": s["step_losses"]}
a, b, c = row(many), row(one), row(one_acc)
diffs = [abs(x - y) for x, y in zip(a["step_losses"], c["step_losses"]) if x is not None and y is not None]
print(json.dumps({"strategy": sys.argv[4], "overrides": sys.argv[5:], "n_gpus": a, "one_gpu": b,
                  "one_gpu_same_global_batch": c,
                  "scaling_efficiency": a["tokens_per_s_per_gpu"] / b["tokens_per_s"],
                  "max_abs_loss_diff_vs_same_global_batch": max(diffs) if diffs else None}, indent=2))
PY
cat "$out/${experiment}_${strategy}.json"
