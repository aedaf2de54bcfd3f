#!/usr/bin/env bash
# Real NeMo RL at the stock recipe's real scale on one GPU or several, under `bash tools/gpu-offline/gpu_kit.sh run` (vLLM, Ray
# and the pinned NeMo RL in place; docs/gpu.md "Real scale"). A run outlasts one 10-minute command, so runs go detached:
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl_scale.sh start RUN...   queue RUNs (one after another) in a
#                                                                                 new session; returns at once
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl_scale.sh wait [S]       wait up to S s (default 560) and
#                                                                                 copy every finished run's files to $OUT
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_nemo_rl_scale.sh snapshot       the unfinished runs as they stand
#                                                                                 (their trace, report, logs) to $OUT
# A RUN argument may join runs: A+B runs A and B at the same time (on different GPUs), A,B one after the other
# inside its branch; e.g. `shared2+transport,split2` (the shared run on GPUS while the transport benchmark and then
# the static split use SPLIT_GPUS). Each Ray cluster gets its own ports, so runs on one machine never meet.
# RUN: standalone          the stock grpo_math_1B.yaml (synchronous, colocated), unpatched then patched + variable unset
#      shared<N>           N pipelines from `rlix recipe ... --pipelines N --gpus 0`, all at once, one control plane
#      shared<N>:F[:G[:X]] the same with its own FAULT F (driver, engine or none), GPUs G (dots: 2.3) and `rlix
#                          recipe` flag --X, so that two runs go at once: shared2:driver:0.1+shared2:engine:2.3, or
#                          shared2:none:0:trainer-offload+shared2:none:1
#      sequential<N>       the same N drivers one after another (the baseline)
#      split<N>            the static split: the stock recipe, unpatched, one driver per GPU of SPLIT_GPUS, all at once
#      transport           benchmarks/transport.py on SPLIT_GPUS (per-sync NCCL broadcast vs raw, group set-up)
#      RUN@SHAPE           RUN at its own SHAPE (its directory gets the shape's suffix), e.g. two shapes at once:
#                          shared1:none:0.1.2+shared4:none:3@qwen2.5-0.5b
# Settings (environment): SHAPE=qwen2.5-1.5b|qwen2.5-0.5b (the model's real architecture and vocabulary, random
# weights), STEPS=8, NEW_TOKENS=512, EAGER=true (false: the stock recipe's CUDA graphs, compiled at start-up),
# FAULT=driver|engine (time-shared runs: pipeline b's driver, or one of its vLLM engine cores, is SIGKILLed
# FAULT_DELAY_S=3 s after its log shows step FAULT_STEP=2's training grant, resp. that step's weights back on the GPU,
# i.e. mid-training, resp. while the cache is built and the awake ranks are refreshed; DIR/fault.log says what and
# when, DIR/status_after_fault.json what `rlix status` said 30 s later), FAULT_RANK=any|active (engine: the last
# engine core b's console names, or the one on a GPU b does not train on, awake and refreshed while b trains),
# FAULT_STEPS=$STEPS (the steps of a fault run),
# STANDALONE_ORDER="unpatched patched"
# (reverse it to pair with an earlier run), TP= (time-shared runs: `rlix recipe --tp TP`, vLLM tensor-parallel rollout
# ranks of TP GPUs; empty: the stock recipe's 1), UTIL= (time-shared runs:
# `rlix recipe --gpu-memory-utilization UTIL`; empty: the share `rlix recipe` sizes to the rollout in flight, 0.24
# at the 1.5B shape on an H200 for one pipeline, 0.09 for a pair on one GPU), GPUS=0 (the time-shared runs' GPUs, e.g. 0,1: `rlix recipe --gpus`; standalone uses
# the first), SPLIT_GPUS=$GPUS (the static split's GPUs, one pipeline each; may be other GPUs than GPUS, so that
# both run at once), OVERRIDES= (time-shared runs: Hydra overrides for every driver, space-separated, e.g.
# ++rlix.post_sleep_max_bytes=4294967296), RECIPE_FLAGS= (time-shared runs: more `rlix recipe` flags, e.g.
# --no-trainer-offload). Every run keeps the recipe's batch: 32 prompts x 16 generations per step.
# Each run leaves DIR/console_<p>.log (time-stamped), DIR/logs_<p> (NeMo RL's metrics), DIR/nvml.csv (GPU busy share,
# GPU and host memory, sampled), DIR/trace.jsonl + status.json + gpu_after.csv (time-shared runs) and DIR/report.txt.
set -u
REPO=$PWD
ROOT=/tmp/rlix_scale
WORK=/tmp/rlix_nemo
SHAPE=${SHAPE:-qwen2.5-1.5b}
STEPS=${STEPS:-8}
NEW_TOKENS=${NEW_TOKENS:-512}
EAGER=${EAGER:-true}
UTIL=${UTIL:-}
GPUS=${GPUS:-0}                       # the GPUs the time-shared runs share (`rlix recipe --gpus`), e.g. 0,1
SPLIT_GPUS=${SPLIT_GPUS:-$GPUS}       # the static split's GPUs, one pipeline on each
mkdir -p "$ROOT" "$WORK"
ray() { python3 -c 'import sys; from ray.scripts.scripts import main; sys.argv[0] = "ray"; sys.exit(main())' "$@"; }
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 RAY_DEDUP_LOGS=0 TORCH_NCCL_ENABLE_MONITORING=0 RAY_AUTH_MODE=token

