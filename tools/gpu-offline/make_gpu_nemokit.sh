#!/usr/bin/env bash
# Build .gpukit/nemokit: what NeMo RL's GRPO path needs on the GPU machine (no network, no uv there), next to the
# vLLM carry kit (docs/gpu.md) and the Ray kit (tools/gpu-offline/make_gpu_raykit.sh). Run once, here, from the repo root:
#   NEMO_RL_SRC=/path/to/RL bash tools/gpu-offline/make_gpu_nemokit.sh
# It writes
#   .gpukit/nemokit/w1/  wandb, matplotlib, fonttools (the big wheels)            ~34 MiB
#   .gpukit/nemokit/w2/  every other wheel of the closure + nemo_rl.tar.xz         ~25 MiB
#   .gpukit/nemokit/w3/  transformers 5.8.1 + tokenizers 0.22.2 (NeMo RL's pin), pluggy  ~14 MiB
# The source is the pinned checkout's nemo_rl/ and examples/ (never committed here; the kit stays under .gpukit/).
# The wheel closure (tools/gpu-offline/gpu_nemokit_closure.py) starts from the packages NeMo RL's GRPO driver, the DTensor v1
# policy worker, the vLLM generation workers, the collector and the math environment import, minus what the GPU
# image, the vLLM kit and the Ray kit already provide. tools/gpu-offline/gpu_kit.sh installs it on the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/../.."
: "${NEMO_RL_SRC:?set NEMO_RL_SRC to a NeMo RL checkout at the pinned commit 7ea279a}"
PIN=7ea279abfbeb698b092856d0dab61e7cf39bc909
head=$(git -C "$NEMO_RL_SRC" rev-parse HEAD)
[ "$head" = "$PIN" ] || { echo "NEMO_RL_SRC is at $head, not the pin $PIN" >&2; exit 2; }
[ -d .gpukit/deps ] && [ -d .gpukit/raykit/deps ] || { echo "build the vLLM kit and the Ray kit first (docs/gpu.md)" >&2; exit 2; }
KIT=.gpukit/nemokit
PY=${PYTHON:-python3}
rm -rf "$KIT" && mkdir -p "$KIT/all" "$KIT/w1" "$KIT/w2" "$KIT/w3"
present=$(mktemp)
trap 'rm -f "$present"' EXIT
{ cat tools/gpu-offline/gpu_image_packages.txt; ls .gpukit/deps .gpukit/raykit/deps | grep '\.whl$' | sed 's/-.*//'; echo ray; } >"$present"
"$PY" tools/gpu-offline/gpu_nemokit_closure.py "$KIT/all" "$present" \
  pydantic torchdata tensordict datasets mlflow-skinny swanlab wandb soundfile math-verify hydra-core omegaconf \
  prometheus-client rich matplotlib uvicorn fastapi pyzmq nvidia-ml-py "colored==2.2.3" 2>"$KIT/missing.txt" >/dev/null
# Two of the closure are published as source only (pure Python): build their wheels here.
"$PY" -m pip wheel -q --no-deps -w "$KIT/all" "antlr4-python3-runtime==4.9.3" "pwinput==1.0.3"
for w in "$KIT"/all/*.whl; do
  case $(basename "$w") in wandb-*|matplotlib-*|fonttools-*) mv "$w" "$KIT/w1/" ;; *) mv "$w" "$KIT/w2/" ;; esac
done
rmdir "$KIT/all"
# w3: NeMo RL pins transformers<5.9 (the image has 5.17) and the tokenizers that release accepts; pluggy for the
# hook loader of the patch series (the README's PYTHONPATH route).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$KIT/w3" \
  "transformers==5.8.1" "tokenizers==0.22.2" "pluggy==1.7.0"
tar -cJf "$KIT/w2/nemo_rl.tar.xz" --exclude=__pycache__ -C "$NEMO_RL_SRC" nemo_rl examples
echo "$PIN" >"$KIT/w2/NEMO_RL_COMMIT"
ls "$KIT/w1" "$KIT/w2" | grep -c whl
du -sh "$KIT/w1" "$KIT/w2" "$KIT/w3"
