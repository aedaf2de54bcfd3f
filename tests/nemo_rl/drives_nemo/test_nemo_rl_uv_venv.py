"""The PYTHONPATH route through NeMo RL's own per-actor venvs (README: "Make rlix-plugins visible to NeMo RL's
per-actor venvs"; install recipes: docs/install.md).

NeMo RL builds one venv per actor class with uv (``nemo_rl.utils.venvs.create_local_venv``: ``uv venv`` + ``uv
sync`` + ``uv run --locked --extra ...``) and starts the actor with ``runtime_env={"py_executable": <that venv's
python>, "env_vars": <the driver's environment>}``; a package pip-installed next to the driver is not in that venv.
Here NeMo RL's code does all of it, on a private Ray head, for the actor async GRPO starts that way
(``nemo_rl.algorithms.async_utils.ReplayBuffer`` -> ``PY_EXECUTABLES.VLLM``, the venv tier of the vLLM workers):

* with rlix-plugins only in a ``pip install --no-deps --target SITE`` directory on the driver's ``PYTHONPATH``, the
  actor (running the uv-built venv's interpreter, where rlix-plugins is not installed) resolves both entry-point
  groups, loads the hook class and the vLLM plugin and imports ``worker_ops`` from SITE;
* without ``PYTHONPATH`` the same actor in the same (reused) venv sees neither the package nor its entry points.

The copy's project file is the CPU-fetchable subset of NeMo RL's (``tests/nemo_rl/_uv_cpu_checkout.py`` says
what is left out and why: GitHub and download.pytorch.org are unreachable here, CPython 3.13.14 too); the venv
machinery is NeMo RL's, unchanged. Needs ``NEMO_RL_SRC``, ``uv`` on PATH, a CPython 3.13 (``RLIX_UV_PYTHON`` or
pyenv's) and PyPI; skips naming the missing one. First run ~8 min on a loaded 2-core machine (two venvs of
~1.5 GB each; the uv cache makes later runs faster).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._repo import copy_tracked
from tests.nemo_rl._nemo_checkout import _SCRUB, _free_port, clone, nemo_src, report, stop_processes_naming
from tests.nemo_rl._uv_cpu_checkout import cpu_pyproject

pytestmark = [pytest.mark.nemo_rl, pytest.mark.slow]

FQN = "nemo_rl.algorithms.async_utils.ReplayBuffer"
DRIVER = Path(__file__).with_name("uv_venv_driver.py")
HOOKS_EP = "rlix_plugins.nemo_rl.hooks:NemoRLHooks"
VLLM_EP = "rlix_plugins.vllm.plugin:register"


def _python313() -> str | None:
    if os.environ.get("RLIX_UV_PYTHON"):
        return os.environ["RLIX_UV_PYTHON"]
    found = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.13*/bin/python3.13")))
    return found[-1] if found else None


def _pypi_reachable() -> bool:
    try:
        socket.create_connection(("pypi.org", 443), timeout=5).close()
        return True
    except OSError:
        return False


def _run(cmd: list[str], *, timeout: float, cwd: Path | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    t0 = time.monotonic()
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env)
    report(f"[uv route] {' '.join(cmd[:4])}: rc={out.returncode} in {time.monotonic() - t0:.0f} s")
    assert out.returncode == 0, f"{cmd} failed:\n{(out.stdout + out.stderr)[-5000:]}"
    return out


@contextlib.contextmanager
def _ray_head(ray_bin: Path, env: dict[str, str]) -> Iterator[str]:
    """A private Ray head of the copy's own Ray (its ``.venv``), as ``ray start`` on a cluster node would be; stops
    only the processes of this head (found by its temp dir)."""

    tmp = tempfile.mkdtemp(prefix="rlixuv_", dir="/tmp")  # short: Ray's socket paths are length-limited
    port = _free_port()
    cmd = [str(ray_bin), "start", "--head", f"--port={port}", "--num-cpus=4", "--num-gpus=0",
           "--include-dashboard=false", f"--temp-dir={tmp}", "--disable-usage-stats"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    found = re.search(r"--address='([^']+)'", out.stdout + out.stderr)
    try:
        assert out.returncode == 0 and found, f"ray start failed:\n{(out.stdout + out.stderr)[-3000:]}"
        yield found.group(1)
    finally:
        stop_processes_naming(tmp)
        shutil.rmtree(tmp, ignore_errors=True)


def _drive(copy: Path, env: dict[str, str]) -> dict:
    """``uv run --locked python uv_venv_driver.py`` in the copy (as ``uv run examples/run_grpo.py``)."""
    out = _run(["uv", "run", "--locked", "python", str(DRIVER)], cwd=copy, env=env, timeout=1500)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    assert line, f"the driver printed no RESULT line:\n{(out.stdout + out.stderr)[-5000:]}"
    return json.loads(line[len("RESULT "):])


@pytest.fixture(scope="module")
def uv_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """The CPU copy of NEMO_RL_SRC, locked and synced by uv (its driver venv, as ``uv run`` makes it), and the
    environment its commands run in (no PYTHONPATH, no RAY_ADDRESS)."""
    tmp_path = tmp_path_factory.mktemp("uv_route")
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("no `uv` on PATH (NeMo RL builds its actor venvs with it): pip install uv")
    py313 = _python313()
    if py313 is None or not Path(py313).exists():
        pytest.skip("no CPython 3.13 (NeMo RL's interpreter): set RLIX_UV_PYTHON (uv would download it from GitHub)")
    if not _pypi_reachable():
        pytest.skip("pypi.org is unreachable: uv cannot sync NeMo RL's dependencies")
    t_start = time.monotonic()

    copy = clone(nemo_src(), tmp_path / "RL")
    dropped = cpu_pyproject(copy)
    report(f"[uv route] CPU copy: left out {len(dropped)} requirements: {dropped}")
    # uv itself runs niced (a shared 2-core machine); the real binary, called by NeMo RL's code as `uv`.
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "uv").write_text(f'#!/bin/sh\nexec nice -n 10 {uv} "$@"\n')
    (shim / "uv").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k not in (*_SCRUB, "PYTHONPATH", "VIRTUAL_ENV")}
    base.update(
        PATH=f"{shim}{os.pathsep}{os.environ.get('PATH', '')}",
        UV_PYTHON=py313,
        UV_PYTHON_DOWNLOADS="never",
        UV_COMPILE_BYTECODE="1",  # a fresh venv's first imports otherwise compile everything, under load too slowly
        NEMO_RL_VENV_DIR=str(tmp_path / "venvs"),
        RAY_worker_register_timeout_seconds="300",
        HF_HUB_OFFLINE="1",
    )
    _run(["uv", "lock"], cwd=copy, env=base, timeout=900)
    _run(["uv", "sync", "--locked"], cwd=copy, env=base, timeout=1500)  # the driver's venv, as `uv run` makes it
    report(f"[uv route] copy ready in {time.monotonic() - t_start:.0f} s")
    return copy, base


@pytest.mark.timeout(3000)
def test_entry_points_resolve_in_a_nemo_rl_uv_actor_venv_through_pythonpath_only(
    uv_copy: tuple[Path, dict[str, str]], tmp_path: Path
) -> None:
    copy, base = uv_copy
    t_start = time.monotonic()
    venvs = Path(base["NEMO_RL_VENV_DIR"])

    # The README's recipe: rlix-plugins (this worktree) and pluggy into a directory, nothing installed anywhere.
    src, site = tmp_path / "src", tmp_path / "site"
    copy_tracked(src)
    _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site),
          str(src), "pluggy"], timeout=600)

    venv = venvs / FQN
    with _ray_head(copy / ".venv" / "bin" / "ray", base) as address:
        head = {**base, "RAY_ADDRESS": address}
        with_pp = _drive(copy, {**head, "PYTHONPATH": str(site), "VLLM_RAY_EXTRA_ENV_VARS_TO_COPY": "PYTHONPATH"})
        without = _drive(copy, head)
    report(f"[uv route] actor venv {venv}: {_size_gb(venv):.1f} GB; test after the copy {time.monotonic() - t_start:.0f} s")
    report(f"[uv route] with PYTHONPATH: {json.dumps(with_pp)}")
    report(f"[uv route] without: {json.dumps(without)}")

    # The actor ran the interpreter of the venv NeMo RL built with uv for this actor class, not the driver's.
    py = str(venv / "bin" / "python")
    assert with_pp["py_executable"] == py and with_pp["executable"] == py
    assert with_pp["prefix"] == str(venv) and with_pp["driver_executable"] != py
    assert re.search(r"^uv = ", (venv / "pyvenv.cfg").read_text(), re.M), "not a uv-built venv"
    assert not glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "rlix_plugins*")), "installed in the venv"

    # With PYTHONPATH: both groups resolve, to the package in SITE, and the modules load from there.
    assert with_pp["eps"] == {"nemo_rl.rlix_hooks": {"rlix": HOOKS_EP}, "vllm.general_plugins": {"rlix": VLLM_EP}}
    assert with_pp["rlix_plugins_origin"] == str(site / "rlix_plugins" / "__init__.py")
    assert with_pp["dist_path"] == str(site)
    loaded = with_pp["loaded"]
    assert loaded["hooks"] == "rlix_plugins.nemo_rl.hooks:NemoRLHooks"
    assert loaded["register"] == "rlix_plugins.vllm.plugin:register"
    assert loaded["hooks_file"] == str(site / "rlix_plugins" / "nemo_rl" / "hooks.py")
    assert loaded["worker_ops_file"] == str(site / "rlix_plugins" / "nemo_rl" / "worker_ops.py")

    # Without it: the same venv (reused, as NeMo RL reuses NEMO_RL_VENV_DIR), and nothing of ours.
    assert without["executable"] == py
    assert str(site) not in without["pythonpath"]
    assert without["rlix_plugins_origin"] is None and without["dist_path"] is None
    assert "rlix" not in without["eps"]["nemo_rl.rlix_hooks"] and "rlix" not in without["eps"]["vllm.general_plugins"]
    assert "loaded" not in without


def _size_gb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 1e9

