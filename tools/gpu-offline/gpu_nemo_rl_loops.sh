#!/usr/bin/env bash
# NeMo RL's other GRPO loops on the GPU machine, each time-shared on ONE GPU with an async-GRPO pipeline (the
# docs/loops.md GPU run; modelled on tools/gpu-offline/gpu_nemo_rl.sh), under `bash tools/gpu-offline/gpu_kit.sh run`:
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl_loops.sh data_plane          grpo_train_sync + async GRPO
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl_loops.sh single_controller   SingleController + async GRPO
# Pipeline a: the stock grpo_math_1B.yaml as async GRPO (rlix recipe --gpus 0); pipeline b: the loop, from the
# overlays `rlix recipe` writes (recipes/nemo_rl/loops_1gpu_*.yaml are the same, checked in). Both scaled down to
# the tiny local Qwen2 and prompts of tools/gpu-offline/gpu/nemo_rl_data.py; logs, metrics and the report under $OUT.
#
# What the machine needs beyond .gpukit/nemokit (no network there: carried wheels in $LOOPS_WHEELS, default
# .gpukit/loopskit, built by `bash tools/gpu-offline/make_gpu_loopskit.sh` on a machine with PyPI):
# * both loops: TransferQueue (NeMo RL pins git c516143 = the v0.1.9 release: PyPI transferqueue==0.1.9, pure
#   Python) and msgspec (its one dependency not in the kits). mooncake-transfer-engine-cuda13 (PyPI, NeMo RL pins
#   0.3.11.post1) only for data_plane.backend=mooncake_cpu; these runs keep the stock backend "simple".
# * single_controller: the Megatron stack - the SC's streaming train step (begin_train_step /
#   train_microbatch_from_meta / finish_train_step) exists only in NeMo RL's Megatron policy worker: Megatron-LM and
#   Megatron-Bridge at NeMo RL's submodule commits and Transformer Engine 2.12 with its PyTorch extension, carried as
#   .gpukit/megakit (tools/gpu-offline/make_gpu_megakit.sh) and installed once per machine by `tools/gpu-offline/gpu_megakit.sh build`,
#   which this part runs first (it returns at once when done; building the TE extension takes minutes, so on a fresh
#   machine run that step in a command of its own, or carry the wheel it left in $OUT: docs/loops.md). Without the kit
#   the part stops with exit 5 naming what is missing.
set -u
REPO=$PWD
OUT=${OUT:-/tmp/rlix_gpu_out}
WORK=/tmp/rlix_nemo
STEPS=${STEPS:-4}
LOOPS_WHEELS=${LOOPS_WHEELS:-$REPO/.gpukit/loopskit}
mkdir -p "$OUT" "$WORK"
ray() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; sys.exit(main())' "$@"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 TORCH_NCCL_ENABLE_MONITORING=0
if [ ! -d "$WORK/rlix-site/rlix_plugins" ]; then  # the README's PYTHONPATH route
  python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$WORK/rlix-site" "$REPO" || exit 3
