"""The NeMo RL :class:`~rlix_plugins.pipeline.protocols.WeightSource`: the CPU bucket cache inside the policy's
training workers (Megatron or DTensor/FSDP2), reached with ``__ray_call__`` (:mod:`.worker_ops`; no worker
subclass, no patch).

``build_cache(v)`` runs :func:`worker_ops.build_cache` on EVERY training worker at once (lockstep: the refit
iterator gathers across the trainer's ranks), the owner (global rank 0) keeps the buckets. ``sync(targets)`` runs
:func:`worker_ops.sync_from_cache` on the owner with the engines' ``RayEngineRpc`` handles. Picklable (actor
handles + plain values); the runtime ships it to its resize actor.

Communication groups while the training GPUs are released (:meth:`PolicyWeightSource.release_comm_groups`):

* Megatron: every worker destroys its NCCL groups after the offload and rebuilds them before the next use
  (:mod:`.megatron_nccl`): ``initialize_model_parallel`` re-creates them in place.
* DTensor: the FSDP2 process groups stay. ``fully_shard`` keeps the DeviceMesh's groups in every parameter group
  and every parameter/optimizer-state DTensor refers to the mesh, so new groups would mean re-sharding the model
  and optimizer (rebuilding the policy), not a rebuild in place. NeMo RL itself keeps them next to a colocated
  vLLM; the cost is the communicators' device buffers on the released GPUs.
"""

from __future__ import annotations

from typing import Any, Final

from rlix_plugins.control.rpc import ray_get
from rlix_plugins.errors import RlixError
from rlix_plugins.nemo_rl import worker_ops
from rlix_plugins.nemo_rl.config import Trainer, policy_trainer
from rlix_plugins.pipeline.protocols import SyncResult

__all__ = ["PolicyWeightSource"]

_TRAINERS: Final = ("megatron", "dtensor")


class PolicyWeightSource:
    def __init__(self, workers: list[Any], sender: tuple[int, int], bucket_size_bytes: int,
                 trainer: Trainer) -> None:
        if not workers:
            raise RlixError("PolicyWeightSource needs the policy's training workers (policy.worker_group.workers)")
        if trainer not in _TRAINERS:
            raise RlixError(f"unknown trainer {trainer!r}; valid: {list(_TRAINERS)}")
        self.workers = list(workers)
        self.owner = self.workers[0]  # global rank 0
        self.sender = tuple(sender)
        self.bucket_size_bytes = int(bucket_size_bytes)
        self.trainer: Trainer = trainer

    @classmethod
    def from_policy(cls, policy: Any, master_config: Any, train_devices: list[int], bucket_size_bytes: int,
                    gpus_per_node: int | None = None) -> PolicyWeightSource:
        """The source over ``policy``'s workers, for the backend ``master_config`` enables (:func:`policy_trainer`)."""
        per_node = gpus_per_node or max(train_devices) + 1
        first = train_devices[0]
        return cls(list(policy.worker_group.workers), (first // per_node, first % per_node), bucket_size_bytes,
                   policy_trainer(master_config))

    def _get(self, refs: Any, what: str, timeout_s: float) -> Any:
        return ray_get(refs, what, timeout_s, dead="a training worker died")

    def _on_every_worker(self, fn: Any, what: str, timeout_s: float, *args: Any) -> list[Any]:
        return list(self._get([w.__ray_call__.remote(fn, *args) for w in self.workers], what, timeout_s))

    def build_cache(self, version: int, timeout_s: float) -> int:
        results = self._on_every_worker(worker_ops.build_cache, f"build_cache({version}) on {len(self.workers)} "
                                        f"{self.trainer} training workers", timeout_s,
                                        self.trainer, version, self.bucket_size_bytes, timeout_s)
        owned = [r for r in results if r is not None]
        if len(owned) != 1:
            raise RlixError(f"build_cache({version}): {len(owned)} workers own the cache (expected exactly 1)")
        return int(owned[0])

    def mark_offloaded(self, offloaded: bool, timeout_s: float = 60.0) -> None:
        self._on_every_worker(worker_ops.mark_offloaded, "mark_offloaded", timeout_s, offloaded)

    def offload_to_arena(self, timeout_s: float) -> list[dict[str, Any]] | None:
        """Every DTensor worker moves its weights and optimizer states into its page-locked arena
        (:func:`worker_ops.offload_to_arena`); returns what each moved, or None where any worker could not (then
        NeMo RL's offload must run: it moves what is still on the device and leaves what is in an arena, already
        host memory, where it is)."""
        if self.trainer != "dtensor":
            return None
        done = self._on_every_worker(worker_ops.offload_to_arena, "offload the trainer's states into the arena",
                                     timeout_s)
        return None if any(d is None for d in done) else done

    def release_cached_blocks(self, timeout_s: float) -> None:
        """Every worker hands its allocator's free blocks back to the driver: what a step leaves cached (its
        activations) goes to the GPU's other tenants while the weights and optimizer states stay
        (``rlix.offload_trainer: false``)."""
        self._on_every_worker(worker_ops.release_cached_blocks, "release the trainer's cached blocks", timeout_s)

    def release_comm_groups(self, timeout_s: float) -> None:
        """After the offload: free the trainer's communication groups where they can come back (module docstring)."""
        if self.trainer == "megatron":
            self._on_every_worker(worker_ops.megatron_destroy_nccl, "destroy Megatron NCCL groups", timeout_s)

    def restore_comm_groups(self, timeout_s: float) -> None:
        """Before the training workers use the GPUs again: undo :meth:`release_comm_groups`."""
        if self.trainer == "megatron":
            self._on_every_worker(worker_ops.megatron_rebuild_nccl, "rebuild Megatron NCCL groups", timeout_s)

    def sync(self, targets: dict[int, tuple[Any, list[tuple[int, int]]]], timeout_s: float, verify: bool,
             wake_tags: list[str] | None = None) -> SyncResult:
        result = self._get(
            self.owner.__ray_call__.remote(worker_ops.sync_from_cache, targets, self.sender, timeout_s, verify,
                                           None, wake_tags),
            f"weight sync to dp ranks {sorted(targets)}", timeout_s * 4 + 60.0)
        return result
