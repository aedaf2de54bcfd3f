"""The NeMo RL :class:`~rlix_plugins.pipeline.protocols.WeightSource`: the CPU bucket cache inside the Megatron
policy workers, reached with ``__ray_call__`` (:mod:`.worker_ops`; no worker subclass, no patch).

``build_cache(v)`` runs :func:`worker_ops.megatron_build_cache` on EVERY training worker at once (lockstep: the
HF export gathers across TP/PP/EP), the owner (global rank 0) keeps the buckets. ``sync(targets)`` runs
:func:`worker_ops.megatron_sync_from_cache` on the owner with the engines' ``RayEngineRpc`` handles.
Picklable (actor handles + plain values); the runtime ships it to its resize actor.
"""

from __future__ import annotations

from typing import Any

from rlix_plugins.control._rpc import ray_get
from rlix_plugins.errors import RlixError
from rlix_plugins.nemo_rl import worker_ops
from rlix_plugins.pipeline.protocols import SyncResult

__all__ = ["MegatronWeightSource"]


class MegatronWeightSource:
    def __init__(self, workers: list[Any], sender: tuple[int, int], bucket_size_bytes: int) -> None:
        if not workers:
            raise RlixError("MegatronWeightSource needs the policy's training workers (policy.worker_group.workers)")
        self.workers = list(workers)
        self.owner = self.workers[0]  # global rank 0 = pp0/dp0/tp0/cp0
        self.sender = tuple(sender)
        self.bucket_size_bytes = int(bucket_size_bytes)

    @classmethod
    def from_policy(cls, policy: Any, train_devices: list[int], bucket_size_bytes: int,
                    gpus_per_node: int | None = None) -> MegatronWeightSource:
        per_node = gpus_per_node or max(train_devices) + 1
        first = train_devices[0]
        return cls(list(policy.worker_group.workers), (first // per_node, first % per_node), bucket_size_bytes)

    def _get(self, refs: Any, what: str, timeout_s: float) -> Any:
        return ray_get(refs, what, timeout_s, dead="a training worker died")


    def build_cache(self, version: int, timeout_s: float) -> int:
        refs = [w.__ray_call__.remote(worker_ops.megatron_build_cache, version, self.bucket_size_bytes, timeout_s)
                for w in self.workers]
        results = self._get(refs, f"build_cache({version}) on {len(refs)} training workers", timeout_s)
        owned = [r for r in results if r is not None]
        if len(owned) != 1:
            raise RlixError(f"build_cache({version}): {len(owned)} workers own the cache (expected exactly 1)")
        return int(owned[0])

    def mark_offloaded(self, offloaded: bool, timeout_s: float = 60.0) -> None:
        self._get([w.__ray_call__.remote(worker_ops.megatron_mark_offloaded, offloaded) for w in self.workers],
                  "mark_offloaded", timeout_s)

    def sync(self, targets: dict[int, tuple[Any, list[tuple[int, int]]]], timeout_s: float, verify: bool) -> SyncResult:
        result = self._get(
            self.owner.__ray_call__.remote(worker_ops.megatron_sync_from_cache, targets, self.sender, timeout_s, verify),
            f"weight sync to dp ranks {sorted(targets)}", timeout_s * 4 + 60.0)
        return result
