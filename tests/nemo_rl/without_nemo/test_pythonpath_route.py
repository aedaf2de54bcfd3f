"""The PYTHONPATH route (DESIGN §3): NeMo RL's per-actor venvs do not see the driver's site-packages, so users put
rlix-plugins in a directory on PYTHONPATH (``pip install --no-deps --target DIR rlix-plugins``), which NeMo RL
forwards to every actor (``VLLM_RAY_EXTRA_ENV_VARS_TO_COPY=PYTHONPATH`` for vLLM's own workers).

Proven here with a SEPARATE interpreter (the base Python, not this venv: no rlix_plugins, no torch, no Ray) that
sees the package only through PYTHONPATH: both entry-point groups resolve, the hook class and the vLLM plugin
load, and the real seam file of patch 0001 loads our hooks with ``RLIX_CONTROL_PLANE=rlix``. CI, no NeMo RL.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests._repo import REPO, copy_tracked

SEAM_PATCH = REPO / "rlix_plugins/patches/nemo-rl/7ea279a/0001-rlix-hooks-seam.patch"
BASE_PYTHON = Path(sys.base_prefix) / "bin" / "python3"

_PROBE = """
import importlib.metadata as md, importlib.util, sys
eps = {g: {e.name: e.value for e in md.entry_points(group=g)} for g in ("nemo_rl.rlix_hooks", "vllm.general_plugins")}
print("EPS", eps["nemo_rl.rlix_hooks"].get("rlix"), eps["vllm.general_plugins"].get("rlix"))
hooks_cls = md.entry_points(group="nemo_rl.rlix_hooks")["rlix"].load()
register = md.entry_points(group="vllm.general_plugins")["rlix"].load()
import rlix_plugins.nemo_rl.worker_ops  # what NeMo RL's workers run through __ray_call__
print("LOADED", hooks_cls.__module__, hooks_cls.__name__, register.__module__, rlix_plugins.__file__)
spec = importlib.util.spec_from_file_location("rlix_hooks", sys.argv[1])
seam = importlib.util.module_from_spec(spec); spec.loader.exec_module(seam)
print("SEAM", type(seam.load_rlix_hooks().plugin_manager.get_plugin("rlix")).__name__)
"""


@pytest.mark.timeout(300)
def test_entry_points_resolve_from_another_interpreter_through_pythonpath(tmp_path: Path) -> None:
    if not BASE_PYTHON.exists():
        pytest.skip(f"no base interpreter at {BASE_PYTHON}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "RLIX_CONTROL_PLANE")}
    bare = subprocess.run([str(BASE_PYTHON), "-s", "-c", "import rlix_plugins"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    if bare.returncode == 0:
        pytest.skip(f"{BASE_PYTHON} already has rlix_plugins installed; the route cannot be isolated here")

    src, site = tmp_path / "src", tmp_path / "site"
    copy_tracked(src)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(src)], capture_output=True, text=True, timeout=240)
    assert pip.returncode == 0, pip.stderr[-3000:]
    lines = SEAM_PATCH.read_text().splitlines()
    start = lines.index("+++ b/nemo_rl/algorithms/rlix_hooks.py")
    seam = tmp_path / "rlix_hooks.py"
    seam.write_text("\n".join(ln[1:] for ln in lines[start + 2:] if ln.startswith("+")) + "\n")

    env.update(PYTHONPATH=str(site), RLIX_CONTROL_PLANE="rlix")
    run = subprocess.run([str(BASE_PYTHON), "-s", "-c", _PROBE, str(seam)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    out = dict(line.split(" ", 1) for line in run.stdout.splitlines())
    assert out["EPS"] == "rlix_plugins.nemo_rl.hooks:NemoRLHooks rlix_plugins.vllm.plugin:register"
    assert out["LOADED"].startswith("rlix_plugins.nemo_rl.hooks NemoRLHooks rlix_plugins.vllm.plugin")
    assert out["LOADED"].endswith(str(site / "rlix_plugins" / "__init__.py"))  # from PYTHONPATH, nowhere else
    assert out["SEAM"] == "NemoRLHooks"
