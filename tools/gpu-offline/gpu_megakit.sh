#!/usr/bin/env bash
# The Megatron stack on the offline GPU machine, from .gpukit/megakit (built here by tools/gpu-offline/make_gpu_megakit.sh),
# once per machine, under `bash tools/gpu-offline/gpu_kit.sh run` (the kit's carry list: `bash tools/gpu-offline/gpu_kit.sh groups`):
#   bash tools/gpu-offline/gpu_kit.sh run bash tools/gpu-offline/gpu_megakit.sh build
# 1. unpacks Megatron-LM and Megatron-Bridge into /tmp/megatron and puts both on every python3's path through a .pth
#    file in the image's site-packages (Ray's workers and NeMo RL's Megatron policy actors included, whatever
#    environment they are started with);
# 2. installs the carried wheels (transformer-engine, -cu13 trimmed to sm_90, nvidia-modelopt, pulp);
# 3. installs transformer-engine-torch of the kit's TE version (its sdist's name): the wheel of that version in
#    .gpukit/megakit/prebuilt/ if there is one (also as *.whl.part-* pieces; another version's is ignored), else
#    builds it from the carried sdist (g++ only, 16 jobs, at most $TE_BUILD_TIMEOUT_S = 360 s a command; a build cut
#    short resumes in the next command on the same machine) and copies the wheel to $OUT (in 15 MiB pieces if larger):
#    put those files into .gpukit/megakit/prebuilt/ here and later machines skip the build;
# 4. smoke-tests TE (tools/gpu-offline/gpukit/te_smoke.py: bf16 Linear and attention forward+backward); if attention fails
#    with TE's defaults, retries with NVTE_FUSED_ATTN=0 and NVTE_FLASH_ATTN=0 (the unfused path) and, if that passes,
#    writes those settings to /tmp/megatron/nvte.env, which tools/gpu-offline/gpu_nemo_rl_loops.sh sources (with CUDNN_HOME:
#    torch's own cuDNN, which TE must load instead of the toolkit's older one);
# 5. builds Megatron's dataset helpers (what megatron.core.datasets.utils.compile_helpers runs at start-up);
# 6. imports NeMo RL's Megatron policy worker (tools/gpu-offline/gpukit/megakit_import_check.py).
# Exit codes: 2 kit or machine missing a part, 3 install, 4 TE torch build, 5 TE smoke, 6 dataset helpers, 7 imports.
# Done once: /tmp/megatron/.ready (a later command returns at once).
set -u
cd "$(dirname "$0")/../.."
KIT=${MEGAKIT:-.gpukit/megakit}
TREES=/tmp/megatron
OUT=${OUT:-/tmp/rlix_gpu_out}
fail() { echo "megakit: $2" >&2; exit "$1"; }
[ "${1:-}" = build ] || fail 2 "usage: bash tools/gpu-offline/gpu_megakit.sh build"
[ -f "$TREES/.ready" ] && { echo "megakit: ready (/tmp/megatron/.ready)"; exit 0; }
[ -d "$KIT/wheels" ] || fail 2 "no $KIT/wheels: carry .gpukit/megakit (bash tools/gpu-offline/make_gpu_megakit.sh builds it)"
t0=$SECONDS
mkdir -p "$OUT"

# 1. the source trees, on every interpreter's path
mkdir -p "$TREES"
for a in "$KIT"/megatron_lm.tar.xz "$KIT"/megatron_bridge.tar.xz; do tar -xJf "$a" -C "$TREES" || fail 2 "unpack $a"; done
SITE=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
printf '%s\n' "$TREES/Megatron-LM" "$TREES/Megatron-Bridge/src" >"$SITE/megakit.pth" || fail 3 "write $SITE/megakit.pth"

