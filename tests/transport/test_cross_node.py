"""Weight sync between two Ray nodes: ``ray.cluster_utils.Cluster`` runs two raylets on this machine, node A on the
machine's address and node B on ``127.0.0.2`` (Linux routes all of 127/8 to loopback), so a rendezvous on the wrong
address fails instead of passing by accident.

The sender (a Ray actor holding the bucket cache) runs on one node, the receiver (a Ray actor hosting the harness's
``SubprocessReceiver``, whose worker process learns its Ray node from the actor, ``export_node_env``) on the other;
the sync is a real gloo broadcast with the sender's checksums verified on the receiver. One cluster for the module;
the session's single-node Ray is stopped for it and started again after.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from rlix_plugins.errors import RlixConfigError, TransportError
from tests.harness.cross_node import (
    NODE_B_IP,
    TIMEOUT_S,
    ActorEndpoint,
    ReceiverHost,
    Sender,
    on_node,
    two_nodes,
)

pytestmark = pytest.mark.own_cluster
ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def nodes() -> Iterator[dict[str, Any]]:
    with two_nodes():
        actors = {
            "sender_a": ray.remote(Sender).options(**on_node("a")).remote(),
            "sender_b": ray.remote(Sender).options(**on_node("b")).remote(),
            "receiver_a": ray.remote(ReceiverHost).options(**on_node("a")).remote(),
            "receiver_b": ray.remote(ReceiverHost).options(**on_node("b")).remote(),
        }
        ips = {name: ray.get(actor.node_ip.remote(), timeout=180) for name, actor in actors.items()}
        assert ips["sender_b"] == ips["receiver_b"] == NODE_B_IP and ips["sender_a"] == ips["receiver_a"] != NODE_B_IP
        yield {**actors, "ip_a": ips["sender_a"]}
        for name in ("receiver_a", "receiver_b"):
            ray.get(actors[name].close.remote(), timeout=60)


@pytest.mark.parametrize(("sender", "receiver"), [("b", "a"), ("a", "b")])
def test_broadcast_across_nodes_meets_on_the_senders_node_ip(nodes: dict[str, Any], sender: str, receiver: str) -> None:
    """Sender on one node, receiver on the other; the config plan says so (node 1 vs node 0), the receiver's place
    agrees, the group meets on the sender's node IP, and the receiver verifies the sender's checksums, twice (a
    fresh group per sync)."""
    endpoint = ActorEndpoint(nodes[f"receiver_{receiver}"])
    expected_ip = NODE_B_IP if sender == "b" else nodes["ip_a"]
    for version in (1, 2):
        out = ray.get(nodes[f"sender_{sender}"].sync.remote(version, (1, 0), {0: [(0, 0)]}, "host_pull", {0: endpoint}),
                      timeout=TIMEOUT_S * 6)
        assert out == {"rendezvous": expected_ip, "broadcast": (0,), "ipc": (), "verified": True, "params": 8}
    assert ray.get(nodes[f"receiver_{receiver}"].state.remote(), timeout=60)["groups"] == []


def test_a_receiver_dialing_its_own_loopback_never_joins(nodes: dict[str, Any]) -> None:
    """The old rendezvous: every receiver was told 127.0.0.1. The group's store now listens on the sender's node IP
    only (127.0.0.2 here), so a receiver dialing its loopback fails within the timeout, naming the address, and
    the next sync (dialing what it is told) works."""
    wrong = ActorEndpoint(nodes["receiver_a"], dial="127.0.0.1")
    start = time.monotonic()
    with pytest.raises(TransportError, match=r"could not join group .* at 127\.0\.0\.1:\d+"):
        ray.get(nodes["sender_b"].sync.remote(3, (1, 0), {0: [(0, 0)]}, "host_pull", {0: wrong}, 10.0),
                timeout=TIMEOUT_S * 6)
    assert time.monotonic() - start < 90  # the join's 10 s, the receivers' own 10 s, a loaded machine
    out = ray.get(nodes["sender_b"].sync.remote(4, (1, 0), {0: [(0, 0)]}, "host_pull",
                                                {0: ActorEndpoint(nodes["receiver_a"])}), timeout=TIMEOUT_S * 6)
    assert out["verified"] and out["rendezvous"] == NODE_B_IP


def test_a_cross_node_host_pull_plan_is_refused_before_anything_is_sent(nodes: dict[str, Any]) -> None:
    """A plan built from config that puts the node-B receiver on the node-A sender's GPU would send it by host_pull;
    the receiver's place says node B: refused with the target, both nodes and the fix, and nothing reached it."""
    before = ray.get(nodes["receiver_b"].state.remote(), timeout=60)["calls"]
    with pytest.raises(RlixConfigError) as info:
        ray.get(nodes["sender_a"].sync.remote(5, (0, 0), {0: [(0, 0)]}, "host_pull",
                                              {0: ActorEndpoint(nodes["receiver_b"])}), timeout=TIMEOUT_S * 6)
    text = str(info.value)
    assert "dp rank 0 local rank 0 runs on 127.0.0.2" in text and f"the sender on {nodes['ip_a']}" in text
    assert "by host_pull" in text and "cannot cross nodes" in text and "fix the device mapping" in text
    after = ray.get(nodes["receiver_b"].state.remote(), timeout=60)["calls"]
    assert {k: v for k, v in after.items() if k != "state"} == {k: v for k, v in before.items() if k != "state"} | {
        "report_place": before.get("report_place", 0) + 1}
