"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/``) with NeMo RL's own pytest, against the
real TransferQueue (``transferqueue==0.1.9``, NeMo RL's pin) on this session's Ray cluster. Driven by
``tests/nemo_rl/drives_nemo/test_nemo_rl_loops.py`` of rlix-plugins; not part of NeMo RL.

Patch 0007 puts a pipeline's TransferQueue controller and storage units into the Ray namespace its plugin chose
(``data_plane.rlix_namespace``). The SingleController's ``setup()`` builds its connect-only client in the driver and
hands it to its actor; on the H200 (2026-11-25) that actor's first put looked the controller up under TQ's default
namespace and failed ("TransferQueueController has not been initialized yet"). Here the same hand-over runs for real.
"""

import pytest
import ray
import torch
from tensordict import TensorDict
from tests.unit.algorithms.rlix_ray_fixtures import init_ray_cluster, ray_gpu_monitor  # noqa: F401  (overrides)

pytest.importorskip("transfer_queue", reason="the real TransferQueue is needed: pip install transferqueue==0.1.9")

NAMESPACE = "rlix_tq_scenario"
CONTROLLER = "TransferQueueController"  # TQ's fixed actor name (transfer_queue/interface.py at c516143)


def _cfg():
    return {"enabled": True, "impl": "transfer_queue", "backend": "simple", "storage_capacity": 64,
            "num_storage_units": 1, "claim_meta_poll_interval_s": 0.5, "global_segment_size": 1 << 26,
            "local_buffer_size": 1 << 24, "rlix_namespace": NAMESPACE}


@ray.remote(num_cpus=0)
class ClientHolder:
    """What the SingleController actor is to its client here: it receives the client the driver built, pickled."""

    def __init__(self, client):
        self.client = client

    def put(self, partition: str, ids: list, values: list) -> list:
        fields = TensorDict({"x": torch.tensor(values, dtype=torch.float32).view(-1, 1)}, batch_size=[len(ids)])
        return list(self.client.put_samples(sample_ids=ids, partition_id=partition, fields=fields).sample_ids)


def test_a_client_handed_to_an_actor_reaches_its_pipelines_controller(monkeypatch):
    from nemo_rl.data_plane import build_data_plane_client
    from nemo_rl.data_plane.adapters import transfer_queue as tq_adapter

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    # NeMo RL would give TQ's actors a runtime_env that pip-installs TQ (its pin read from an installed nemo-rl's
    # metadata); here NeMo RL runs from source, offline, and TQ is importable by every actor: skip that injection.
    monkeypatch.setattr(tq_adapter, "_TQ_RUNTIME_ENV_PATCHED", True)
    bootstrap = build_data_plane_client(_cfg(), bootstrap=True)  # what TQPolicy does in the driver
    try:
        assert ray.get_actor(CONTROLLER, namespace=NAMESPACE) is not None
        with pytest.raises(ValueError):  # nothing under TQ's default name: another pipeline could take it
            ray.get_actor(CONTROLLER, namespace="transfer_queue")
        connect_only = build_data_plane_client(_cfg(), bootstrap=False)  # what the SC's setup() does
        bootstrap.register_partition("p0", fields=["x"], num_samples=2, consumer_tasks=["read"])
        holder = ClientHolder.options(runtime_env={"env_vars": {"RLIX_CONTROL_PLANE": "rlix"}}).remote(connect_only)
        assert ray.get(holder.put.remote("p0", ["s0", "s1"], [1.5, -2.0]), timeout=120) == ["s0", "s1"]
        got = bootstrap.get_samples(["s0", "s1"], "p0", ["x"])
        assert got["x"].view(-1).tolist() == [1.5, -2.0]
        ray.kill(holder)
    finally:
        bootstrap.close()
