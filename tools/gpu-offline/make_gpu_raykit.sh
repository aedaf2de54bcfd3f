#!/usr/bin/env bash
# Build .gpukit/raykit: an offline GPU machine whose image has no Ray. A trimmed Ray 2.60 cp312 wheel
# (~27 MiB as xz) plus the wheels of its missing dependencies travel next to the vLLM carry kit
# (.gpukit/p2 + .gpukit/deps), each part under 64 MiB (gpu_kit.sh groups). Run once, here, from the repo root:
#   bash tools/gpu-offline/make_gpu_raykit.sh
# On the GPU machine, tools/gpu-offline/gpu_suite.sh runs .gpukit/raykit/ray_setup.sh (unpacks into /tmp/site).
# Trimmed: Java jars, the dashboard web client, rllib/tune/serve/train/data/llm, bytecode: nothing the control
# plane, the demo or the tests load.
set -euo pipefail
cd "$(dirname "$0")/../.."
KIT=${RAYKIT_DIR:-.gpukit/raykit}
PY=${PYTHON:-python3}
WHEEL_TAGS=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
            --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$KIT/deps"
"$PY" -m pip download -q --no-deps "${WHEEL_TAGS[@]}" -d "$tmp" ray==2.60.0
# zipfile drops the executable bits (gcs_server/raylet then fail with PermissionError): restore them from
# the wheel's external_attr.
"$PY" - "$tmp" <<'PY'
import glob, os, sys, zipfile
tmp = sys.argv[1]
with zipfile.ZipFile(glob.glob(f"{tmp}/ray-2.60.0-*.whl")[0]) as zf:
    for info in zf.infolist():
        path = zf.extract(info, f"{tmp}/site")
        mode = (info.external_attr >> 16) & 0o777
        if mode:
            os.chmod(path, mode)
PY
(cd "$tmp/site/ray" && rm -rf jars rllib tune serve train data llm && find dashboard/client -mindepth 1 -delete)
find "$tmp/site" -name __pycache__ -prune -exec rm -rf {} +
tar -cJf "$KIT/ray.tar.xz" -C "$tmp/site" ./ray ./ray-2.60.0.dist-info
"$PY" -m pip download -q --no-deps "${WHEEL_TAGS[@]}" -d "$KIT/deps" \
  attrs certifi charset-normalizer click filelock idna jsonschema jsonschema-specifications msgpack packaging \
  protobuf pyyaml referencing requests rpds-py typing-extensions urllib3
cat >"$KIT/ray_setup.sh" <<'EOF'
#!/bin/bash
# GPU machine (the image has no Ray): unpack the trimmed Ray 2.60 cp312 into /tmp/site (on PYTHONPATH via
# .gpukit/setup.sh) and install its missing dependencies. Built by tools/gpu-offline/make_gpu_raykit.sh.
set -u
python3 -c "import ray" 2>/dev/null && exit 0
mkdir -p /tmp/site && tar -xJf .gpukit/raykit/ray.tar.xz -C /tmp/site || exit 3
python3 -m pip install -q --no-index --find-links .gpukit/raykit/deps click filelock jsonschema msgpack packaging \
  protobuf pyyaml requests || exit 4
python3 -c "import ray; print('ray', ray.__version__)"
EOF
chmod +x "$KIT/ray_setup.sh"
du -sh "$KIT/ray.tar.xz" "$KIT/deps"
