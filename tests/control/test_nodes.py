"""The node table's rules on Ray node lists (plain data: the two-raylet test with real Ray is
tests/nemo_rl/without_nemo/test_placement_nodes.py)."""

from __future__ import annotations

from typing import Any

import pytest

from rlix_plugins.control.nodes import NodeTable, PlacementMismatchError
from rlix_plugins.errors import RlixConfigError


def _entry(ip: str, node_id: str, gpus: float, alive: bool = True) -> dict[str, Any]:
    return {"NodeManagerAddress": ip, "NodeID": node_id, "Alive": alive, "Resources": {"GPU": gpus, "CPU": 8.0}}


def test_nodes_ordered_by_ip_then_id_gpu_nodes_only() -> None:
    """Numeric IP order (10.0.0.10 after 10.0.0.9, not before), then node id; a CPU-only head and a dead node are
    not GPU nodes; the order does not depend on the order Ray lists them in."""
    entries = [_entry("10.0.0.10", "cc", 2), _entry("10.0.0.1", "head", 0), _entry("10.0.0.9", "bb", 2),
               _entry("10.0.0.9", "aa", 2), _entry("10.0.0.3", "dead", 2, alive=False)]
    table = NodeTable.from_ray_nodes(entries)
    assert [(n.rank, n.ip, n.node_id) for n in table.nodes] == [(0, "10.0.0.9", "aa"), (1, "10.0.0.9", "bb"),
                                                                (2, "10.0.0.10", "cc")]
    assert NodeTable.from_ray_nodes(reversed(entries)) == table
    assert table.num_gpus == 6 and table.gpus_per_node == 2


def test_global_id_is_rank_times_gpus_per_node_plus_local() -> None:
    table = NodeTable.from_ray_nodes([_entry("127.0.0.2", "b", 2), _entry("127.0.0.1", "a", 2)])
    loc = table.locate(2)
    assert (loc.node_rank, loc.node_id, loc.node_ip, loc.local_gpu) == (1, "b", "127.0.0.2", 0)
    assert [table.global_gpu(table.locate(g).node_id, table.locate(g).local_gpu) for g in range(4)] == [0, 1, 2, 3]
    with pytest.raises(RlixConfigError, match=r"GPU 4 is not in the pool: 2 node\(s\) x 2 GPUs = ids 0..3"):
        table.locate(4)


def test_uneven_nodes_and_no_gpu_node_are_refused_with_the_fix() -> None:
    with pytest.raises(RlixConfigError, match=r"not uniform.*same --num-gpus"):
        NodeTable.from_ray_nodes([_entry("10.0.0.1", "a", 2), _entry("10.0.0.2", "b", 4)])
    with pytest.raises(RlixConfigError, match=r"no GPU node.*--num-gpus"):
        NodeTable.from_ray_nodes([_entry("10.0.0.1", "a", 0)])


def test_a_worker_elsewhere_than_the_table_says_is_a_clear_error() -> None:
    table = NodeTable.from_ray_nodes([_entry("127.0.0.1", "a", 2), _entry("127.0.0.2", "b", 2)])
    table.check_location(2, "b", "127.0.0.2", [0])
    with pytest.raises(PlacementMismatchError, match=r"GPU 2 should be node 1 = 127.0.0.2.*local GPU 0.*reports "
                                                     r"node 127.0.0.1"):
        table.check_location(2, "a", "127.0.0.1", [0])  # the old bug: local GPU 0 of the wrong node
    with pytest.raises(PlacementMismatchError, match=r"local GPUs \[1\]"):
        table.check_location(2, "b", "127.0.0.2", [1])
    with pytest.raises(PlacementMismatchError, match=r"not a GPU node of the table.*rlix up"):
        table.node("zz")
