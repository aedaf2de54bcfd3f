"""Ray actors for weight-sync tests across Ray nodes (``tests/transport/test_cross_node.py``): a sender that owns
a bucket cache and runs the product's ``sync_weights``, a receiver host around :class:`SubprocessReceiver`, and the
``ReceiverEndpoint`` that reaches it from the sender. Importable by Ray workers (``tests.harness``), which a test
module is not."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import ray
import torch

from rlix_plugins.control.admin.local_nodes import bindable, node_ip, start_local_nodes

BUCKET = 32 << 10
TIMEOUT_S = 30.0
#: node B's address: Linux routes all of 127/8 to loopback, and nothing of node A listens there
NODE_B_IP = node_ip(1)


@contextlib.contextmanager
def two_nodes(num_cpus: int = 2, num_gpus: int = 0, node_b_env: dict[str, str] | None = None,
              log_to_driver: bool = True) -> Iterator[Any]:
    """Two raylets on this machine (``rlix_plugins.control.admin.local_nodes``), node A (the head, on the machine's
    address, custom resource ``node_a``) and node B (``NODE_B_IP``, resource ``node_b``), with this process
    connected. The session's single-node Ray, if up, is stopped first and started again after.

    Modules that use it are marked ``own_cluster``: ``scripts/test.sh`` runs them in a pytest process of their own,
    because switching one long-lived driver between clusters is where Ray is fragile (a full run once ended with
    the driver gone, exit code 1 and no report, right after such a switch)."""
    from tests.harness.ray_session import no_auto_connect, start_session_ray

    if not bindable(NODE_B_IP):
        import pytest

        pytest.skip(f"{NODE_B_IP} cannot be bound on this machine (Linux routes 127.0.0.0/8 to lo; macOS does not)")
    with no_auto_connect():
        restore = ray.is_initialized()
        if restore:
            ray.shutdown()
        nodes = start_local_nodes(2, num_cpus=num_cpus, num_gpus=num_gpus, resources=[{"node_a": 10}, {"node_b": 10}],
                                  env=[{}, node_b_env or {}])
        try:
            ray.init(address=nodes.address, namespace="rlix_cross_node", log_to_driver=log_to_driver)
            yield nodes.cluster
        finally:
            ray.shutdown()
            nodes.end()
            if restore:
                start_session_ray()


def on_node(node: str) -> dict[str, Any]:
    """Actor options that pin it to node ``"a"`` or ``"b"`` of :func:`two_nodes`."""
    return {"resources": {f"node_{node}": 1}, "num_cpus": 0}


def _model(version: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(500 + version)
    out = [(f"layers.{i}.weight", torch.randn(48, 40 + i, generator=g).to(torch.bfloat16)) for i in range(6)]
    return [*out, ("embed.weight", torch.randn(100, 64, generator=g)), ("step", torch.tensor(version))]


class ReceiverHost:
    """One target DP rank on its node: a ``SubprocessReceiver`` (one CPU worker) inside a Ray actor."""

    def __init__(self) -> None:
        from rlix_plugins.transport import export_node_env
        from tests.harness.local_receiver import SubprocessReceiver

        export_node_env()  # before the worker process starts: it has no Ray of its own
        self.receiver = SubprocessReceiver(("cpu",))

    def call(self, method: str, args: tuple[Any, ...], timeout_s: float) -> Any:
        return self.receiver.call_all(method, *args).result(timeout_s)

    def state(self) -> dict[str, Any]:
        return dict(self.receiver.call_worker(0, "state").result(60))

    def node_ip(self) -> str:
        return str(ray.util.get_node_ip_address())

    def close(self) -> None:
        self.receiver.close()


class ActorEndpoint:
    """``transport.ReceiverEndpoint`` over a :class:`ReceiverHost` actor (picklable; used inside the sender actor).

    ``dial``: the address the receiver dials instead of the one the sender gives it - what every receiver did before
    the rendezvous moved to the sender's node IP (the sender told it 127.0.0.1, its own loopback)."""

    def __init__(self, actor: Any, dial: str | None = None) -> None:
        self.actor, self.dial = actor, dial

    def _start(self, method: str, *args: Any) -> Any:
        return self.actor.call.remote(method, args, TIMEOUT_S * 4).future()  # sent now: the dispatch rule

    def setup_collective_group(self, group_name: str, master_addr: str, master_port: int,
                               ranks_by_local_rank: dict[int, int], world_size: int, backend: str,
                               timeout_s: float) -> Any:
        return self._start("setup_collective_group", group_name, self.dial or master_addr, master_port,
                           ranks_by_local_rank, world_size, backend, timeout_s)

    def update_parameter_in_bucket(self, payload: dict[str, Any], ipc_local_ranks: list[int]) -> Any:
        return self._start("update_parameter_in_bucket", payload, ipc_local_ranks)

    def broadcast_parameter(self, group_name: str, bucket_meta: dict[str, Any], broadcast_local_ranks: list[int]) -> Any:
        return self._start("broadcast_parameter", group_name, bucket_meta, broadcast_local_ranks)

    def destroy_collective_group(self, group_name: str) -> Any:
        return self._start("destroy_collective_group", group_name)

    def verify_model(self, expected_checksums: dict[str, list[int]]) -> Any:
        return self._start("verify_model", expected_checksums)

    def report_places(self) -> Any:
        return self._start("report_place")