prepare() {  # prepare SHAPE...: the package, the patched copy, and each SHAPE's model and one-line recipe
  # The README's PYTHONPATH route: the package (with its entry points) in a directory every NeMo RL actor sees.
  if [ ! -d "$WORK/rlix-site/rlix_plugins" ]; then
    python3 -m pip install -q --no-deps --no-build-isolation --no-compile --target "$WORK/rlix-site" "$REPO" || return 3
  fi
  export PYTHONPATH="$WORK/rlix-site:$PYTHONPATH" VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PYTHONPATH
  if [ ! -d "$WORK/patched/nemo_rl" ]; then  # the pinned series on a copy (the kit's source is no git checkout)
    mkdir -p "$WORK/patched" && cp -a "$NEMO_RL_SRC/." "$WORK/patched/"
    cat "$REPO"/rlix_plugins/patches/nemo-rl/7ea279a/0*.patch >"$WORK/series.patch"
    (cd "$WORK/patched" && { git apply --whitespace=nowarn "$WORK/series.patch" || patch -p1 <"$WORK/series.patch"; }) || return 4
  fi
  local shape SHAPE DATA STOCK REAL
  for shape in "$@"; do  # before any run starts: runs of one shape read these files at once
    SHAPE=$shape
    shape_vars
    [ -f "$DATA/model/model.safetensors" ] || python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_real_data.py" "$DATA" --shape "$SHAPE" || return 3
    # the stock recipe naming the local model and the runs' sequence length (`rlix recipe` sizes a step's logits by it)
    printf 'defaults: grpo_math_1B.yaml\npolicy:\n  model_name: %s\n  max_total_sequence_length: %d\n' "$DATA/model" \
      $((NEW_TOKENS + 512)) >"$STOCK"
    cp "$STOCK" "$NEMO_RL_SRC/examples/configs/"
  done
}

# The stock recipe at its real batch; only what this machine lacks changes: the model is a local random one of the
# real shape (no hub; a one-line recipe over the stock one names it, so `rlix recipe` reads its shape), vLLM eager by
# default (EAGER; no compiler cache to warm), DTensor v1 without sequence packing (v2 and packing need packages the offline
# image lacks), no validation or checkpoints, local arithmetic prompts, two math reward workers per pipeline
# (answers to random weights are scored in no time; eight per pipeline would ask for more CPUs than four pipelines
# have).
shape_vars() {  # DATA, STOCK and REAL (the drivers' overrides) of SHAPE, into the caller's locals (bash scopes dynamically)
  DATA=$WORK/data_$SHAPE
  STOCK=$WORK/patched/examples/configs/grpo_math_1B_$SHAPE.yaml
  REAL=(policy.dtensor_cfg._v2=false policy.sequence_packing.enabled=false
    policy.max_total_sequence_length=$((NEW_TOKENS + 512)) policy.generation.max_new_tokens="$NEW_TOKENS"
    policy.generation.vllm_cfg.enforce_eager="$EAGER" grpo.max_num_steps="$STEPS" grpo.val_period=0
    checkpointing.enabled=false data.train.dataset_name=ResponseDataset ++data.train.data_path="$DATA/train.jsonl"
    ++data.train.input_key=input ++data.train.output_key=output data.default.prompt_file=null env.math.num_workers=2
    logger.monitor_gpus=false logger.tensorboard_enabled=true)
}

