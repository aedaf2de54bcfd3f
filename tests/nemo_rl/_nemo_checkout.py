"""Helpers of the NeMo RL conformance suite: copies of the checkout and NeMo RL's own pytest runs.

NeMo RL's tests run in the conformance venv (``scripts/setup_nemo_rl_env.sh``, default ``.venv-nemo``) with the
copy on ``PYTHONPATH``, never in this process: NeMo RL needs its own dependency set and starts its own Ray.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SERIES_ROOT = REPO_ROOT / "patches" / "nemo-rl"
PINNED_COMMIT = "7ea279abfbeb698b092856d0dab61e7cf39bc909"

#: Environment variables that must not leak from the outer test process into NeMo RL's runs.
_SCRUB = ("RLIX_CONTROL_PLANE", "RAY_ADDRESS", "PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")


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


def nemo_env(copy: Path, **extra: str) -> dict[str, str]:
    """Environment of a NeMo RL run. ``RAY_TMPDIR`` is private: NeMo RL's ``init_ray`` first tries
    ``ray.init(address="auto")`` and would otherwise join (and later lose) any other local Ray cluster."""
    env = {k: v for k, v in os.environ.items() if k not in _SCRUB}
    env.update(
        RAY_TMPDIR=tempfile.mkdtemp(prefix="rlixc_", dir="/tmp"),  # short: Ray's socket paths are length-limited
        PYTHONPATH=str(copy),
        HF_HUB_OFFLINE="1",
        RAY_AUTH_MODE="disabled",
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
    copy: Path, targets: list[str], junit: Path, *, timeout_s: float, extra_env: dict[str, str] | None = None
) -> PytestRun:
    """NeMo RL's pytest on ``targets`` inside ``copy`` (its conftest starts its own local Ray cluster)."""
    cmd = [
        str(nemo_python()), "-m", "pytest", *targets,
        "-q", "-p", "no:cacheprovider", "-o", "addopts=", "--timeout=600", f"--junitxml={junit}",
    ]  # fmt: skip
    try:
        proc = subprocess.run(
            cmd, cwd=copy, env=nemo_env(copy, **(extra_env or {})), capture_output=True, text=True, timeout=timeout_s
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
