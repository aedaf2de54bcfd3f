"""Tear down and rebuild Megatron's communication groups INSIDE a training worker (reference F1/F11, gap list).

Released GPUs are only a bookkeeping state: a long-lived Megatron worker keeps its NCCL communicators (and their
device buffers) until it destroys them, and the next tenant's vLLM wake-up then runs out of memory. So after
each step's offload every training worker runs :func:`destroy_groups` (through ``__ray_call__``, in the worker
process where ``megatron.core.parallel_state`` lives - never in the driver), and before the next step's first
use :func:`rebuild_groups` re-runs ``initialize_model_parallel`` with the sizes recorded at destroy time.

* Destroy: every DISTINCT process group held by a ``parallel_state`` global whose backend is in ``backends``
  (default: NCCL only; Gloo groups are CPU-only and stay) is destroyed once, then ``destroy_model_parallel``
  resets the globals. Idempotent; a no-op when model parallel is not initialized.
* Rebuild: ``initialize_model_parallel(**snapshot)`` with the recorded sizes. Lockstep: every rank of the
  default process group must call each of these together (group creation is collective).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["NcclSnapshot", "destroy_groups", "rebuild_groups"]

_SIZE_GETTERS = {
    "tensor_model_parallel_size": "get_tensor_model_parallel_world_size",
    "pipeline_model_parallel_size": "get_pipeline_model_parallel_world_size",
    "context_parallel_size": "get_context_parallel_world_size",
    "expert_model_parallel_size": "get_expert_model_parallel_world_size",
}


@dataclass
class NcclSnapshot:
    initialized_before: bool
    sizes: dict[str, int] = field(default_factory=dict)
    groups_destroyed: int = 0
    backends_destroyed: list[str] = field(default_factory=list)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:
        return "unknown"


def destroy_groups(backends: tuple[str, ...] = ("nccl",)) -> NcclSnapshot:
    """See the module docstring. Returns what was destroyed and what :func:`rebuild_groups` needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return NcclSnapshot(initialized_before=False)
    sizes = {k: int(getattr(ps, g)()) for k, g in _SIZE_GETTERS.items()}
    seen: set[int] = set()
    snap = NcclSnapshot(initialized_before=True, sizes=sizes)
    world = dist.group.WORLD
    for name in sorted(vars(ps)):
        value = getattr(ps, name)
        groups = value if isinstance(value, list | tuple) else [value]
        for group in groups:
            if not isinstance(group, dist.ProcessGroup) or group is world or id(group) in seen:
                continue
            seen.add(id(group))
            backend = _backend(group)
            if backend not in backends:
                continue
            dist.destroy_process_group(group)
            snap.groups_destroyed += 1
            snap.backends_destroyed.append(backend)
    ps.destroy_model_parallel()
    return snap


def rebuild_groups(snapshot: NcclSnapshot) -> bool:
    """Re-create the groups :func:`destroy_groups` tore down; returns False when there was nothing to rebuild."""
    from megatron.core import parallel_state as ps

    if not snapshot.initialized_before or ps.model_parallel_is_initialized():
        return False
    ps.initialize_model_parallel(**snapshot.sizes)
    return True
