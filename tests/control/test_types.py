"""Control-plane records: the DP rank -> GPU mapping of a cluster spec."""

from __future__ import annotations

from rlix_plugins.control.types import ClusterSpec


def test_gpus_of_maps_dp_ranks_to_their_bundles() -> None:
    """``gpus_of`` is the union of the ranks' bundles, for tp 1 and tp > 1 (the one rank→GPU helper)."""
    tp1 = ClusterSpec("p_actor_infer", "p", "actor_infer", (2, 3, 5, 7), 1)
    assert tp1.gpus_of([0, 3]) == frozenset({2, 7})
    assert tp1.gpus_of([]) == frozenset()
    tp2 = ClusterSpec("p_actor_infer", "p", "actor_infer", (0, 1, 4, 5, 6, 7), 2)
    assert tp2.gpus_of({1, 2}) == frozenset({4, 5, 6, 7})
    assert tp2.gpus_of(iter([0])) == frozenset(tp2.bundle(0)) == frozenset({0, 1})
    assert tp2.gpus_of(range(tp2.num_dp_ranks)) == frozenset(tp2.device_mapping)
