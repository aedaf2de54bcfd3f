#!/usr/bin/env bash
# Real NeMo RL on the GPU machine, under `bash tools/gpu-offline/gpu_kit.sh run` (vLLM, Ray and the pinned NeMo RL in place).
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl.sh standalone     stock grpo_math_1B, unpatched vs patched
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl.sh shared         two pipelines time-sharing the GPU
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl.sh sequential     the same two, one after the other
# Every NeMo RL run: the stock recipe (DTensor v1 policy) scaled down to a tiny local Qwen2 and local arithmetic
# prompts (no hub on the machine); each writes its console log and NeMo RL's metrics under $OUT.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/rlix_gpu_out}
WORK=/tmp/rlix_nemo
STEPS=${STEPS:-5}
mkdir -p "$OUT" "$WORK"
ray() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; sys.exit(main())' "$@"; }  # kit: no entry-point script
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 TORCH_NCCL_ENABLE_MONITORING=0
# The README's PYTHONPATH route: the package (with its entry points) in a directory every NeMo RL actor sees.
if [ ! -d "$WORK/rlix-site/rlix_plugins" ]; then
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$WORK/rlix-site" "$REPO" || exit 3
fi
export PYTHONPATH="$WORK/rlix-site:$PYTHONPATH" VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PYTHONPATH
[ -d "$WORK/data/model" ] || python3 tools/gpu-offline/gpu/nemo_rl_data.py "$WORK/data" || exit 3
if [ ! -d "$WORK/patched/nemo_rl" ]; then  # the pinned series on a copy (the kit's source is no git checkout)
  mkdir -p "$WORK/patched" && cp -a "$NEMO_RL_SRC/." "$WORK/patched/"
  cat rlix_plugins/patches/nemo-rl/7ea279a/0*.patch >"$WORK/series.patch"
  (cd "$WORK/patched" && { git apply --whitespace=nowarn "$WORK/series.patch" || patch -p1 <"$WORK/series.patch"; }) || exit 4
fi

# The stock recipe, scaled down: tiny model and batches, eager vLLM, no checkpoints or validation, DTensor v1.
TINY=(policy.model_name="$WORK/data/model" policy.dtensor_cfg._v2=false policy.sequence_packing.enabled=false
  policy.max_total_sequence_length=256 policy.generation.max_new_tokens=48 policy.train_global_batch_size=16
  policy.train_micro_batch_size=4 policy.generation.vllm_cfg.enforce_eager=true
  policy.generation.vllm_cfg.gpu_memory_utilization=0.25 grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4
  grpo.max_num_steps="$STEPS" grpo.val_period=0 checkpointing.enabled=false data.train.dataset_name=ResponseDataset
  ++data.train.data_path="$WORK/data/train.jsonl" ++data.train.input_key=input ++data.train.output_key=output
  data.default.prompt_file=null env.math.num_workers=2 logger.monitor_gpus=false logger.tensorboard_enabled=true
  cluster.gpus_per_node=1)

