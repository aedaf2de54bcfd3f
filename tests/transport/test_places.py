"""The comm plan against where the workers run (``check_comm_plan``), the rendezvous address, the bound listener.

Pure checks on places as workers report them (the Ray-cluster test, ``test_cross_node.py``, gets them from real
processes on two Ray nodes). No peers needed.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
from datetime import timedelta

import pytest
import torch.distributed as dist

from rlix_plugins.errors import RlixConfigError, TransportError
from rlix_plugins.transport import (
    GroupHost,
    Place,
    build_comm_plan,
    check_comm_plan,
    local_place,
    rendezvous_address,
    setup_collective_group,
)

A = Place(node_id="a" * 56, node_ip="10.0.0.1", machine="boot-a", hostname="host-a", device="cuda:0", gpu="GPU-a0")
A1 = Place(node_id="a" * 56, node_ip="10.0.0.1", machine="boot-a", hostname="host-a", device="cuda:1", gpu="GPU-a1")
B = Place(node_id="b" * 56, node_ip="10.0.0.2", machine="boot-b", hostname="host-b", device="cuda:0", gpu="GPU-b0")


def test_a_plan_that_matches_the_places_passes() -> None:
    plan = build_comm_plan((0, 0), {0: [(0, 0)], 1: [(0, 1)], 2: [(1, 0)]}, "host_pull")
    check_comm_plan(plan, A, {0: [A], 1: [A1], 2: [B]})


@pytest.mark.parametrize("transport", ["host_pull", "cuda_ipc"])
def test_a_cross_node_same_gpu_transport_is_refused_naming_target_nodes_and_fix(transport: str) -> None:
    plan = build_comm_plan((0, 0), {3: [(0, 0)]}, transport)  # config: dp 3 on the sender's GPU
    with pytest.raises(RlixConfigError) as info:
        check_comm_plan(plan, A, {3: [B]})  # reality: another node
    text = str(info.value)
    assert "dp rank 3 local rank 0" in text and f"by {transport}" in text and "cannot cross nodes" in text
    assert "10.0.0.2" in text and "10.0.0.1" in text and "fix the device mapping" in text


def test_a_same_gpu_transport_to_another_gpu_of_the_node_is_refused() -> None:
    plan = build_comm_plan((0, 0), {0: [(0, 0)]}, "host_pull")
    with pytest.raises(RlixConfigError, match=r"not on the sender's GPU .* by host_pull"):
        check_comm_plan(plan, A, {0: [A1]})


def test_a_broadcast_to_the_senders_own_gpu_is_refused() -> None:
    plan = build_comm_plan((0, 0), {0: [(0, 1)]}, "host_pull")
    with pytest.raises(RlixConfigError, match=r"runs on the sender's own GPU .* broadcasts to it"):
        check_comm_plan(plan, A, {0: [A]})


def test_node_numbers_that_disagree_with_the_nodes_are_refused() -> None:
    on_other_node = build_comm_plan((0, 0), {0: [(1, 0)]}, "host_pull")
    with pytest.raises(RlixConfigError, match=r"puts it on node 1 \(another node.*runs on 10\.0\.0\.1"):
        check_comm_plan(on_other_node, A, {0: [A1]})
    on_senders_node = build_comm_plan((0, 0), {0: [(0, 1)]}, "host_pull")
    with pytest.raises(RlixConfigError, match=r"puts it on node 0 \(the sender's node.*runs on 10\.0\.0\.2"):
        check_comm_plan(on_senders_node, A, {0: [B]})


def test_one_gpu_reported_twice_and_missing_reports_are_refused() -> None:
    plan = build_comm_plan((0, 0), {0: [(0, 1)], 1: [(0, 2)]}, "host_pull")
    with pytest.raises(RlixConfigError, match="run on one GPU"):
        check_comm_plan(plan, A, {0: [A1], 1: [A1]})
    with pytest.raises(RlixConfigError, match="dp rank 1: the plan has 1 devices, the rank reported no place"):
        check_comm_plan(plan, A, {0: [A1]})


def test_a_worker_without_a_ray_node_is_placed_by_its_machine() -> None:
    """vLLM's engine core knows no Ray node unless its Ray parent exported it: it is on the sender's node when it is
    on the sender's machine, and never when it is not."""
    anonymous = Place(node_id="", node_ip="", machine="boot-a", hostname="host-a", device="cuda:0", gpu="GPU-a0")
    assert anonymous.same_node(A) and anonymous.same_gpu(A) and not anonymous.same_node(B)
    two_raylets = Place(node_id="c" * 56, node_ip="127.0.0.2", machine="boot-a", hostname="host-a", device="cpu")
    assert not two_raylets.same_node(A)  # several raylets on one machine are several nodes


def test_places_cross_the_wire_as_plain_dicts() -> None:
    here = local_place("cpu")
    assert Place.from_wire(here.to_wire()) == here and here.gpu is None and here.machine
    with pytest.raises(RlixConfigError, match="not a place report"):
        Place.from_wire({"node_id": "x"})


def test_rendezvous_needs_an_address_without_ray() -> None:
    assert rendezvous_address("10.1.2.3") == "10.1.2.3"
    # In fresh processes without Ray: this one may have the session's Ray up, and then its node IP is the answer.
    code = ("from rlix_plugins.transport._place import rendezvous_address\n"
            "try:\n    print(rendezvous_address())\nexcept Exception as e:\n    print(type(e).__name__, e)")
    env = {k: v for k, v in os.environ.items() if k != "RLIX_NODE_IP"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert re.search(r"RlixConfigError no rendezvous address .* pass master_addr=", out.stdout), out
    # handed down by a Ray parent
    out = subprocess.run([sys.executable, "-c", code], env={**env, "RLIX_NODE_IP": "127.0.0.2"}, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout.strip() == "127.0.0.2", out


def test_the_group_store_listens_on_the_rendezvous_address_only() -> None:
    """TCPStore's own server listens on every interface; the group host's listens where receivers are told to dial,
    so a receiver that dials another address (its own loopback) fails instead of meeting it by accident."""
    host = GroupHost("g_bound", "gloo", "cpu", 2.0, "127.0.0.2")
    try:
        with socket.create_connection(("127.0.0.2", host.port), timeout=2):
            pass
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", host.port), timeout=2).close()
        with pytest.raises(TransportError, match=r"could not join group 'g_bound' at 127\.0\.0\.1"):
            setup_collective_group("g_bound", "127.0.0.1", host.port, 1, 2, "gloo", 1.0)
    finally:
        host.close(clean=False)
    with pytest.raises(RlixConfigError, match=r"cannot listen on 198\.51\.100\.254"):
        GroupHost("g_elsewhere", "gloo", "cpu", 2.0, "198.51.100.254")  # TEST-NET: no address of this machine


def test_plain_tcpstore_listens_everywhere() -> None:
    """Why the bound listener is needed: a master TCPStore given 127.0.0.2 still answers on 127.0.0.1."""
    store = dist.TCPStore("127.0.0.2", 0, None, True, timeout=timedelta(seconds=2), wait_for_workers=False)
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass
    del store