# 2. the wheels (as the NeMo RL kit: resolved here, installed as is)
export PIP_BREAK_SYSTEM_PACKAGES=1
python3 -m pip install -q --no-index --no-deps --no-compile "$KIT"/wheels/*.whl || fail 3 "pip install $KIT/wheels"
python3 -m pip list 2>/dev/null | grep -iE '^(nvidia-cudnn|transformer.engine|nvidia-modelopt|pulp) '

# 3. transformer-engine-torch: the carried wheel of the kit's TE version, or a build from the sdist
sdist=$(ls "$KIT"/transformer_engine_torch-*.tar.gz 2>/dev/null | head -1)
[ -n "$sdist" ] || fail 2 "no transformer_engine_torch-*.tar.gz in $KIT (bash tools/gpu-offline/make_gpu_megakit.sh)"
TE_VERSION=$(basename "$sdist" .tar.gz) && TE_VERSION=${TE_VERSION#transformer_engine_torch-}
wheel_dir=/tmp/te-torch-wheel
rm -rf "$wheel_dir" && mkdir -p "$wheel_dir"
for part0 in "$KIT"/prebuilt/transformer_engine_torch-"$TE_VERSION"-*.whl.part-00; do
  [ -e "$part0" ] && cat "${part0%-00}"-* >"$wheel_dir/$(basename "${part0%.part-00}")"
done
cp "$KIT"/prebuilt/transformer_engine_torch-"$TE_VERSION"-*.whl "$wheel_dir/" 2>/dev/null
if ls "$wheel_dir"/transformer_engine_torch-"$TE_VERSION"-*.whl >/dev/null 2>&1; then
  echo "megakit: TE torch from the carried wheel $(ls "$wheel_dir")"
else
  command -v g++ >/dev/null || fail 2 "no g++: the extension cannot be built here"
  command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] ||
    fail 2 "no nvcc (TE's build reads the CUDA version from it): set CUDA_HOME"
  python3 -c 'import os, sysconfig; assert os.path.isfile(sysconfig.get_paths()["include"] + "/Python.h")' ||
    fail 2 "no Python.h for python3: the extension cannot be built here; build it on a machine with the headers"
  export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
  # The toolkit may lack cuDNN/cuBLAS/... headers: the image's nvidia-* wheels carry them.
  CPATH=$(python3 -c 'import glob, os, sysconfig
site = sysconfig.get_paths()["purelib"]
print(":".join(sorted(set(glob.glob(site + "/nvidia/*/include") + glob.glob(site + "/nvidia/cu13/include")))))')
  export CPATH="$CPATH${CPATH:+:}${CUDA_HOME}/include"
  echo "megakit: building transformer-engine-torch (CUDA_HOME=$CUDA_HOME, $(nproc) cores)"
  b0=$SECONDS
  # Built in place from a source tree kept in /tmp: a build cut short by the timeout resumes (ninja keeps the objects
  # made) when the next command on this machine runs this step again.
  src=/tmp/te-torch-build
  [ -d "$src/transformer_engine_torch-$TE_VERSION/csrc" ] || { mkdir -p "$src" &&
    tar -xzf "$sdist" -C "$src"; } || fail 2 "unpack the TE torch sdist"
  NVTE_PYTORCH_FORCE_BUILD=TRUE MAX_JOBS=${MAX_JOBS:-16} timeout -k 10 "${TE_BUILD_TIMEOUT_S:-360}" \
    python3 -m pip wheel -v --no-index --no-deps --no-build-isolation -w "$wheel_dir" \
    "$src/transformer_engine_torch-$TE_VERSION/" >"$OUT/te_torch_build.log" 2>&1
  rc=$?
  echo "megakit: TE torch build rc=$rc in $((SECONDS - b0)) s (log: \$OUT/te_torch_build.log)"
  [ $rc -eq 0 ] || { grep -E "error|Error" "$OUT/te_torch_build.log" | head -20; tail -n 20 "$OUT/te_torch_build.log"
    fail 4 "transformer-engine-torch did not build"; }
  for w in "$wheel_dir"/transformer_engine_torch-*.whl; do  # $OUT takes files of at most 16 MiB
    if [ "$(stat -c %s "$w")" -gt $((15 * 1024 * 1024)) ]; then
      split -b 15M -d "$w" "$OUT/$(basename "$w").part-"
    else
      cp "$w" "$OUT/"
    fi
  done
  ls -l "$OUT" | grep transformer_engine_torch
fi
python3 -m pip install -q --no-index --no-deps --no-compile "$wheel_dir"/transformer_engine_torch-*.whl ||
  fail 3 "pip install the TE torch wheel"

# 4. TE on the GPU, with the attention fallbacks if TE's defaults fail.
# TE loads cuDNN from the toolkit before the Python packages (CUDNN_HOME first): the image's /usr/local/cuda has an
# older cuDNN (9.14) than the one torch is built against (9.19, the nvidia-cudnn-cu13 wheel), and whichever loads
# first wins ("cuDNN version incompatibility"). Point TE at torch's own cuDNN, for every process of the runs.
cudnn_lib=$(python3 -c 'import torch; torch.backends.cudnn.version()
print(next(l.split()[-1] for l in open("/proc/self/maps") if "/libcudnn.so" in l))') ||
  fail 5 "torch cannot load its cuDNN"
export CUDNN_HOME=$(dirname "$(dirname "$cudnn_lib")")
# and for libraries that load libcudnn.so.9 by name (LD_LIBRARY_PATH has the toolkit's lib64 first)
export LD_LIBRARY_PATH="$(dirname "$cudnn_lib")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
printf 'export CUDNN_HOME=%s\nexport LD_LIBRARY_PATH=%s\n' "$CUDNN_HOME" "$LD_LIBRARY_PATH" >"$TREES/nvte.env"
echo "megakit: torch's cuDNN is $cudnn_lib"
NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=1 python3 tools/gpu-offline/gpukit/te_smoke.py
rc=$?
if [ $rc -eq 2 ]; then
  echo "megakit: attention failed with TE's defaults; retrying on the unfused path"
  NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0 python3 tools/gpu-offline/gpukit/te_smoke.py || fail 5 "TE attention fails also unfused"
  echo "export NVTE_FUSED_ATTN=0 NVTE_FLASH_ATTN=0" >>"$TREES/nvte.env"
elif [ $rc -ne 0 ]; then
  fail 5 "TE smoke test (trimmed libtransformer_engine.so or the extension)"
fi
echo "megakit: NVTE settings for the runs: $(cat "$TREES/nvte.env" 2>/dev/null || echo "TE's defaults")"

# 5. Megatron's dataset helpers (python3-config may be absent: name the extension suffix)
make -s -C "$TREES/Megatron-LM/megatron/core/datasets" \
  LIBEXT="$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" || fail 6 "make datasets helpers"
python3 -c "from megatron.core.datasets import helpers_cpp" || fail 6 "import megatron.core.datasets.helpers_cpp"

# 6. the imports NeMo RL's Megatron worker makes
PYTHONPATH="${NEMO_RL_SRC:-/tmp/nemo-rl}${PYTHONPATH:+:$PYTHONPATH}" python3 tools/gpu-offline/gpukit/megakit_import_check.py ||
  fail 7 "imports (above)"
touch "$TREES/.ready"
echo "megakit: ready in $((SECONDS - t0)) s"