fi
export PYTHONPATH="$WORK/rlix-site:$PYTHONPATH" VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PYTHONPATH
if ! python3 -c "import transfer_queue, msgspec" 2>/dev/null; then
  ls "$LOOPS_WHEELS"/transferqueue-*.whl >/dev/null 2>&1 || {
    echo "TransferQueue is not installed and $LOOPS_WHEELS has no wheel: bash tools/gpu-offline/make_gpu_loopskit.sh"; exit 5; }
  python3 -m pip install -q --no-index --no-deps --no-compile "$LOOPS_WHEELS"/*.whl || exit 5
fi
[ -d "$WORK/data/model" ] || python3 tools/gpu-offline/gpu/nemo_rl_data.py "$WORK/data" || exit 3
if [ ! -f "$WORK/patched-loops/.applied" ]; then  # both parts of the pinned series on a copy
  rm -rf "$WORK/patched-loops" && mkdir -p "$WORK/patched-loops" && cp -a "$NEMO_RL_SRC/." "$WORK/patched-loops/"
  cat rlix_plugins/patches/nemo-rl/7ea279a/0*.patch rlix_plugins/patches/nemo-rl/7ea279a/loops/0*.patch \
    >"$WORK/series-loops.patch"
  (cd "$WORK/patched-loops" && { git apply --whitespace=nowarn "$WORK/series-loops.patch" ||
    patch -p1 <"$WORK/series-loops.patch"; }) || exit 4
  touch "$WORK/patched-loops/.applied"
fi
SRC=$WORK/patched-loops

# The stock recipes, scaled down (as tools/gpu-offline/gpu_nemo_rl.sh): tiny model and batches (4 prompts x 4 generations =
# the train batch, which the SingleController checks), eager vLLM, no checkpoints or validation.
TINY=(policy.model_name="$WORK/data/model" policy.sequence_packing.enabled=false policy.max_total_sequence_length=256
  policy.generation.max_new_tokens=48 policy.train_global_batch_size=16 policy.train_micro_batch_size=4
  policy.generation.vllm_cfg.enforce_eager=true policy.generation.vllm_cfg.gpu_memory_utilization=0.2
  grpo.num_prompts_per_step=4 grpo.num_generations_per_prompt=4 grpo.max_num_steps="$STEPS" grpo.val_period=0
  checkpointing.enabled=false data.train.dataset_name=ResponseDataset ++data.train.data_path="$WORK/data/train.jsonl"
  ++data.train.input_key=input ++data.train.output_key=output data.default.prompt_file=null env.math.num_workers=2
  logger.monitor_gpus=false logger.tensorboard_enabled=true cluster.gpus_per_node=1)
DTENSOR_V1=(policy.dtensor_cfg._v2=false)

stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write(f"{time.time():.3f} {line}")'; }

loop_run() {  # loop_run PART: async GRPO (a) + the PART loop (b), both drivers at once on GPU 0
  local part=$1 name="loops_$1" dir="$OUT/loops_$1" cfg="$SRC/examples/configs/rlix-loops"
  local stock entry extra=() b_tiny=()
  case $part in
  data_plane) stock=grpo_math_1B.yaml entry=examples/run_grpo.py extra=(--data-plane) b_tiny=("${DTENSOR_V1[@]}") ;;
  single_controller)
    [ -d "$REPO/.gpukit/megakit" ] || [ -f /tmp/megatron/.ready ] || {
      echo "=== $name: the SingleController trains with Megatron only: carry .gpukit/megakit" \
           "(bash tools/gpu-offline/make_gpu_megakit.sh; see the header)"; return 5; }
    bash "$REPO/tools/gpu-offline/gpu_megakit.sh" build || { echo "=== $name: the Megatron kit did not install"; return 5; }
    # shellcheck disable=SC1091
    [ -f /tmp/megatron/nvte.env ] && source /tmp/megatron/nvte.env  # TE attention fallbacks the kit's smoke test chose
    export NRL_MEGATRON_CHECKPOINT_DIR=$WORK/mcore_from_hf  # the HF -> Megatron conversion of the tiny model
    # The stock recipe saves Megatron checkpoints asynchronously through nvidia-resiliency-ext (not in the image or
    # the kits); these runs save no checkpoints, so the synchronous default is kept.
    b_tiny=(policy.megatron_cfg.checkpoint.async_save=false)
    stock=grpo_math_1B_megatron_single_controller.yaml entry=examples/run_grpo_single_controller.py ;;
  *) echo "unknown part $part"; return 1 ;;
  esac
  mkdir -p "$dir"
  python3 -m rlix_plugins.cli recipe "$SRC/examples/configs/grpo_math_1B.yaml" --pipelines 1 --gpus 0 \
    --out "$cfg/a" >"$dir/recipe_a.log" 2>&1 || { cat "$dir/recipe_a.log"; return 1; }
  python3 -m rlix_plugins.cli recipe "$SRC/examples/configs/$stock" --pipelines 1 --gpus 0 "${extra[@]}" \
    --out "$cfg/$part" >"$dir/recipe_b.log" 2>&1 || { cat "$dir/recipe_b.log"; return 1; }
  # Ray's token authentication as `rlix up` runs it (README "Security"): a private token (made 0600 when missing),
  # the head and the drivers in token mode (they join by RAY_ADDRESS, where Ray never turns it on by itself)
  python3 -c 'from rlix_plugins.control.admin.ray_auth import ensure_private_token; ensure_private_token()' || return 1
  local -x RAY_AUTH_MODE=token
  ray start --head --num-gpus 1 --include-dashboard=false --disable-usage-stats >"$dir/ray_start.log" 2>&1
  export RAY_ADDRESS=127.0.0.1:6379
  python3 -m rlix_plugins.cli up --address "$RAY_ADDRESS" >"$dir/rlix_up.log" 2>&1 || { cat "$dir/rlix_up.log"; return 1; }
  local t0=$SECONDS rc=0 pa pb
  (cd "$SRC" && PYTHONPATH="$SRC:$PYTHONPATH" RLIX_CONTROL_PLANE=rlix timeout -k 10 "${DRIVER_TIMEOUT_S:-480}" \
     python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_system_python.py" examples/run_grpo.py \
     --config "$cfg/a/grpo_math_1B_rlix_a.yaml" "${TINY[@]}" "${DTENSOR_V1[@]}" logger.log_dir="$dir/logs_a" 2>&1 |
     stamp >"$dir/console_a.log") &
  pa=$!
  (cd "$SRC" && PYTHONPATH="$SRC:$PYTHONPATH" RLIX_CONTROL_PLANE=rlix timeout -k 10 "${DRIVER_TIMEOUT_S:-480}" \
     python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_system_python.py" "$entry" \
     --config "$cfg/$part/${stock%.yaml}_rlix_a.yaml" "${TINY[@]}" "${b_tiny[@]}" logger.log_dir="$dir/logs_b" 2>&1 |
     stamp >"$dir/console_b.log") &
  pb=$!
  wait "$pa" || rc=$((rc + 1))
  wait "$pb" || rc=$((rc + 1))
  echo "=== $name: $rc failed drivers, $((SECONDS - t0)) s wall"
  python3 -m rlix_plugins.cli status --json >"$dir/status.json" 2>&1
  python3 -m rlix_plugins.cli timeline --out "$OUT/${name}_timeline.png" >"$dir/timeline.log" 2>&1
  sleep 5
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv >"$dir/gpu_after.csv"
  nvidia-smi --query-gpu=memory.used --format=csv,noheader >>"$dir/gpu_after.csv"
  python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_shared_report.py" "$dir" | tee "$OUT/${name}_report.txt"
  [ $rc -ne 0 ] && cp -r /tmp/ray/session_latest/logs "$dir/ray_logs" 2>/dev/null
  for p in a b; do grep -v "^[0-9.]* *$" "$dir/console_$p.log" | grep -E "Error|Traceback|rlix" | tail -n 15; done
  tar -czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "${dir:?}"
  python3 -m rlix_plugins.cli down --address "$RAY_ADDRESS" >/dev/null 2>&1
  ray stop --force >/dev/null 2>&1
  unset RAY_ADDRESS
  return $rc
}

failed=0
for part in "${@:-data_plane}"; do
  loop_run "$part" || failed=$((failed + 1))
done
ray stop --force >/dev/null 2>&1
exit "$failed"
