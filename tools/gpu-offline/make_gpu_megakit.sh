#!/usr/bin/env bash
# Build .gpukit/megakit: the Megatron stack NeMo RL's Megatron policy worker needs (the SingleController's streaming
# train step lives only there) for an offline GPU machine, small enough to travel as one part (~25 MiB).
# Run here, from the repo root, with PyPI reachable and the two source mirrors on disk. Clone github.com/NVIDIA-NeMo/Megatron-Bridge
# and github.com/NVIDIA/Megatron-LM first (MB_MIRROR, MLM_MIRROR; this script never fetches):
#   bash tools/gpu-offline/make_gpu_megakit.sh
# Pins (NeMo RL 7ea279a): Megatron-Bridge = its 3rdparty submodule commit $MB_COMMIT; Megatron-LM = Bridge's own
# 3rdparty submodule commit $MLM_COMMIT (NeMo RL's megatron-core); Transformer Engine $TE_VERSION (default 2.12.0,
# PyPI). Not NeMo RL's 2.14.1 / release_v2.15: every transformer-engine-cu13 from 2.13.0 on needs
# cublasLtGroupedMatrixLayoutInit_internal, which cuBLAS has from 13.2 (CUDA 13.1) on, and the image's torch 2.11.0
# pins nvidia-cublas 13.1.0.3 (tools/gpu-offline/gpukit/image_cuda_symbols.txt; the check below refuses such a core). What
# Megatron-LM 14346b6 gates on TE >= 2.13/2.14 is MoE only (grouped-weight experts, sqrtsoftplus router fusion).
# What it writes:
#   megatron_bridge.tar.xz  Bridge's src/ (+ pyproject, LICENSE): PYTHONPATH=<x>/Megatron-Bridge/src
#   megatron_lm.tar.xz      Megatron-LM's megatron/ (+ setup.py, pyproject, LICENSE): PYTHONPATH=<x>/Megatron-LM
#   wheels/                 transformer-engine (pure Python), transformer-engine-cu13 trimmed to sm_90
#                           (tools/gpu-offline/gpukit/wheel_trim.py: 177 -> ~20 MiB; H100/H200 only), nvidia-modelopt 0.46.0,
#                           pulp 3.3.2 without its bundled solver binaries (modelopt.torch imports it, nothing here runs CBC)
#   transformer_engine_torch-$TE_VERSION.tar.gz  the PyTorch extension, PyPI has it only as source: built on the GPU
#                           machine by tools/gpu-offline/gpu_megakit.sh build (a prebuilt wheel of the same version dropped into
#                           prebuilt/ skips that; prebuilt wheels of another version are left out of the kit)
# Then it installs each wheel into a scratch --target (pip --no-deps) and imports the trees as far as a CPU allows.
set -euo pipefail
cd "$(dirname "$0")/../.."
MB_MIRROR=${MB_MIRROR:-/work/.mirror/NVIDIA-NeMo+Megatron-Bridge/repo}
MLM_MIRROR=${MLM_MIRROR:-/work/.mirror/NVIDIA+Megatron-LM/repo}
MB_COMMIT=8c46dc4259080c510b7455f43e836fdff222c5d3
MLM_COMMIT=14346b65a2d0790e451919858f7771078105c5f0
TE_VERSION=${TE_VERSION:-2.12.0}
KIT=.gpukit/megakit
PY=${PYTHON:-python3}
DL=${MEGAKIT_DOWNLOADS:-/tmp/megakit-downloads}  # PyPI downloads kept between runs (the cu13 wheel is 177 MiB)
for m in "$MB_MIRROR" "$MLM_MIRROR"; do
  [ -d "$m" ] || { echo "no mirror at $m: fetch github:NVIDIA-NeMo/Megatron-Bridge and github:NVIDIA/Megatron-LM" \
    "first (or set MB_MIRROR / MLM_MIRROR)" >&2; exit 2; }
done
sub=$(git -C "$MB_MIRROR" ls-tree "$MB_COMMIT" 3rdparty/Megatron-LM | awk '{print $3}')
[ "$sub" = "$MLM_COMMIT" ] || { echo "Bridge $MB_COMMIT pins Megatron-LM $sub, this script $MLM_COMMIT" >&2; exit 2; }
prebuilt=$(mktemp -d)
[ -d "$KIT/prebuilt" ] && cp -a "$KIT/prebuilt/." "$prebuilt/"  # a TE torch wheel built on the GPU machine stays
for w in "$prebuilt"/transformer_engine_torch-*; do  # unless it was built for another TE version
  case "$(basename "$w")" in
    transformer_engine_torch-"$TE_VERSION"-* | "transformer_engine_torch-*") ;;
    *) echo "leaving out prebuilt/$(basename "$w"): not TE $TE_VERSION"; rm -f "$w" ;;
  esac
done
rm -rf "$KIT" && mkdir -p "$KIT/wheels" "$KIT/prebuilt" "$DL"
cp -a "$prebuilt/." "$KIT/prebuilt/" && chmod 755 "$KIT/prebuilt" && rm -rf "$prebuilt"

