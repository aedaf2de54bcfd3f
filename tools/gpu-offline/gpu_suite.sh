#!/usr/bin/env bash
# The GPU checks of the project, batched into few commands of an offline GPU machine (after the vLLM carry kit is
# set up; see README "GPU").
#   bash .gpukit/setup.sh bash tools/gpu-offline/gpu_suite.sh [transport] [expand] [wake-window] [vllm|vllm-nccl] [demo] [demo-tp]
#   (default: transport vllm demo)
# Where one command may run 10 minutes at most, run "transport vllm" in one command and "demo" in the next.
# Runs under .gpukit/setup.sh (vLLM + deps on PYTHONPATH), installs the trimmed Ray kit, then:
#   1. transport GPU tests + benchmarks/transport.py           -> $OUT/transport.json
#   1b. benchmarks/expand.py (expand vs wake on real vLLM)      -> $OUT/expand.json
#   1c. benchmarks/wake_window.py (what a wake does to copies)   -> $OUT/wake_window.json
#   2. vLLM receiver GPU tests (cuda_ipc, NCCL, sleep/wake)     -> $OUT/vllm_gpu_results.json
#   3. rlix demo on 1 GPU and, when there are 2, on 2 GPUs      -> $OUT/g1/, $OUT/g2/ (summary.json, timeline.png)
#   3b. demo-tp: rlix demo --tp 2 on 2 (or 4) GPUs: each rollout rank one engine of two TP workers -> $OUT/tp2/
#   4. real NeMo RL (parts nemo-standalone, nemo-shared, nemo-sequential; tools/gpu-offline/gpu_nemo_rl.sh)
#   5. nemo-pool: the stock recipe's real shape on 2 or 4 GPUs: the rlix pair on GPUs 0,1 vs the static split and the
#      transport benchmark (tools/gpu-offline/gpu_nemo_rl_scale.sh; detached: later commands `... gpu_nemo_rl_scale.sh wait`)
#   6. nemo-pool3 / nemo-faults (4 GPUs): three pipelines vs the split's share; the driver and engine faults at once
# Every part runs even when an earlier one fails; the exit code is the number of failed parts.
# NCCL settings: monitoring threads off (they add to the container's pid limit), debug output to find hangs.
set -u
OUT=${OUT:-/tmp/rlix_gpu_out}
mkdir -p "$OUT"
export TORCH_NCCL_ENABLE_MONITORING=0 NCCL_DEBUG=${NCCL_DEBUG:-WARN} PYTHONUNBUFFERED=1
bash .gpukit/raykit/ray_setup.sh || echo "ray kit missing: the demo part will fail"
ngpu=$(python3 -c "import torch; print(torch.cuda.device_count())")
echo "GPUs: $ngpu"
failed=0
part() {  # part NAME TIMEOUT_S CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name (limit ${limit}s)"
  local t0=$SECONDS
  if timeout -k 10 "$limit" "$@"; then echo "=== $name ok in $((SECONDS - t0)) s"
  else echo "=== $name FAILED (exit $?) after $((SECONDS - t0)) s"; failed=$((failed + 1)); fi
}
want=${*:-transport vllm demo}
if [[ " $want " == *" transport "* ]]; then
  part transport-tests 100 python3 -m pytest -q -m gpu tests/transport/test_gpu.py -o addopts="" -p no:cacheprovider
  part transport-bench 150 python3 benchmarks/transport.py --json "$OUT/transport.json"
fi
if [[ " $want " == *" expand "* ]]; then  # issue 13's ratios on a real vLLM engine (0.5B and 1.5B shapes)
  part expand-bench 450 python3 benchmarks/expand.py --repeats 5 --json "$OUT/expand.json"
fi
if [[ " $want " == *" wake-window "* ]]; then  # copy engine vs SM reads right after a sleep / wake
  part wake-window 200 python3 benchmarks/wake_window.py --json "$OUT/wake_window.json"
fi
if [[ " $want " == *" vllm "* ]]; then
  part vllm-tests 300 python3 -m pytest -v -s -m gpu tests/vllm/test_vllm_gpu.py -o addopts="" -p no:cacheprovider
elif [[ " $want " == *" vllm-nccl "* ]]; then  # only the 2-GPU test (the rest already ran on one GPU)
  part vllm-nccl-test 240 python3 -m pytest -v -s -m gpu tests/vllm/test_vllm_gpu.py -k nccl -o addopts="" -p no:cacheprovider
