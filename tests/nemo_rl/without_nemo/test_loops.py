"""Per-loop publisher, progress and collector stop (rlix_plugins/nemo_rl/loops.py), chosen by the loop kind the
topology check detects, on real Ray actors. TransferQueue is not installable here: its controller is a stand-in
actor with the name, namespace and partition fields the counter reads (``transfer_queue/controller.py`` at c516143).
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.loops import TQ_CONTROLLER, loop_surface
from rlix_plugins.nemo_rl.runtime_adapter import NemoRuntime
from rlix_plugins.nemo_rl.topology import DATA_PLANE, SINGLE_CONTROLLER, grpo_loop
from rlix_plugins.pipeline.publisher import CollectorPublisher, LoopPublishes
from rlix_plugins.pipeline.versions import VersionLedger
from tests.nemo_rl.without_nemo.standins import StandinReplayBuffer, StandinRolloutActor, StandinTqController


def _config(**sections: Any) -> dict[str, Any]:
    return {"grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2, "async_grpo": {"enabled": False}},
            **sections}


def test_data_plane_loop_publishes_itself_and_counts_its_partition(ray_cluster: dict[str, float]) -> None:
    cfg = _config(data_plane={"enabled": True, "rlix_namespace": "rlix_tq_ft_test"})
    assert grpo_loop(cfg) == DATA_PLANE
    controller = ray.remote(StandinTqController).options(name=TQ_CONTROLLER, namespace="rlix_tq_ft_test",
                                                   num_cpus=0).remote()
    other = ray.remote(StandinTqController).options(name=TQ_CONTROLLER, namespace="transfer_queue", num_cpus=0).remote()
    rollout = ray.remote(StandinRolloutActor).options(num_cpus=0).remote()
    try:
        surface = loop_surface(DATA_PLANE, cfg, rollout, SimpleNamespace(tq_partition_id="train"))
        assert isinstance(surface.publisher, LoopPublishes) and surface.stop_collector is None
        surface.publisher.set_weight_version(3, timeout_s=5)  # an expand: nothing reaches the rollout actor
        assert surface.step_target == 4 and surface.count(0) == 0
        ray.get(other.put.remote("train", 8))  # another pipeline's (unscoped) controller does not count
        ray.get(controller.put.remote("val", 8))
        assert surface.count(0) == 0
        ray.get(controller.put.remote("train", 6))  # 6 samples = 3 prompt groups of 2 generations
        assert surface.count(1) == 3
        assert ray.get(rollout.ping.remote())
    finally:
        for actor in (controller, other, rollout):
            ray.kill(actor)


def test_single_controller_counts_selectable_ready_groups() -> None:
    cfg = _config(async_rl={}, data_plane={"enabled": True})
    assert grpo_loop(cfg) == SINGLE_CONTROLLER
    buffer = SimpleNamespace(start_weight_list=[0, 1, 2, 2, 3], ready_list=[True, True, False, True, True])
    sampler = SimpleNamespace(_buffer=buffer, _eviction_window=lambda: 1)
    surface = loop_surface(SINGLE_CONTROLLER, cfg, SimpleNamespace(), sampler)
    assert isinstance(surface.publisher, LoopPublishes) and surface.stop_collector is None
    assert [surface.count(v) for v in (0, 2, 3, 5)] == [4, 3, 2, 0]  # ready, start weight >= version - window


def test_async_grpo_keeps_the_collector_publisher_and_stops_the_collector(ray_cluster: dict[str, float]) -> None:
    cfg = _config(grpo={"num_prompts_per_step": 4, "async_grpo": {"enabled": True}})
    collector = ray.remote(StandinRolloutActor).options(num_cpus=0).remote()
    surface = loop_surface(grpo_loop(cfg), cfg, collector, None)
    assert isinstance(surface.publisher, CollectorPublisher) and surface.stop_collector is not None
    surface.stop_collector()
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(collector.ping.remote(), timeout=30)
    with pytest.raises(RlixConfigError, match="no time-sharing surface"):
        loop_surface(grpo_loop(_config()), _config(), collector, None)


class _RecordingRuntime:
    """What NemoRuntime hands the shared runtime (attach_collector's publisher, the end's collector stop)."""

    def __init__(self) -> None:
        self.publisher: Any = None
        self.stop_collector: Any = "unset"
        self.versions, self.pipeline_id = VersionLedger(), "ft_test"

    def attach_collector(self, publisher: Any) -> None:
        self.publisher = publisher

    def progress_reporter(self) -> Any:
        return SimpleNamespace(report=lambda *a, **k: None)

    def end(self, stop_collector: Any = None, error: str | None = None) -> list[str]:
        self.stop_collector = stop_collector
        return []


def test_nemo_runtime_chooses_by_loop_kind() -> None:
    """Full mode of the SingleController: its rollout manager is an in-process object; the runtime must neither
    publish to it after expands nor ray.kill it at the end."""
    runtime = NemoRuntime(SimpleNamespace())  # type: ignore[arg-type]
    runtime.rt = _RecordingRuntime()
    runtime._master_config = _config(async_rl={}, data_plane={"enabled": True})
    sampler = SimpleNamespace(_buffer=SimpleNamespace(start_weight_list=[], ready_list=[]), _eviction_window=lambda: 0)
    runtime.attach_collector(collector=SimpleNamespace(set_weight_version=lambda v: None), replay_buffer=sampler)
    runtime.stop()
    assert isinstance(runtime.rt.publisher, LoopPublishes)
    assert runtime.rt.stop_collector is None


def _async_config(max_age: int, steps: int = 10) -> dict[str, Any]:
    return _config(grpo={"num_prompts_per_step": 4, "max_num_steps": steps,
                         "async_grpo": {"enabled": True, "max_trajectory_age_steps": max_age}})


def test_async_grpo_first_step_waits_for_the_lookahead_batch_until_the_trainer_asks(
        ray_cluster: dict[str, float]) -> None:
    """NeMo RL's start-up barrier: the first step trains only once the next step's batch is complete too. Until the
    trainer asks for its grant, the first version's batch counts no more than the next one's; once it asked (or
    where no barrier applies: max age 0, the last step) its own batch alone counts."""
    buffer = ray.remote(StandinReplayBuffer).options(num_cpus=0).remote()
    ray.get(buffer.add.remote(0, 4))  # batch 0 complete, batch 1 half
    ray.get(buffer.add.remote(1, 2))
    try:
        surface = loop_surface(grpo_loop(_async_config(1)), _async_config(1), None, buffer)
        assert [surface.waited_for(0, asked) for asked in (False, True)] == [2, 4]
        assert surface.waited_for(1, False) == 0  # a run resumed at step 1: its lookahead is batch 2 (none yet)
        no_age = loop_surface(grpo_loop(_async_config(0)), _async_config(0), None, buffer)
        assert no_age.waited_for(0, False) == 4
        last = loop_surface(grpo_loop(_async_config(1, steps=1)), _async_config(1, steps=1), None, buffer)
        assert last.waited_for(0, False) == 4

        # through the progress thread of the runtime adapter, before the trainer asked
        reports: list[tuple[int, int]] = []
        runtime = NemoRuntime(SimpleNamespace())  # type: ignore[arg-type]
        runtime.rt = _RecordingRuntime()
        runtime.rt.progress_reporter = lambda: SimpleNamespace(report=lambda n, target, **k: reports.append((n, target)))
        runtime.rt.versions = VersionLedger(published=0)
        runtime._master_config = _async_config(1)
        runtime.attach_collector(collector=None, replay_buffer=buffer)
        deadline = time.monotonic() + 20
        while not reports and time.monotonic() < deadline:
            time.sleep(0.1)
        runtime.stop()
        assert reports and reports[0] == (2, 4), reports
    finally:
        ray.kill(buffer)
