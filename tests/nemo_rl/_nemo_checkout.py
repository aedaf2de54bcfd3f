"""Helpers of the NeMo RL conformance suite: copies of the checkout and NeMo RL's own pytest runs.

NeMo RL's tests run in the conformance venv (``scripts/setup_nemo_rl_env.sh``, default ``.venv-nemo``) with the
copy on ``PYTHONPATH``, never in this process: NeMo RL needs its own dependency set and starts its own Ray.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_ROOT = REPO_ROOT / "patches" / "nemo-rl"
PINNED_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

#: Environment variables that must not leak from the outer test process into NeMo RL's runs.
_SCRUB = ("RLIX_CONTROL_PLANE", "RAY_ADDRESS", "RAY_AUTH_MODE", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")


SEAM_PATCH = SERIES_ROOT / "7ea279a" / "0001-rlix-hooks-seam.patch"


def seam_from_patch(tmp_path: Path) -> Path:
    """The new file of patch 0001 (``nemo_rl/algorithms/rlix_hooks.py``), materialised: exactly the code NeMo RL
    gets. No NeMo RL checkout needed."""
    lines = SEAM_PATCH.read_text().splitlines()
    start = lines.index("+++ b/nemo_rl/algorithms/rlix_hooks.py")
    body = [ln[1:] for ln in lines[start + 2 :] if ln.startswith("+")]
    path = tmp_path / "rlix_hooks.py"
    path.write_text("\n".join(body) + "\n")
    return path


def nemo_src() -> Path:
    src = Path(os.environ["NEMO_RL_SRC"]).expanduser().resolve()
    if not (src / "nemo_rl" / "algorithms" / "grpo.py").is_file():
        pytest.fail(f"NEMO_RL_SRC={src} is not a NeMo RL checkout (no nemo_rl/algorithms/grpo.py)")
    return src


def nemo_python() -> Path:
    """The conformance venv's interpreter; skips (with the fix) when it was not built."""
    env = os.environ.get("RLIX_NEMO_PYTHON")
    py = Path(env) if env else REPO_ROOT / ".venv-nemo" / "bin" / "python"
    if not py.exists():
        pytest.skip(f"no conformance venv at {py}: run scripts/setup_nemo_rl_env.sh (or set RLIX_NEMO_PYTHON)")
    return py


def clone(src: Path, dst: Path) -> Path:
    """A git clone of ``src``'s HEAD (pristine even if ``src`` itself is patched)."""
    subprocess.run(["git", "clone", "-q", str(src), str(dst)], check=True, timeout=300)
    return dst


def apply_series(copy: Path) -> None:
    from rlix_plugins.patching import APPLIED, apply, find_checkout

    root, head = find_checkout(copy)
    status = apply(root, head, SERIES_ROOT)
    if status.state != APPLIED:
        pytest.fail(f"series not applied to {copy}:\n{status.report()}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def stop_processes_naming(marker: str) -> None:
    """Terminate (then kill, after 15 s) every process whose command line names ``marker`` (a private temp dir)."""
    import psutil

    procs = [p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or [])]
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=15)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


@contextlib.contextmanager
def private_ray_head(num_gpus: int = 0) -> Iterator[str]:
    """A Ray head for one NeMo RL pytest run; yields its address (for ``RAY_ADDRESS``).

    NeMo RL's ``init_ray`` and its memory tracker resolve ``address="auto"``, which joins (or, with several on
    the machine, refuses) whatever other Ray cluster runs here; an explicit ``RAY_ADDRESS`` pins them to this
    one. Teardown stops only the processes of this head (found by its private temp dir), never ``ray stop``.
    """

    tmp = tempfile.mkdtemp(prefix="rlixc_", dir="/tmp")  # short: Ray's socket paths are length-limited
    port = _free_port()
    cmd = [str(nemo_python().parent / "ray"), "start", "--head", f"--port={port}", "--num-cpus=8",
           f"--num-gpus={num_gpus}", "--include-dashboard=false", f"--temp-dir={tmp}", "--disable-usage-stats"]
    # Ray's token authentication stays on: the head demands the session's token (RAY_AUTH_TOKEN_PATH, conftest).
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    env.pop("RAY_ADDRESS", None)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    found = re.search(r"--address='([^']+)'", out.stdout + out.stderr)
    try:
        if out.returncode != 0 or not found:
            pytest.fail(f"could not start a private Ray head ({' '.join(cmd)}):\n{(out.stdout + out.stderr)[-3000:]}")
        yield found.group(1)
    finally:
        stop_processes_naming(tmp)
        time.sleep(0.5)