fi
if [[ " $want " == *" demo "* ]]; then
  part demo-1gpu 270 env CUDA_VISIBLE_DEVICES=0 python3 -m rlix_plugins.cli demo --gpus 1 --out "$OUT/g1"
  if [ "$ngpu" -ge 2 ]; then
    part demo-2gpu 270 python3 -m rlix_plugins.cli demo --gpus 2 --out "$OUT/g2"
  fi
fi
if [[ " $want " == *" demo-tp "* ]] && [ "$ngpu" -ge 2 ]; then  # vLLM TP 2 rollout ranks: one engine over two GPUs
  tp_gpus=$([ "$ngpu" -ge 4 ] && echo 4 || echo 2)  # 4: two TP groups per pipeline, one rolls out while it trains
  part demo-tp2 400 python3 -m rlix_plugins.cli demo --gpus "$tp_gpus" --tp 2 --out "$OUT/tp2"
fi
# Real NeMo RL (needs the NeMo RL kit: run under `bash tools/gpu-offline/gpu_kit.sh run`, see docs/gpu.md), one part per call:
#   nemo-standalone: stock grpo_math_1B (DTensor v1) 5 steps, unpatched then patched, variable unset
#   nemo-shared / nemo-sequential: two `rlix recipe` pipelines time-sharing one GPU / the same two one after another
for nemo in standalone shared sequential; do
  if [[ " $want " == *" nemo-$nemo "* ]]; then
    part "nemo-$nemo" 590 env OUT="$OUT" DRIVER_TIMEOUT_S="$([ $nemo = sequential ] && echo 285 || echo 420)" \
      bash tools/gpu-offline/gpu_nemo_rl.sh "$nemo"
  fi
done
# The pool runs (docs/gpu.md "Several GPUs"): on 4 GPUs the static split and the transport benchmark run on GPUs 2,3
# while the rlix pair runs on 0,1; on 2 GPUs one after the other. UTIL: a rollout next to a training step (80 GiB: 0.3).
if [[ " $want " == *" nemo-pool "* ]]; then
  if [ "$ngpu" -ge 4 ]; then runs="shared2+transport,split2" split=2,3; else runs="transport shared2 split2" split=0,1; fi
  card_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits -i 0)
  part nemo-pool 590 env GPUS=0,1 SPLIT_GPUS="$split" SHAPE="${SHAPE:-qwen2.5-1.5b}" STEPS="${STEPS:-8}" \
    UTIL="${UTIL:-$([ "$card_mib" -gt 100000 ] && echo 0.5 || echo 0.3)}" \
    bash -c "bash tools/gpu-offline/gpu_nemo_rl_scale.sh start $runs && bash tools/gpu-offline/gpu_nemo_rl_scale.sh wait 540"
fi
# Four GPUs only: three rlix pipelines on GPUs 0-2 against the static split's share (one stock pipeline) on GPU 3
# (nemo-pool3, ~20 minutes), and both fault runs at once, each on two GPUs and its own Ray cluster (nemo-faults,
# ~8 minutes with the 0.5B shape; docs/gpu.md "Faults on the pool").
if [[ " $want " == *" nemo-pool3 "* ]] && [ "$ngpu" -ge 4 ]; then
  part nemo-pool3 590 env GPUS=0,1,2 SPLIT_GPUS=3 SHAPE="${SHAPE:-qwen2.5-1.5b}" STEPS="${STEPS:-8}" UTIL="${UTIL:-0.3}" \
    bash -c "bash tools/gpu-offline/gpu_nemo_rl_scale.sh start shared3+split1 && bash tools/gpu-offline/gpu_nemo_rl_scale.sh wait 540"
fi
if [[ " $want " == *" nemo-faults "* ]] && [ "$ngpu" -ge 4 ]; then
  part nemo-faults 590 env SHAPE="${SHAPE:-qwen2.5-0.5b}" STEPS="${STEPS:-3}" FAULT_STEP=1 UTIL="${UTIL:-0.3}" \
    bash -c "bash tools/gpu-offline/gpu_nemo_rl_scale.sh start shared2:driver:0.1+shared2:engine:2.3 &&
             bash tools/gpu-offline/gpu_nemo_rl_scale.sh wait 540"
fi
if [ "$failed" -gt 0 ] && [ -d /tmp/ray/session_latest/logs ]; then  # Ray's worker logs say where a run hung
  tar -czf "$OUT/ray_logs.tgz" -C /tmp/ray/session_latest logs 2>/dev/null && ls -la "$OUT/ray_logs.tgz"
fi
exit "$failed"