stamp() { python3 -u -c 'import sys, time
for line in sys.stdin: sys.stdout.write(f"{time.time():.3f} {line}")'; }

driver() {  # driver NAME DIR CHECKOUT CONFIG [env...]: one run_grpo.py driver, time-stamped console in DIR
  local name=$1 dir=$2 src=$3 config=$4; shift 4
  # pipefail: the driver's exit status, not the time-stamper's (a run whose drivers all failed reported "exit: 0")
  (set -o pipefail; cd "$src" && env PYTHONPATH="$src:$PYTHONPATH" "$@" timeout -k 10 "${DRIVER_TIMEOUT_S:-3000}" \
     python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_system_python.py" examples/run_grpo.py --config "$config" "${REAL[@]}" \
     "${MORE[@]}" logger.log_dir="$dir/logs_$name" 2>&1 | stamp >"$dir/console_$name.log")
}

fresh_dir() {  # fresh_dir DIR: an empty run directory; an earlier run's (its files came back with its wait) moves aside
  # A rerun on the same machine must not read the last run's logs: FAULT's watcher would match its console at once,
  # and the report would add its NeMo RL metrics to this run's.
  [ -e "$1" ] && mkdir -p "$ROOT/earlier" && mv "$1" "$ROOT/earlier/$(basename "$1").$(date +%s)"
  mkdir -p "$1"
}

sample() { python3 "$REPO/tools/gpu-offline/gpu/nvml_sampler.py" "$1" --gpus "$2" >/dev/null 2>&1 & echo $!; }  # sample CSV GPUS

ray_head() {  # ray_head DIR K GPUS: a Ray head of its own (K: 0 shared runs, 1 static split, 2 standalone) on GPUS
  # Its ports, client server and worker ports differ by K, so several clusters run on one machine at once; the
  # drivers find theirs by RAY_ADDRESS (DIR/ray_address), never by "the latest cluster".
  # K 3 + g: a shared run whose GPUs start at g > 0 (shared<N>:FAULT:GPUS beside another shared run).
  # Every head and driver in Ray's token mode, as `rlix up` runs it (README "Security"): a private token (made 0600
  # when missing; RAY_AUTH_MODE=token is exported above). Once the token file exists, a head Ray starts turns token
  # mode on by itself, and a driver that joins by RAY_ADDRESS without RAY_AUTH_MODE=token is refused: the stock
  # standalone run after a shared one failed that way.
  local dir=$1 k=$2 gpus=$3 port=$((6379 + 10 * $2)) more=()
  python3 -c 'from rlix_plugins.control.admin.ray_auth import ensure_private_token; ensure_private_token()' \
    >>"$dir/auth.log" 2>&1 || { cat "$dir/auth.log"; return 1; }
  [ "$k" -gt 0 ] && more=(--ray-client-server-port $((30000 + k)) --dashboard-agent-listen-port $((52365 + k))
    --min-worker-port $((30100 + 2000 * k)) --max-worker-port $((32099 + 2000 * k)))
  CUDA_VISIBLE_DEVICES=$gpus ray start --head --port "$port" --num-gpus "$(tr ',' '\n' <<<"$gpus" | wc -l)" \
    --num-cpus 64 --include-dashboard=false --disable-usage-stats "${more[@]}" >>"$dir/ray_start.log" 2>&1
  echo "127.0.0.1:$port" >"$dir/ray_address"
}

finish() {  # finish DIR RC: report, pack
  local dir=$1
  python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_shared_report.py" "$dir" >"$dir/report.txt" 2>&1
  echo "exit: $2" >>"$dir/report.txt"
  touch "$dir/DONE"
}

run_standalone() {  # one pipeline on the first of GPUS
  local dir=$ROOT/standalone rc=0 MORE=(cluster.gpus_per_node=1)
  fresh_dir "$dir"
  for which in ${STANDALONE_ORDER:-unpatched patched}; do
    local src=$NEMO_RL_SRC
    [ $which = patched ] && src=$WORK/patched
    ray_head "$dir" 2 "${GPUS%%,*}"
    local sampler
    sampler=$(sample "$dir/nvml_$which.csv" "${GPUS%%,*}")
    driver "$which" "$dir" "$src" "examples/configs/$(basename "$STOCK")" env -u RLIX_CONTROL_PLANE \
      RAY_ADDRESS="$(cat "$dir/ray_address")" || rc=$((rc + 1))
    kill "$sampler" 2>/dev/null
    stop_head "$dir"
  done
  finish "$dir" $rc
}

run_shared() {  # run_shared NAME N MODE (together | sequential): on GPUS, cluster.gpus_per_node from the overlays
  # shellcheck disable=SC2206  # MORE: the OVERRIDES (space-separated Hydra overrides), one word each
  local name=$1 n=$2 mode=$3 dir=$ROOT/$1 cfgdir=$WORK/patched/examples/configs/rlix_$1 rc=0 pids=() p \
    MORE=(${OVERRIDES:-})
  # The Ray head sees only GPUS (CUDA_VISIBLE_DEVICES), as 0..k-1: the overlays name those.
  local first=${GPUS%%,*} ids
  ids=$(seq -s, 0 $(($(tr ',' '\n' <<<"$GPUS" | wc -l) - 1)))
  fresh_dir "$dir"
  # shellcheck disable=SC2086  # RECIPE_FLAGS: one word each
  python3 -m rlix_plugins.cli recipe "$STOCK" --pipelines "$n" --gpus "$ids" --out "$cfgdir" \
    ${UTIL:+--gpu-memory-utilization "$UTIL"} ${TP:+--tp "$TP"} ${RECIPE_FLAGS:-} >"$dir/recipe.log" 2>&1 ||
    { cat "$dir/recipe.log"; finish "$dir" recipe; return 1; }
  ray_head "$dir" $([ "$first" -eq 0 ] && echo 0 || echo $((3 + first))) "$GPUS"
  export RAY_ADDRESS
  RAY_ADDRESS=$(cat "$dir/ray_address")
  python3 -m rlix_plugins.cli up --address "$RAY_ADDRESS" >"$dir/rlix_up.log" 2>&1 || { finish "$dir" up; return 1; }
  local sampler watcher=
  sampler=$(sample "$dir/nvml.csv" "$GPUS")
  [ -n "${FAULT:-}" ] && { fault_watch "$dir" & watcher=$!; }
  local names=(a b c d e f g h)
  for p in "${names[@]:0:$n}"; do
    driver "$p" "$dir" "$WORK/patched" "examples/configs/rlix_$name/$(basename "$STOCK" .yaml)_rlix_$p.yaml" \
      RLIX_CONTROL_PLANE=rlix &
    pids+=($!)
    if [ "$mode" = sequential ]; then wait "${pids[-1]}" || rc=$((rc + 1)); fi
  done
  if [ "$mode" = together ]; then for p in "${pids[@]}"; do wait "$p" || rc=$((rc + 1)); done; fi
  [ -n "$watcher" ] && kill "$watcher" 2>/dev/null
  python3 -m rlix_plugins.cli status --json >"$dir/status.json" 2>&1
  # the legend names each pipeline as its console does (a, b, ...), from the id its hooks log
  local legend=() c id
  for c in "$dir"/console_*.log; do
    id=$(grep -o -m1 'rlix ft_[0-9a-f]*' "$c" | cut -d' ' -f2)
    [ -n "$id" ] && legend+=(--name "$id=$(basename "$c" .log | sed 's/^console_//')")
  done
  python3 -m rlix_plugins.cli timeline --out "$dir/timeline.png" "${legend[@]}" >"$dir/timeline.log" 2>&1
  python3 "$REPO/tools/gpu-offline/gpu/dump_trace.py" "$dir/trace.jsonl" >>"$dir/timeline.log" 2>&1
  sleep 5  # let the workers' processes exit, then read what is left on the GPU
  kill "$sampler" 2>/dev/null
  gpu_after "$dir" "$GPUS"
  [ $rc -ne 0 ] && cp -r "$(session_dir)/logs" "$dir/ray_logs" 2>/dev/null
  python3 -m rlix_plugins.cli down --address "$RAY_ADDRESS" >/dev/null 2>&1
  stop_head "$dir"
  unset RAY_ADDRESS
  finish "$dir" $rc
}

run_shared_with() {  # shared<N>:FAULT[:GPUS[:FLAG]]: a shared run with its own FAULT (none: no fault), GPUs (dots:
  # 2.3) and one more `rlix recipe` flag (its name without the dashes), e.g. `shared2:driver:0.1+shared2:engine:2.3`
  # (both faults at once, on their own GPUs and Ray clusters) or `shared2:none:0:trainer-offload+shared2:none:1`
  # (the same pair with and without the trainers' offload, side by side)
  local spec=$1 suffix=$2 name fault gpus flag
  IFS=: read -r name fault gpus flag <<<"$spec"
  local FAULT=${fault/none/} GPUS=${gpus:-$GPUS} STEPS=$STEPS RECIPE_FLAGS="${RECIPE_FLAGS:-}${flag:+ --$flag}"
  GPUS=${GPUS//./,}
  [ -n "$FAULT" ] && STEPS=${FAULT_STEPS:-$STEPS} && shape_vars  # a fault run may be shorter than the runs beside it
  run_shared "$name-${fault}${gpus:+-g${gpus//./}}${flag:+-$flag}$suffix" "${name#shared}" together
}

fault_watch() {  # fault_watch DIR: the FAULT of pipeline b (see the settings above), then `rlix status`
  local dir=$1 log=$1/console_b.log step=${FAULT_STEP:-2} pattern pid p
  case $FAULT in
  driver) pattern="train_granted step=$step " ;;
  engine) pattern="weights_on_gpu step=$step" ;;
  *) echo "FAULT=$FAULT: use driver or engine" >"$dir/fault.log"; return 1 ;;
  esac
  until grep -aq "$pattern" "$log" 2>/dev/null; do sleep 1; done
  sleep "${FAULT_DELAY_S:-3}"
  if [ "$FAULT" = driver ]; then  # the python3 process of b's driver (its `timeout` parent names the same arguments)
    for p in $(pgrep -f -- "logger.log_dir=$dir/logs_b"); do
      case $(cat "/proc/$p/comm" 2>/dev/null) in python*) pid=$p ;; esac
    done
  elif [ "${FAULT_RANK:-any}" = active ]; then  # b's engine core on a GPU b does not train on: awake through b's step
    pid=$(active_engine "$dir")
  else  # an engine core of b: Ray forwards b's workers' output to b's console only
    pid=$(grep -aoE "EngineCore pid=[0-9]+" "$log" | tail -1 | cut -d= -f2)
  fi
  [ -n "${pid:-}" ] || { echo "$(date +%s.%N) FAULT $FAULT: no process found" >"$dir/fault.log"; return 1; }
  echo "$(date +%s.%N) FAULT $FAULT of pipeline b at step $step: SIGKILL pid $pid ($(cat "/proc/$pid/cmdline" 2>/dev/null |
    tr '\0' ' ' | cut -c1-120))" >"$dir/fault.log"
  kill -9 "$pid"
  sleep 30
  python3 -m rlix_plugins.cli status --json >"$dir/status_after_fault.json" 2>&1
  nvidia-smi -i "$GPUS" --query-compute-apps=gpu_uuid,pid,used_memory --format=csv >>"$dir/fault.log" 2>&1
}

