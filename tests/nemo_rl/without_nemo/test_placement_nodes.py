"""Shared placement on two Ray nodes: real raylets (``ray.cluster_utils.Cluster``), 2 declared GPUs each, the
second at another loopback address (127.0.0.2), so a group or worker on the wrong node shows a wrong address
instead of passing by accident. One cluster for the module (starting raylets is slow on small machines).

The second raylet is started on GPUs 2,3 of its machine (``CUDA_VISIBLE_DEVICES=2,3``, as a second job's raylet
on one host is), so Ray names its GPUs 2 and 3 while the node table numbers them 0 and 1 on that node.

What it proves: the control plane's node table numbers GPUs node rank x 2 + local id; every per-GPU placement
group lands on the node the table says (Ray's placement group table and the worker's own report); both nodes'
workers report local GPU 0 (so a pool keyed by the local id, the old bug, collides and never finds GPUs 2-3),
the second node's although Ray calls that GPU 2 (a probe that took Ray's id as the index refused the node);
a table that disagrees with where workers run is a clear error that leaves no group behind; nothing leaks."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray.util.placement_group import placement_group_table
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlix_plugins.control.nodes import NodeTable, PlacementMismatchError, current_node_table
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.placement import _probe_location, placement_pool
from tests.harness import cross_node

pytestmark = pytest.mark.own_cluster
SECOND_IP = cross_node.NODE_B_IP


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[Any]:
    """Head (this machine's node IP) + a raylet at 127.0.0.2, 2 GPUs and 8 logical CPUs each; the session's own
    Ray cluster, if one runs, is stopped for the module and started again after it."""
    with cross_node.two_nodes(num_cpus=8, num_gpus=2, node_b_env={"CUDA_VISIBLE_DEVICES": "2,3"},
                              log_to_driver=False) as cluster:
        yield cluster


@ray.remote(num_cpus=0)
class _Worker:
    def where(self) -> tuple[str, str, list[int]]:
        return _probe_location()  # what the pool's probe reports, from inside a worker of the group

    def ray_gpu_ids(self) -> list[str]:
        return [str(g) for g in ray.get_gpu_ids()]


def _in_group(pg: Any) -> Any:
    return _Worker.options(num_gpus=0.25, scheduling_strategy=PlacementGroupSchedulingStrategy(
        placement_group=pg, placement_group_bundle_index=0)).remote()


def test_control_plane_numbers_gpus_by_node(two_nodes: Any) -> None:
    """The orchestrator's table (the one owner) equals the one built from Ray's node list: 2 nodes x 2 GPUs,
    ordered by IP, the second raylet at 127.0.0.2; global GPU 2 is (node 1, local GPU 0)."""
    from rlix_plugins.control import client
    from tests.control._ray_helpers import kill_control_plane

    table = current_node_table()
    assert (len(table.nodes), table.gpus_per_node, table.num_gpus) == (2, 2, 4)
    assert SECOND_IP in {n.ip for n in table.nodes}
    assert len({n.ip for n in table.nodes}) == 2  # the head is not at 127.0.0.2: the addresses tell nodes apart
    loc = table.locate(2)
    assert (loc.node_rank, loc.local_gpu, loc.node_id) == (1, 0, table.nodes[1].node_id)
    try:
        cp = client.connect()
        assert cp.node_table() == table
        assert cp.pool() == {"num_gpus": 4, "gpus_per_node": 2}
        # `rlix status`, as a user runs it against the cluster: which machine each GPU id is on
        out = subprocess.run([sys.executable, "-m", "rlix_plugins.cli", "status", "--address", two_nodes.address],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        want = "; ".join(f"{n.rank} = {n.ip} GPUs {2 * n.rank}..{2 * n.rank + 1}" for n in table.nodes)
        assert f"nodes: {want}" in out.stdout, out.stdout
    finally:
        kill_control_plane()


def test_every_group_lands_on_its_node_and_nothing_leaks(two_nodes: Any) -> None:
    table = current_node_table()
    pool = placement_pool()
    try:
        groups = ray.get(pool.groups.remote([0, 1, 2, 3], table), timeout=180)
        assert len({pg.id for pg in groups.values()}) == 4
        for g, pg in groups.items():  # Ray's own record of where the bundle is
            assert placement_group_table(pg)["bundles_to_node_id"][0] == table.locate(g).node_id
        workers = {g: _in_group(pg) for g, pg in groups.items()}
        where = dict(zip(workers, ray.get([w.where.remote() for w in workers.values()], timeout=120), strict=True))
        for g, (node_id, ip, local) in where.items():  # the worker's own report
            table.check_location(g, node_id, ip, local)
        assert where[2][1:] == (table.nodes[1].ip, [0])
        # Both nodes report local GPU 0: keyed by the local id alone, GPUs 0 and 2 would be one entry.
        assert where[0][2] == where[2][2] == [0] and where[0][0] != where[2][0]
        # Ray names the second raylet's GPUs by its CUDA_VISIBLE_DEVICES; the table's local ids are 0, 1.
        second = next(n.rank for n in table.nodes if n.ip == SECOND_IP)
        on_second = [2 * second, 2 * second + 1]
        assert ray.get([workers[g].ray_gpu_ids.remote() for g in on_second], timeout=60) == [["2"], ["3"]]
        assert [where[g][2] for g in on_second] == [[0], [1]]

        again = ray.get(placement_pool().groups.remote([3, 2], table), timeout=60)  # another driver: same groups
        assert {g: pg.id for g, pg in again.items()} == {g: groups[g].id for g in (3, 2)}
        assert len(ray.get(pool.locations.remote(), timeout=30)) == 4  # no extra group was created
        with pytest.raises(RlixConfigError, match="GPU 4 is not in the pool"):
            ray.get(pool.groups.remote([4], table), timeout=30)
        for w in workers.values():
            ray.kill(w)
    finally:
        assert ray.get(pool.release_all.remote(), timeout=60) == 4
        ray.kill(pool)
    assert {e["state"] for e in placement_group_table().values()} == {"REMOVED"}


def test_a_table_that_disagrees_with_the_workers_fails_clearly_and_leaves_nothing(two_nodes: Any) -> None:
    """Node ids paired with the other node's address: the group lands where its label pins it, the probe reports
    the real address, and the pool refuses (no group kept, none left in Ray)."""
    real = current_node_table()
    a, b = real.nodes
    wrong = NodeTable((dataclasses.replace(a, ip=b.ip), dataclasses.replace(b, ip=a.ip)), real.gpus_per_node)
    pool = placement_pool()
    try:
        with pytest.raises(PlacementMismatchError, match=r"GPU 0 should be node 0.*worker reports node"):
            ray.get(pool.groups.remote([0], wrong), timeout=180)
        assert ray.get(pool.locations.remote(), timeout=30) == {}
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)
    assert {e["state"] for e in placement_group_table().values()} <= {"REMOVED"}
