"""A 2-minute chaos soak (``benchmarks/soak.py``): random faults of the matrix hit two built-in pipelines on two
declared GPUs; no hang, no invariant violation, no GPU leaked, every weight sync verified."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests._repo import load_script
from tests.control._ray_helpers import kill_control_plane

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

_SOAK = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"


def _soak_module() -> Any:
    return load_script(_SOAK, "rlix_soak")


def test_two_minute_soak_has_no_hang_violation_or_leak(ray_cluster: Any, tmp_path: Path) -> None:
    soak = _soak_module()
    kill_control_plane()
    try:
        report = soak.run_soak(2.0, pipelines=2, gpus=2, seed=1, mean_gap_s=15.0, workdir=tmp_path)
    finally:
        kill_control_plane()
    print("\n".join(soak.report_lines(report)))
    assert report["faults_injected"] >= 1, report["fault_outcomes"]
    assert report["hangs"] == 0, report["hang_details"]
    assert report["invariant_violations"] == 0, report["violation_details"]
    assert report["gpus_leaked"] == 0
    assert report["invariant_checks"] > 0 and report["cycles"] >= report["invariant_checks"]
    assert report["syncs_verified"] > 0 and report["syncs_not_verified"] == 0