grpo_run() {  # grpo_run NAME CHECKOUT LIMIT_S [overrides...]: one run_grpo.py driver, log + metrics under $OUT/NAME
  local name=$1 src=$2 limit=$3; shift 3
  mkdir -p "$OUT/$name"
  local t0=$SECONDS
  # An external cluster (NeMo RL's init_ray joins it): its own would start Ray's dashboard, which the trimmed kit lacks.
  ray start --head --num-gpus 1 --include-dashboard=false --disable-usage-stats >"$OUT/$name/ray_start.log" 2>&1
  (cd "$src" && PYTHONPATH="$src:$PYTHONPATH" timeout -k 10 "$limit" python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_system_python.py" \
     examples/run_grpo.py --config examples/configs/grpo_math_1B.yaml "${TINY[@]}" \
     logger.log_dir="$OUT/$name/logs" "$@") >"$OUT/$name/console.log" 2>&1
  local rc=$?
  ray stop --force >/dev/null 2>&1
  echo "=== $name: exit $rc in $((SECONDS - t0)) s"
  grep -E "Step [0-9]+/|Total step time|Avg Reward|reward|E2E \(Tokens" "$OUT/$name/console.log" | tail -n 40
  [ $rc -ne 0 ] && tail -n 60 "$OUT/$name/console.log"
  return $rc
}

stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write(f"{time.time():.3f} {line}")'; }  # time-stamped console lines

shared_runs() {  # shared_runs NAME MODE: MODE "together" (both drivers at once) or "sequential" (one after the other)
  local name=$1 mode=$2 dir="$OUT/$1" cfgdir="$WORK/patched/examples/configs/rlix"
  mkdir -p "$dir"
  python3 -m rlix_plugins.cli recipe "$WORK/patched/examples/configs/grpo_math_1B.yaml" --pipelines 2 --gpus 0 \
    --out "$cfgdir" >"$dir/recipe.log" 2>&1 || { cat "$dir/recipe.log"; return 1; }
  # Ray's token authentication as `rlix up` runs it (README "Security"): a private token (made 0600 when missing),
  # the head and the drivers in token mode (they join by RAY_ADDRESS, where Ray never turns it on by itself)
  python3 -c 'from rlix_plugins.control.admin.ray_auth import ensure_private_token; ensure_private_token()' || return 1
  local -x RAY_AUTH_MODE=token
  ray start --head --num-gpus 1 --include-dashboard=false --disable-usage-stats >"$dir/ray_start.log" 2>&1
  export RAY_ADDRESS=127.0.0.1:6379
  python3 -m rlix_plugins.cli up --address "$RAY_ADDRESS" >"$dir/rlix_up.log" 2>&1 || { cat "$dir/rlix_up.log"; return 1; }
  local t0=$SECONDS pids=() p rc=0
  for p in a b; do
    (set -o pipefail; cd "$WORK/patched" && PYTHONPATH="$WORK/patched:$PYTHONPATH" RLIX_CONTROL_PLANE=rlix \
       VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PYTHONPATH timeout -k 10 "${DRIVER_TIMEOUT_S:-420}" python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_system_python.py" \
       examples/run_grpo.py --config "examples/configs/rlix/grpo_math_1B_rlix_$p.yaml" "${TINY[@]}" \
       logger.log_dir="$dir/logs_$p" 2>&1 | stamp >"$dir/console_$p.log") &
    pids+=($!)
    if [ "$mode" = sequential ]; then wait "${pids[-1]}" || rc=$((rc + 1)); fi
  done
  if [ "$mode" = together ]; then for p in "${pids[@]}"; do wait "$p" || rc=$((rc + 1)); done; fi
  echo "=== $name ($mode): $rc failed drivers, $((SECONDS - t0)) s wall"
  python3 -m rlix_plugins.cli status --json >"$dir/status.json" 2>&1
  python3 -m rlix_plugins.cli timeline --out "$OUT/${name}_timeline.png" >"$dir/timeline.log" 2>&1
  python3 "$REPO/tools/gpu-offline/gpu/dump_trace.py" "$dir/trace.jsonl" >>"$dir/timeline.log" 2>&1
  sleep 5  # let the workers' processes exit, then read what is left on the GPU
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >"$dir/gpu_after.csv"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$dir/gpu_after.csv"
  python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_shared_report.py" "$dir" | tee "$OUT/${name}_report.txt"
  cp "$dir/summary.json" "$OUT/${name}_summary.json" 2>/dev/null
  # Everything else in one archive (fewer files to bring back: at most 8 where transfers are limited); Ray's actor logs when a driver failed.
  [ $rc -ne 0 ] && cp -r /tmp/ray/session_latest/logs "$dir/ray_logs" 2>/dev/null
  tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${dir:?}"
  python3 -m rlix_plugins.cli down --address "$RAY_ADDRESS" >/dev/null 2>&1
  ray stop --force >/dev/null 2>&1
  unset RAY_ADDRESS
  for p in a b; do grep -v "^[0-9.]* *$" "$dir/console_$p.log" | grep -E "Error|Traceback|rlix" | tail -n 15; done
  return $rc
}

failed=0
for part in "${@:-standalone}"; do
  case $part in
  standalone)
    unset RLIX_CONTROL_PLANE
    grpo_run standalone_unpatched "$NEMO_RL_SRC" 280 || failed=$((failed + 1))
    grpo_run standalone_patched "$WORK/patched" 280 || failed=$((failed + 1)) ;;
  shared) shared_runs shared together || failed=$((failed + 1)) ;;
  sequential) shared_runs sequential sequential || failed=$((failed + 1)) ;;
  *) echo "unknown part $part"; failed=$((failed + 1)) ;;
  esac
done
ray stop --force >/dev/null 2>&1
exit "$failed"
