"""Regression tests named after the failures they guard, for the NeMo RL host pieces that need no cluster. The
cluster-level ones live in ``test_nemo_host_cpu.py`` (stale routing copy, first expand loads real weights,
N vs N+1, version -1, abort unblocks callers) and in
``tests/nemo_rl/inside_nemo`` (retry after a shrink, pickled copy on the real VllmGeneration)."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

from rlix_plugins.nemo_rl import worker_ops
from rlix_plugins.nemo_rl.generation import RouterFleetMonitor, install_routing


class _MegatronWorker:
    """Plain object with the Megatron worker members worker_ops uses (worker_ops runs on the worker instance)."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.params = {"w": torch.arange(8, dtype=torch.float32), "b": torch.ones(3)}
        self.iterated = 0

    def _iter_params_with_optional_kv_scales(self) -> Any:
        for item in self.params.items():
            self.iterated += 1
            yield item


def test_cache_built_after_offload_is_refused() -> None:
    """A cache built after ``offload_after_refit`` read zero-storage params and crashed later."""
    owner = _MegatronWorker(0)
    assert worker_ops.build_cache(owner, "megatron", 1, 1 << 20, 30.0) == 1
    worker_ops.mark_offloaded(owner, True)
    with pytest.raises(RuntimeError, match="before_weight_sync"):
        worker_ops.build_cache(owner, "megatron", 2, 1 << 20, 30.0)
    assert worker_ops.build_cache(owner, "megatron", -1, 1 << 20, 30.0) == -1  # the bootstrap runs pre-offload only


def test_all_ranks_iterate_only_the_owner_keeps() -> None:
    """Every training rank iterates the refit iterator (collectives inside); only rank 0 keeps buckets."""
    owner, peer = _MegatronWorker(0), _MegatronWorker(1)
    assert worker_ops.build_cache(owner, "megatron", 3, 1 << 20, 30.0) == 3
    assert worker_ops.build_cache(peer, "megatron", 3, 1 << 20, 30.0) is None
    assert owner.iterated == peer.iterated == 2


def test_del_of_a_stray_generation_copy_never_runs_on_the_driver() -> None:
    """VllmGeneration.__del__ shuts the shared workers down: the driver's routed object is kept referenced."""
    deleted: list[int] = []

    class Generation:
        def __init__(self) -> None:
            self.worker_group = type("WG", (), {"dp_size": 2})()

        def attach_fleet_health(self, monitor: Any, selector: Any) -> None:
            assert monitor.shard_count == 2
            self.fleet_monitor, self.fleet_selector = monitor, selector

        def __del__(self) -> None:
            deleted.append(1)

    class Client:  # a RouterClient needs a router actor; install_routing only stores it
        num_dp_ranks = 2

    gen = Generation()
    install_routing(gen, Client())  # type: ignore[arg-type]
    del gen
    gc.collect()
    assert deleted == []


def test_monitor_counts_failures_but_never_quarantines() -> None:
    """Eligibility is the router's alone (scheduler shrinks), not NeMo RL's failure quarantine."""
    m = RouterFleetMonitor(2)
    m.report_failure(1, RuntimeError("x"))
    assert m.failures == {1: 1} and m.serving_shards() == [0, 1]