def nemo_env(copy: Path, **extra: str) -> dict[str, str]:
    """Environment of a NeMo RL run (pass ``RAY_ADDRESS`` of a :func:`private_ray_head` in ``extra``)."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    outer = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join([str(copy), *outer]),  # the copy, then the caller's (a worktree's rlix_plugins)
        HF_HUB_OFFLINE="1",
        RAY_DEDUP_LOGS="0",
        TOKENIZERS_PARALLELISM="false",
    )
    env.update(extra)
    return env


@dataclass(frozen=True)
class PytestRun:
    returncode: int
    outcomes: dict[str, str]  # test id -> passed | failed | error | skipped
    output_tail: str

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)

    def summary(self) -> str:
        counts = {o: self.count(o) for o in ("passed", "failed", "error", "skipped")}
        return ", ".join(f"{n} {o}" for o, n in counts.items() if n)


def run_nemo_pytest(
    copy: Path, targets: list[str], junit: Path, *, timeout_s: float, extra_env: dict[str, str] | None = None,
    num_gpus: int = 0,
) -> PytestRun:
    """NeMo RL's pytest on ``targets`` inside ``copy``, on a private Ray head (``num_gpus`` declared)."""
    with private_ray_head(num_gpus) as address:
        # Its processes join the head by address (the scenarios' ray.init(address=RAY_ADDRESS), which Ray never
        # switches to token mode by itself), so they are told the head demands the token.
        return _run_nemo_pytest(copy, targets, junit, timeout_s,
                                {**(extra_env or {}), "RAY_ADDRESS": address, "RAY_AUTH_MODE": "token"})


#: Our files that run inside a patched copy (``inside_nemo/``), and the helper modules every scenario imports.
INSIDE_NEMO = Path(__file__).parent / "inside_nemo"
INSIDE_NEMO_HELPERS = ("rlix_ray_fixtures.py", "rlix_grpo_harness.py", "rlix_worker_standins.py")


def run_inside_nemo(
    copy: Path, scenario: str, dest: str, junit: Path, *, timeout_s: float, num_gpus: int = 0,
    helpers: tuple[str, ...] = INSIDE_NEMO_HELPERS, extra_env: dict[str, str] | None = None,
) -> PytestRun:
    """Copy ``inside_nemo/<scenario>`` and the shared ``helpers`` into ``copy/<dest>``, run the scenario with NeMo RL's
    pytest (private Ray head, ``num_gpus`` declared), remove the copies."""
    dst = copy / dest
    copied = []
    try:
        for name in (*helpers, scenario):
            shutil.copyfile(INSIDE_NEMO / name, dst / name)
            copied.append(dst / name)
        return run_nemo_pytest(copy, [f"{dest}/{scenario}"], junit, timeout_s=timeout_s, num_gpus=num_gpus,
                               extra_env=extra_env)
    finally:
        for path in copied:
            path.unlink()


def _run_nemo_pytest(
    copy: Path, targets: list[str], junit: Path, timeout_s: float, extra_env: dict[str, str]
) -> PytestRun:
    cmd = [
        str(nemo_python()), "-m", "pytest", *targets,
        "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=600", f"--junitxml={junit}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=nemo_env(copy, **extra_env), capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-4000:]
        pytest.fail(f"NeMo RL pytest {targets} did not finish in {timeout_s:.0f} s; output tail:\n{tail!r}")
    out = proc.stdout + proc.stderr
    if not junit.exists():
        pytest.fail(f"NeMo RL pytest {targets} wrote no report (rc={proc.returncode}); output tail:\n{out[-6000:]}")
    return PytestRun(proc.returncode, parse_junit(junit), out[-6000:])


def parse_junit(path: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed"}.get(child.tag, child.tag)
                break
        # A test that failed in its call and errored in teardown appears twice; the worst outcome wins.
        if outcomes.get(name) not in ("failed", "error"):
            outcomes[name] = outcome
    return outcomes


def report(msg: str) -> None:
    """Shown with ``-s`` (the conformance script passes it) and kept in the junit of the outer run."""
    print(msg, file=sys.stderr, flush=True)
