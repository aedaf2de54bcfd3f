"""The NeMo RL GPU report (tools/gpu-offline/gpu/nemo_rl_shared_report.py) over a stored H200 run: its trace figures come from
the timeline's own span reconstruction (``occupancy_spans``/``held_seconds``) and match the report written then."""

from __future__ import annotations

import gzip
import shutil
import subprocess
import sys
from pathlib import Path

RUN = Path(__file__).resolve().parents[1] / "benchmarks/results/h200-2026-11-26-real-scale/shared2-coresident"


def test_report_of_the_stored_coresident_run(tmp_path: Path) -> None:
    for f in RUN.iterdir():
        if f.suffix == ".gz":
            with gzip.open(f, "rb") as src, open(tmp_path / f.stem, "wb") as dst:
                shutil.copyfileobj(src, dst)
        elif f.name in ("summary.json", "status.json", "gpu_after.csv"):
            shutil.copy(f, tmp_path / f.name)
    out = subprocess.run([sys.executable, "tools/gpu-offline/gpu/nemo_rl_shared_report.py", str(tmp_path)], capture_output=True,
                         text=True, timeout=120, check=True, cwd=RUN.parents[3]).stdout
    stored = (RUN / "report.txt").read_text()
    for line in ("steps 16; step phase 898.8 s -> 64 steps/h", "GPU busy 0.618 of the steps phase",
                 "held by rollout + training: 785 s of the steps phase, busy 0.654",
                 "held by training: 99 s of the steps phase, busy 0.392",
                 "at most 1 steps of another while one waited"):
        assert line in out and line in stored, (line, out)
    assert "allocated 0.997" in out and "GPU allocated 0.997 of the steps phase" in stored
