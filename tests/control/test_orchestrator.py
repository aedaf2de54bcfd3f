"""Orchestrator: pipeline ids, validated registration (errors that say how to fix), admit, unregister, kill."""

from __future__ import annotations

import re

import pytest
import ray

from rlix_plugins.control import client
from rlix_plugins.control.registration import build_cluster_specs
from rlix_plugins.control.types import Priority, pipeline_namespace
from rlix_plugins.errors import PipelineUnregisteredError, RlixConfigError, SchedulerError
from tests.control._ray_helpers import control_plane, make_pipeline

__all__ = ["control_plane"]

BAD_REGISTRATIONS = [
    # (tp configs, device mappings, expected message fragment)
    ({"actor_train": 1, "actor_infer": 2}, {"actor_train": [0], "actor_infer": [0, 1, 1, 2]}, "more than once"),
    ({"actor_train": 1, "actor_infer": 1}, {"actor_train": [0], "actor_infer": []}, "is empty"),
    ({"actor_infer": 1, "policy": 1}, {"actor_infer": [0], "policy": [1]}, r"unknown cluster name\(s\) \['policy'\]"),
    ({"actor_train": 1, "actor_infer": 1}, {"actor_train": [0, 3], "actor_infer": [0, 1]}, r"GPUs \[3\] are not in"),
    ({"actor_train": 1}, {"actor_train": [0]}, "no 'actor_infer' cluster"),
    ({"actor_infer": 1}, {"actor_infer": [0, 4]}, r"not in the pool \[0..3\]"),
    ({"actor_infer": 2}, {"actor_infer": [0, 1, 2]}, "not a multiple of tp_size=2"),
    ({"actor_infer": 2}, {"actor_infer": [0, 2]}, "is not contiguous"),
    ({"actor_infer": 0}, {"actor_infer": [0]}, "must be a positive int"),
    ({"actor_train": 2, "actor_infer": 2}, {"actor_train": [0, 1], "actor_infer": [0, 1]}, "tp_size=1"),
    ({"actor_infer": 1}, {"actor_train": [0], "actor_infer": [0]}, "same cluster names"),
    ({"actor_infer": 1}, {"actor_infer": "0,1"}, "must be a list of GPU ids"),
]


@pytest.mark.parametrize(("tps", "maps", "match"), BAD_REGISTRATIONS)
def test_bad_registration_is_rejected_with_fix(tps: dict, maps: dict, match: str) -> None:
    """Pure validation (no Ray): each message names the value and what to do."""
    with pytest.raises(RlixConfigError, match=match):
        build_cluster_specs("ft_0123456789ab", tps, maps, num_gpus=4, gpus_per_node=4)


def test_tp_group_must_stay_on_one_node() -> None:
    with pytest.raises(RlixConfigError, match="crosses a node boundary"):
        build_cluster_specs("p", {"actor_infer": 2}, {"actor_infer": [1, 2]}, num_gpus=4, gpus_per_node=2)
    with pytest.raises(RlixConfigError, match="pipeline_id"):
        build_cluster_specs("a:b", {"actor_infer": 1}, {"actor_infer": [0]}, num_gpus=4, gpus_per_node=4)


def test_good_registration_is_canonical() -> None:
    specs = build_cluster_specs(
        "ft_0123456789ab", {"actor_train": 1, "actor_infer": 2}, {"actor_train": [1, 0], "actor_infer": [3, 2, 1, 0]},
        num_gpus=4, gpus_per_node=4,
    )
    assert specs["actor_infer"].device_mapping == (0, 1, 2, 3) and specs["actor_infer"].num_dp_ranks == 2
    assert specs["actor_train"].cluster_id == "ft_0123456789ab_actor_train"


def test_ids_register_admit_and_errors_through_ray(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    ids = {cp.allocate_pipeline_id() for _ in range(5)}
    assert len(ids) == 5 and all(re.fullmatch(r"ft_[0-9a-f]{12}", i) for i in ids)
    assert re.fullmatch(r"lora_[0-9a-f]{12}", cp.allocate_pipeline_id("lora"))
    with pytest.raises(RlixConfigError, match="unknown pipeline kind"):
        cp.allocate_pipeline_id("dpo")
    assert cp.pool() == {"num_gpus": 4, "gpus_per_node": 4}
    # The error raised inside the orchestrator arrives as the same typed error, not a RayTaskError.
    with pytest.raises(RlixConfigError, match=r"GPUs \[2\] are not in the actor_infer mapping"):
        cp.register_pipeline({"actor_train": 1, "actor_infer": 1}, {"actor_train": [2], "actor_infer": [0, 1]})
    assert cp.status()["pipelines"] == {}

    pid = cp.allocate_pipeline_id()
    client.call(cp.orchestrator.register_pipeline.remote(pid, {"actor_infer": 1}, {"actor_infer": [0]}), "register")
    with pytest.raises(RlixConfigError, match="already registered"):
        client.call(cp.orchestrator.register_pipeline.remote(pid, {"actor_infer": 1}, {"actor_infer": [0]}), "re")
    with pytest.raises(SchedulerError, match="not admitted"):
        client.call(cp.scheduler.request_gpus.remote(f"{pid}_actor_infer", int(Priority.INITIALIZATION)), "req")
    client.call(cp.orchestrator.admit_pipeline.remote(pid), "admit")
    assert cp.status()["pipelines"][pid]["admitted"] is True
    assert cp.unregister_pipeline(pid) is True and cp.unregister_pipeline(pid) is False


def test_kill_pipeline_kills_its_named_actors_only(control_plane: client.ControlPlane) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[2], infer=[2, 3])

    @ray.remote(num_cpus=0)
    class Helper:
        def ping(self) -> str:
            return "ok"

    extra = Helper.options(name="rlix:pipeline:extra", namespace=pipeline_namespace(a.pipeline_id)).remote()
    ray.get(extra.ping.remote())
    a.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=10)
    killed = a.kill()
    assert killed == sorted([f"rlix:coordinator:{a.pipeline_id}", "rlix:pipeline:extra"])
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(extra.ping.remote(), timeout=10)
    st = cp.status()
    assert a.pipeline_id not in st["pipelines"] and st["idle_gpus"] == [0, 1, 2, 3]
    assert ray.get(b.coordinator.ping.remote(), timeout=10) == "ok"
    with pytest.raises(PipelineUnregisteredError):
        a.request_gpus("actor_train", Priority.ACTOR_TRAINING, timeout_s=1)