active_engine() {  # active_engine DIR: the pid of b's engine core on a GPU other than b's home (its training GPU)
  local dir=$1 home p uuid
  local -a gpus=(${GPUS//,/ })
  home=${gpus[$(grep -aoE "pipeline b, train \[[0-9]+" "$dir/recipe.log" | grep -oE "[0-9]+$")]}
  for p in $(grep -aoE "EngineCore pid=[0-9]+" "$dir/console_b.log" | cut -d= -f2 | sort -u); do
    uuid=$(nvidia-smi --query-compute-apps=pid,gpu_uuid --format=csv,noheader | awk -F', ' -v p="$p" '$1 == p {print $2}')
    [ -n "$uuid" ] && [ "$(nvidia-smi -i "$uuid" --query-gpu=index --format=csv,noheader)" != "$home" ] && echo "$p" && return
  done
}

gpu_after() {  # gpu_after DIR GPUS: the processes and memory left on the run's GPUs
  nvidia-smi -i "$2" --query-compute-apps=gpu_uuid,pid,used_memory --format=csv >"$1/gpu_after.csv"
  nvidia-smi -i "$2" --query-gpu=index,memory.used --format=csv,noheader >>"$1/gpu_after.csv"
}

session_dir() { python3 -c 'import ray, sys; ray.init(address="auto", log_to_driver=False)
print(ray._private.worker._global_node.get_session_dir_path())' 2>/dev/null || echo /tmp/ray/session_latest; }

stop_head() {  # stop_head DIR: this run's Ray head only (`ray stop` would end every cluster of the machine)
  local port
  port=$(cut -d: -f2 "$1/ray_address")
  local sig
  for sig in TERM KILL; do  # the GCS by its port, every other process of the cluster by the GCS address it names
    pkill "-$sig" -f -- "--gcs_server_port=$port( |$)" 2>/dev/null
    pkill "-$sig" -f -- "--gcs[-_]address=[^ ]*:$port( |$)" 2>/dev/null
    sleep 2
  done
  # `ray stop` also drops the "latest cluster" file, which a later ray.init() without an address would follow
  grep -qs ":$port\$" /tmp/ray/ray_current_cluster && rm -f /tmp/ray/ray_current_cluster
  return 0
}

engine_bound() {  # engine_bound CONSOLE: until that driver's first vLLM engine holds its rendezvous port (<= 180 s)
  # Stock NeMo RL starts every job's first engine at VLLM_PORT 7000 (virtual_cluster.py); vLLM probes the port, then
  # binds it seconds later, so two stock jobs starting at once on one host can both pick 7000 and one dies with
  # EADDRINUSE. The static split starts its drivers one engine start apart (this costs its whole-run figure that
  # wait, never its steps phase). The rlix runs are not exposed: their engines bind ports the kernel assigns (their
  # logs show it).
  local t0=$SECONDS
  until grep -aq "distributed_init_method=" "$1" 2>/dev/null || [ $((SECONDS - t0)) -ge 180 ]; do sleep 1; done
  sleep 5
}

run_split() {  # run_split NAME N: the static split, the stock recipe unpatched on one GPU per pipeline, all at once
  local name=$1 n=$2 dir=$ROOT/$1 rc=0 pids=() p MORE=(cluster.gpus_per_node=1) names=(a b c d e f g h)
  local gpus=(${SPLIT_GPUS//,/ })
  fresh_dir "$dir"
  if [ "${#gpus[@]}" -lt "$n" ]; then
    echo "SPLIT_GPUS=$SPLIT_GPUS has fewer than $n GPUs" >"$dir/console_setup.log"
    finish "$dir" gpus
    return 1
  fi
  local use
  use=$(IFS=,; echo "${gpus[*]:0:$n}")
  ray_head "$dir" 1 "$use"
  local sampler
  sampler=$(sample "$dir/nvml.csv" "$use")
  local prev=
  for p in "${names[@]:0:$n}"; do
    [ -n "$prev" ] && engine_bound "$dir/console_$prev.log"
    driver "$p" "$dir" "$NEMO_RL_SRC" "examples/configs/$(basename "$STOCK")" env -u RLIX_CONTROL_PLANE \
      RAY_ADDRESS="$(cat "$dir/ray_address")" &
    pids+=($!)
    prev=$p
  done
  for p in "${pids[@]}"; do wait "$p" || rc=$((rc + 1)); done
  sleep 5
  kill "$sampler" 2>/dev/null
  gpu_after "$dir" "$use"
  stop_head "$dir"
  finish "$dir" $rc
}

run_transport() {  # benchmarks/transport.py on SPLIT_GPUS: per-sync NCCL broadcast vs raw, group set-up + teardown
  local dir=$ROOT/transport rc=0
  fresh_dir "$dir"
  CUDA_VISIBLE_DEVICES=$SPLIT_GPUS timeout -k 10 400 python3 "$REPO/benchmarks/transport.py" \
    --json "$dir/transport.json" >"$dir/console.log" 2>&1 || rc=$?
  { grep -v '^\[transport-bench' "$dir/console.log"; echo "exit: $rc"; } >"$dir/report.txt"
  touch "$dir/DONE"
}

run_one() {  # run_one RUN[@SHAPE]: one run; @SHAPE gives it a shape of its own (two shapes at once on one machine)
  local spec=${1%@*} SHAPE=$SHAPE DATA STOCK REAL suffix=
  [[ $1 == *@* ]] && SHAPE=${1##*@} && suffix=-${SHAPE#qwen2.5-}
  shape_vars
  echo "$(date +%T) start $1"
  case $spec in
  standalone) run_standalone ;;
  shared[0-9]) run_shared "$spec$suffix" "${spec#shared}" together ;;
  shared[0-9]:*) run_shared_with "$spec" "$suffix" ;;
  sequential[0-9]) run_shared "$spec$suffix" "${spec#sequential}" sequential ;;
  split[0-9]) run_split "$spec$suffix" "${spec#split}" ;;
  transport) run_transport ;;
  *) echo "unknown run $1" ;;
  esac
  echo "$(date +%T) end $1"
}

