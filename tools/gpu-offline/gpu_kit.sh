#!/usr/bin/env bash
# Carry the GPU kits to an offline GPU machine in parts of <= 64 MiB each (for machines that take files in
# transfers of limited size), one command per part, all on the SAME machine (the parts wait in /tmp/gpukit there).
# Kits (all under .gpukit/, built here once by the scripts beside this one):
#   vLLM (docs/gpu.md: .gpukit/p1 p2 deps stash.sh setup.sh)   Ray (make_gpu_raykit.sh: .gpukit/raykit)
#   NeMo RL (make_gpu_nemokit.sh: .gpukit/nemokit/w1 w2 w3)   NeMo RL's other loops (make_gpu_loopskit.sh:
#   .gpukit/loopskit)   Megatron for the SingleController (make_gpu_megakit.sh: .gpukit/megakit; installed by
#   gpu_megakit.sh build, which gpu_nemo_rl_loops.sh single_controller runs when TE is missing)
#   bash tools/gpu-offline/gpu_kit.sh groups      here: the carry lists, one per part (each under the limit)
#   bash tools/gpu-offline/gpu_kit.sh stash       GPU machine, every part but the last: park it in /tmp/gpukit
#   bash tools/gpu-offline/gpu_kit.sh run CMD...  GPU machine, last part: restore the parked parts, install what is
#                                                 missing (once per machine), run CMD with vLLM, Ray, NeMo RL importable
set -u
cd "$(dirname "$0")/../.."
STASH=/tmp/gpukit
case "${1:-}" in
groups)
  k="bash tools/gpu-offline/gpu_kit.sh"
  # One list: what each part carries, and the command that takes it there.
  # Five parts: the repository itself takes ~16 MiB of every part's 64, and the kits ~185 MiB.
  parts=(".gpukit/p1 .gpukit/stash.sh .gpukit/raykit/ray_setup.sh"
    ".gpukit/nemokit/w1"
    ".gpukit/p2 .gpukit/deps"
    ".gpukit/setup.sh .gpukit/nemokit/w2"
    ".gpukit/raykit/ray.tar.xz .gpukit/raykit/deps .gpukit/nemokit/w3"
    ".gpukit/loopskit .gpukit/megakit")
  how=("$k stash" "$k stash" "$k stash" "$k stash" "$k run ..." "gpu_nemo_rl_loops.sh only: part 5 stashes, part 6 runs")
  for i in "${!parts[@]}"; do printf 'part %d: %-72s (%s)\n' $((i + 1)) "${parts[$i]}" "${how[$i]}"; done
  echo "        (sizes below count what exists)"
  # Each part travels with the repository: the working tree's files count against the same 64 MiB, by the space
  # they take on disk (whole blocks: 600 small files of the repository take 1 MiB more than their bytes).
  repo=$(git ls-files -co --exclude-standard -z | du -ck --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  for i in "${!parts[@]}"; do
    # shellcheck disable=SC2086
    kit=$(du -ckL ${parts[$i]} 2>/dev/null | tail -1 | cut -f1)
    total=$((kit + repo))
    echo "part $((i + 1)): $((total / 1024)) MiB with the repository ($((repo / 1024)) MiB)$([ $total -gt 65536 ] &&
      echo ": OVER the 64 MiB limit")"
  done ;;
stash)
  mkdir -p "$STASH" && cp -a .gpukit/. "$STASH/" && du -sh "$STASH" ;;
run)
  shift
  mkdir -p "$STASH" && cp -a .gpukit/. "$STASH/" && cp -a "$STASH/." .gpukit/ || exit 3
  export PIP_BREAK_SYSTEM_PACKAGES=1
  if [ ! -d /tmp/site/vllm ]; then bash .gpukit/stash.sh >/dev/null || exit 3; fi
  # shellcheck disable=SC1091
  source <(sed '$d' .gpukit/setup.sh) || exit 4      # vLLM into /tmp/site once + its environment (not its exec line)
  bash .gpukit/raykit/ray_setup.sh || exit 5
  if [ -d .gpukit/nemokit/w2 ] && [ ! -f /tmp/nemo-rl/.kit-installed ]; then
    mkdir -p /tmp/nemo-rl && tar -xJf .gpukit/nemokit/w2/nemo_rl.tar.xz -C /tmp/nemo-rl || exit 6
    # The closure was resolved when the kit was built (tools/gpu-offline/gpu_nemokit_closure.py): install it as is. pip's
    # resolver would refuse soft pins against what the image and the vLLM/Ray kits hold (mlflow-skinny: cachetools<8,
    # swanlab: protobuf<7), none of which bites on the imports NeMo RL's GRPO path makes.
    python3 -m pip install -q --no-index --no-deps --no-compile .gpukit/nemokit/w1/*.whl .gpukit/nemokit/w2/*.whl || exit 7
    touch /tmp/nemo-rl/.kit-installed
  fi
  # NeMo RL pins transformers<5.9 (and asserts < 5.12 at import); the image has 5.17: shadow it (and the tokenizers
  # it accepts) in /tmp/site.
  if [ -d .gpukit/nemokit/w3 ] && [ ! -f /tmp/site/.w3-installed ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpukit/nemokit/w3/*.whl && touch /tmp/site/.w3-installed || exit 7
  fi
  export NEMO_RL_SRC=/tmp/nemo-rl NEMO_RL_PY_EXECUTABLES_SYSTEM=1
  [ $# -gt 0 ] && exec "$@" ;;
*)
  echo "usage: bash tools/gpu-offline/gpu_kit.sh groups|stash|run CMD..." >&2; exit 2 ;;
esac