class Sender:
    """The cache owner on its node: builds a version and syncs it with the product's ``sync_weights``."""

    def __init__(self) -> None:
        from rlix_plugins.transport import VersionedBucketCache

        torch.set_num_threads(1)
        self.cache = VersionedBucketCache(BUCKET)

    def sync(self, version: int, sender: tuple[int, int], targets: dict[int, list[tuple[int, int]]], transport: str,
             endpoints: dict[int, ActorEndpoint], timeout_s: float = TIMEOUT_S) -> dict[str, Any]:
        from rlix_plugins.transport import build_comm_plan, sync_weights

        self.cache.build(version, iter(_model(version)))
        plan = build_comm_plan(sender, targets, transport)
        report = sync_weights(self.cache, plan, endpoints, timeout_s=timeout_s, verify=True)  # no master_addr: Ray's
        return {"rendezvous": report.rendezvous, "broadcast": report.broadcast_dp_ranks, "ipc": report.ipc_dp_ranks,
                "verified": report.verified, "params": len(report.checksums)}

    def node_ip(self) -> str:
        return str(ray.util.get_node_ip_address())


class EngineSender:
    """A cache owner that drives vLLM engines with the product's ``sync_engines`` (the demo trainer's and NeMo RL's
    ``sync_from_cache``'s path: no ``master_addr``, the rendezvous is this actor's Ray node IP)."""

    def __init__(self, weights: dict[str, torch.Tensor], bucket_bytes: int) -> None:
        from rlix_plugins.transport import VersionedBucketCache

        torch.set_num_threads(1)
        self.cache = VersionedBucketCache(bucket_bytes)
        self.cache.build(1, sorted(weights.items()))

    def sync(self, sender: tuple[int, int], targets: dict[int, list[tuple[int, int]]], transport: str,
             engines: dict[int, Any], timeout_s: float) -> dict[str, Any]:
        from rlix_plugins.transport import build_comm_plan
        from rlix_plugins.vllm.driver import sync_engines

        plan = build_comm_plan(sender, targets, transport)
        report = sync_engines(self.cache, plan, engines, staging_device="cpu", backend="gloo", timeout_s=timeout_s,
                              verify=True)
        return {"rendezvous": report.transport.rendezvous, "broadcast": report.transport.broadcast_dp_ranks,
                "finalized": report.finalized_dp_ranks,
                "verified": {dp: [w["received"] for w in per] for dp, per in report.verified.items()}}
