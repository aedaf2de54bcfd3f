"""Fixtures of the NeMo RL host's fault modules (``test_fault_matrix_nemo``, ``test_engine_core_death_nemo``)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from rlix_plugins.control.client import ControlPlane, connect
from tests.control._ray_helpers import kill_control_plane
from tests.harness.chaos import BENCH_SCHEDULER


@pytest.fixture(scope="module")
def cp(ray_cluster: Any) -> Iterator[ControlPlane]:
    kill_control_plane()  # a scheduler with the built-in rows' short bounds (BENCH_SCHEDULER)
    yield connect(create_if_missing=True, scheduler_config=BENCH_SCHEDULER)
    kill_control_plane()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    return str(build_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny", seed=0))