run() {  # each argument in turn; A+B: A and B at once; A,B: one after the other inside a branch
  local shapes
  shapes=$(printf '%s\n' "$SHAPE" $(grep -oE '@[^,+ ]+' <<<"$*" | tr -d @) | sort -u)
  # shellcheck disable=SC2086
  prepare $shapes || { echo "prepare failed: $?"; return 1; }
  local arg branch part pids
  for arg in "$@"; do
    pids=()
    for branch in ${arg//+/ }; do
      (for part in ${branch//,/ }; do run_one "$part"; done) &
      pids+=($!)
    done
    wait "${pids[@]}"
  done
  touch "$ROOT/ALL_DONE"
}

collect() {  # every finished run: its report and one archive into $OUT (at most 8 files, where transfers back are limited)
  local d
  for d in "$ROOT"/*/; do
    d=${d%/}
    [ -f "$d/DONE" ] || continue
    local n
    n=$(basename "$d")
    cp "$d/report.txt" "$OUT/${n}_report.txt" 2>/dev/null
    tar -cJf "$OUT/$n.txz" --exclude='logs_*' --exclude=ray_logs -C "$ROOT" "$n"  # NeMo RL's own logs: too big
  done
}

case "${1:-}" in
start)
  shift
  rm -f "$ROOT/ALL_DONE"
  setsid nohup bash "$0" run "$@" >"$ROOT/runner.log" 2>&1 </dev/null &
  echo "started: $* (log $ROOT/runner.log)" ;;
run) shift; run "$@" ;;
wait)  # returns when every run ended, when one more run ended than at the call, or after S seconds
  limit=${2:-560} t0=$SECONDS
  done_at_call=$(ls "$ROOT"/*/DONE 2>/dev/null | wc -l)
  while [ ! -f "$ROOT/ALL_DONE" ] && [ $((SECONDS - t0)) -lt "$limit" ] &&
    [ "$(ls "$ROOT"/*/DONE 2>/dev/null | wc -l)" -eq "$done_at_call" ]; do sleep 5; done
  cat "$ROOT/runner.log"
  for c in "$ROOT"/*/console_*.log; do  # the config echo names rlix too: left out, and every line cut short
    [ -f "$c" ] && { echo "== $c"; grep -aE "Step [0-9]+/|Error|Traceback|rlix" "$c" | grep -v MasterConfig | cut -c1-300 |
      tail -n 6; }
  done
  collect
  [ -f "$ROOT/ALL_DONE" ] && echo ALL_DONE || echo STILL_RUNNING ;;
snapshot)  # every unfinished run as it stands: the trace read from its live control plane, a report, an archive
  export PYTHONPATH="$WORK/rlix-site:${PYTHONPATH:-}"
  for d in "$ROOT"/*/; do
    d=${d%/}
    [ -f "$d/DONE" ] && continue
    n=$(basename "$d")
    [ -f "$d/ray_address" ] && [ -f "$d/rlix_up.log" ] &&
      RAY_ADDRESS=$(cat "$d/ray_address") timeout 60 python3 "$REPO/tools/gpu-offline/gpu/dump_trace.py" "$d/trace.jsonl" >/dev/null 2>&1
    python3 "$REPO/tools/gpu-offline/gpu/nemo_rl_shared_report.py" "$d" >"$d/report.txt" 2>&1
    cp "$d/report.txt" "$OUT/${n}_partial_report.txt"
    tar -cJf "$OUT/${n}_partial.txz" --exclude='logs_*' --exclude=ray_logs -C "$ROOT" "$n"
  done ;;
*) echo "usage: bash tools/gpu-offline/gpu_nemo_rl_scale.sh start RUN... | wait [S] | snapshot" >&2; exit 2 ;;
esac