# The source trees, one folder and a few files each (`git archive COMMIT PATHS` reads the whole tree, and the Bridge
# mirror lacks two blobs under docs/).
trees=$(mktemp -d)
tree_xz() {  # tree_xz MIRROR COMMIT NAME DIR FILE...: NAME/DIR and NAME/FILE... of COMMIT into $KIT/<name>.tar.xz
  local mirror=$1 commit=$2 name=$3 dir=$4 f
  shift 4
  mkdir -p "$trees/$name"
  git -C "$mirror" archive --prefix="$name/$dir/" "$commit:$dir" | tar -x -C "$trees"
  for f in "$@"; do git -C "$mirror" show "$commit:$f" >"$trees/$name/$f"; done
  tar -C "$trees" --sort=name --owner=0 --group=0 -c "$name" | xz -9 -T2 >"$KIT/$(echo "$name" | tr 'A-Z-' 'a-z_').tar.xz"
}
tree_xz "$MB_MIRROR" "$MB_COMMIT" Megatron-Bridge src pyproject.toml LICENSE
tree_xz "$MLM_MIRROR" "$MLM_COMMIT" Megatron-LM megatron pyproject.toml setup.py LICENSE MANIFEST.in
rm -rf "$trees"

pipdl() { "$PY" -m pip download -q --no-deps --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$DL" "$@"; }
pipdl --only-binary=:all: "transformer-engine==$TE_VERSION" "transformer-engine-cu13==$TE_VERSION" \
  "nvidia-modelopt==0.46.0" "pulp==3.3.2"
# pip would build the sdist's metadata (its setup.py imports torch) just to download it: take the file PyPI lists.
"$PY" - "$DL" "$TE_VERSION" <<'PYEOF'
import hashlib, json, pathlib, sys, urllib.parse, urllib.request
dl, version = pathlib.Path(sys.argv[1]), sys.argv[2]
index = "https://pypi.org/simple/transformer-engine-torch/"  # PEP 691 JSON; its URLs may be relative to the index
request = urllib.request.Request(index, headers={"Accept": "application/vnd.pypi.simple.v1+json"})
with urllib.request.urlopen(request, timeout=60) as r:
    sdist = next(f for f in json.load(r)["files"] if f["filename"] == f"transformer_engine_torch-{version}.tar.gz")
target, want = dl / sdist["filename"], sdist["hashes"]["sha256"]
if not target.exists() or hashlib.sha256(target.read_bytes()).hexdigest() != want:
    with urllib.request.urlopen(urllib.parse.urljoin(index, sdist["url"]), timeout=300) as r:
        target.write_bytes(r.read())
assert hashlib.sha256(target.read_bytes()).hexdigest() == want, f"{target}: sha256 differs from PyPI's"
PYEOF
cp "$DL/transformer_engine-$TE_VERSION-py3-none-any.whl" "$DL"/nvidia_modelopt-0.46.0-*.whl "$KIT/wheels/"
# A module the GPU machine turns out to lack (tools/gpu-offline/gpu_megakit.sh's import check names it): MEGAKIT_EXTRA="x==1 y==2"
# shellcheck disable=SC2086
[ -z "${MEGAKIT_EXTRA:-}" ] || pipdl --only-binary=:all: -d "$KIT/wheels" $MEGAKIT_EXTRA
cp "$DL/transformer_engine_torch-$TE_VERSION.tar.gz" "$KIT/"
"$PY" tools/gpu-offline/gpukit/wheel_trim.py "$DL"/transformer_engine_cu13-"$TE_VERSION"-*.whl "$KIT/wheels" --arch 90
"$PY" tools/gpu-offline/gpukit/wheel_trim.py "$DL"/pulp-3.3.2-*.whl "$KIT/wheels" --drop pulp/solverdir/

# Check: the TE core needs from cuBLAS/cudart only symbols the image's versions define (a missing one fails its
# import on the GPU machine: "undefined symbol: ..., version libcublasLt.so.13").
core=$(mktemp -d)
unzip -q -o -j "$KIT"/wheels/transformer_engine_cu13-*.whl '*/libtransformer_engine.so' -d "$core"
missing=$(readelf --dyn-syms -W "$core/libtransformer_engine.so" |
  awk '$7 == "UND" && $8 ~ /@lib(cublas|cublasLt|cudart)\.so/ { split($8, s, "@"); print s[2], s[1] }' |
  LC_ALL=C sort -u |
  LC_ALL=C comm -23 - <(grep -v '^#' tools/gpu-offline/gpukit/image_cuda_symbols.txt | LC_ALL=C sort -u))
rm -rf "$core"
[ -z "$missing" ] || { echo "transformer-engine-cu13 $TE_VERSION needs what the GPU image's CUDA libraries lack:" \
  $missing "(pick another TE_VERSION)" >&2; exit 3; }
echo "TE $TE_VERSION core: the image's cuBLAS/cudart define all it needs (tools/gpu-offline/gpukit/image_cuda_symbols.txt)"

# Check: every wheel installs (no deps, as on the GPU machine), and the three TE dists agree on their version.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$PY" -m pip install -q --no-deps --no-compile --target "$check/site" "$KIT"/wheels/*.whl
tar -xJf "$KIT/megatron_bridge.tar.xz" -C "$check" && tar -xJf "$KIT/megatron_lm.tar.xz" -C "$check"
ls "$check/site" | grep -E 'dist-info$'
ls -l "$KIT" "$KIT/wheels" "$KIT/prebuilt"
du -sh "$KIT"
echo "import check (CPU, no TE extension) with CHECK_PYTHON=${CHECK_PYTHON:-(unset: skipped)}"
if [ -n "${CHECK_PYTHON:-}" ]; then
  PYTHONPATH="$check/Megatron-LM:$check/Megatron-Bridge/src:$check/site${NEMO_RL_SRC:+:$NEMO_RL_SRC}" \
    "$CHECK_PYTHON" tools/gpu-offline/gpukit/megakit_import_check.py || true
fi
