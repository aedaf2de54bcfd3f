"""Tear down and rebuild Megatron's communication groups INSIDE a training worker.

Released GPUs are only a bookkeeping state: a long-lived Megatron worker keeps its NCCL communicators (and their
device buffers) until it destroys them, and the next tenant's vLLM wake-up then runs out of memory. So after
each step's offload every training worker runs :func:`destroy_groups` (through ``__ray_call__``, in the worker
process where ``megatron.core.parallel_state`` lives - never in the driver), and before the next step's first
use :func:`rebuild_groups` re-runs ``initialize_model_parallel`` with the sizes recorded at destroy time.

* Destroy: every DISTINCT process group held by a ``parallel_state`` global whose backend is in ``backends``
  (default: NCCL only; Gloo groups are CPU-only and stay) is destroyed once, then ``destroy_model_parallel``
  resets the globals. Idempotent; a no-op when model parallel is not initialized.
* Rebuild: ``initialize_model_parallel(**snapshot.sizes)`` with the recorded sizes and whether Megatron's own gloo
  groups existed (NeMo RL's ``megatron_cfg.use_gloo_process_groups``, off in its recipes: Megatron's default, on,
  would add groups the first layout never had and the old-to-new matching below would fail). Lockstep: every rank of the
  default process group must call each of these together (group creation is collective).
* Refresh (:func:`refresh_group_handles`): ``parallel_state`` is not the only holder of the groups. Megatron
  modules keep ``pg_collection`` (a ``ProcessGroupCollection``, what NeMo RL's worker reads with
  ``get_pg_collection(self.model)``) and ``tp_group`` / ``cp_group`` attributes, the model config keeps
  Megatron-Bridge's ``partial(finalize_model_grads, pg_collection=...)``, the DDP buffers and the distributed
  optimizer keep their data-parallel groups. After the rebuild every reference to an old group reachable from the
  worker object (and from ``megatron.*`` module globals) is replaced by the new group of the same
  ``parallel_state`` global (old and new matched by global name and list position), in place: dicts, lists,
  instance ``__dict__``/slots, tuples (rebuilt), ``functools.partial`` arguments and closure cells.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = ["NcclSnapshot", "destroy_groups", "rebuild_groups", "refresh_group_handles"]

logger = logging.getLogger(__name__)

_SIZE_GETTERS = {
    "tensor_model_parallel_size": "get_tensor_model_parallel_world_size",
    "pipeline_model_parallel_size": "get_pipeline_model_parallel_world_size",
    "context_parallel_size": "get_context_parallel_world_size",
    "expert_model_parallel_size": "get_expert_model_parallel_world_size",
    "expert_tensor_parallel_size": "get_expert_tensor_parallel_world_size",
}
#: Bound of one refresh walk (objects visited); a worker's model, optimizer and config are far below it.
MAX_WALK: Final = 5_000_000
_LEAVES: Final = (str, bytes, bytearray, int, float, complex, bool, type(None), type, types.ModuleType,
                  types.BuiltinFunctionType, range, memoryview)


@dataclass
class NcclSnapshot:
    initialized_before: bool
    #: ``initialize_model_parallel``'s arguments that reproduce the layout (sizes, and the gloo switch)
    sizes: dict[str, int | bool] = field(default_factory=dict)
    groups_destroyed: int = 0
    backends_destroyed: list[str] = field(default_factory=list)
    #: every ``parallel_state`` global that held groups, with its value before the destroy (kept alive until the
    #: rebuild so the old groups' identities stay unique while references to them are replaced)
    globals_before: dict[str, Any] = field(default_factory=dict)


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:
        return "unknown"


def _groups_of(value: Any) -> list[Any]:
    import torch.distributed as dist

    items = value if isinstance(value, list | tuple) else [value]
    return [g for g in items if isinstance(g, dist.ProcessGroup)]


def destroy_groups(backends: tuple[str, ...] = ("nccl",)) -> NcclSnapshot:
    """See the module docstring. Returns what was destroyed and what :func:`rebuild_groups` needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return NcclSnapshot(initialized_before=False)
    sizes = {k: int(getattr(ps, g)()) for k, g in _SIZE_GETTERS.items()}
    # Megatron creates its data-parallel gloo groups only when asked; rebuild the same way.
    sizes["create_gloo_process_groups"] = getattr(ps, "_DATA_PARALLEL_GROUP_GLOO", None) is not None
    seen: set[int] = set()
    snap = NcclSnapshot(initialized_before=True, sizes=sizes)
    world = dist.group.WORLD
    for name in sorted(vars(ps)):
        value = getattr(ps, name)
        groups = _groups_of(value)
        if groups:
            snap.globals_before[name] = list(value) if isinstance(value, list | tuple) else value
        for group in groups:
            if group is world or id(group) in seen:
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


def rebuild_groups(snapshot: NcclSnapshot, worker: Any = None) -> bool:
    """Re-create the groups :func:`destroy_groups` tore down, then point every holder reachable from ``worker`` (and
    from ``megatron.*`` module globals) at the new ones; returns False when there was nothing to rebuild."""
    from megatron.core import parallel_state as ps

    if not snapshot.initialized_before or ps.model_parallel_is_initialized():
        return False
    ps.initialize_model_parallel(**snapshot.sizes)
    mapping = _old_to_new(snapshot, ps)
    roots: list[Any] = [m.__dict__ for n, m in list(sys.modules.items())
                        if n.startswith("megatron.") and n != ps.__name__ and m is not None]
    if worker is not None:
        roots.append(worker)
    t0 = time.perf_counter()
    replaced = refresh_group_handles(mapping, roots)
    logger.info("rlix: Megatron groups rebuilt; %d references to old groups replaced in %.3f s", replaced,
                time.perf_counter() - t0)
    snapshot.globals_before.clear()
    return True


def _old_to_new(snapshot: NcclSnapshot, ps: Any) -> dict[int, Any]:
    mapping: dict[int, Any] = {}
    for name, old in snapshot.globals_before.items():
        new = getattr(ps, name, None)
        olds, news = _groups_of(old), _groups_of(new)
        if len(olds) != len(news):
            raise RuntimeError(f"parallel_state.{name} held {len(olds)} groups before the rebuild and {len(news)} "
                               "after: the rebuild did not reproduce the layout (same sizes expected)")
        for o, n in zip(olds, news, strict=True):
            if o is not n:
                mapping[id(o)] = n
    return mapping


def refresh_group_handles(mapping: dict[int, Any], roots: Iterable[Any], max_objects: int = MAX_WALK) -> int:
    """Replace, in place, every reference to a group whose ``id`` is in ``mapping`` by its new group, in the object
    graph reachable from ``roots`` (see the module docstring for what is walked; tensors, classes, modules and
    function globals are not). Returns the number of references replaced."""
    import torch
    import torch.distributed as dist

    if not mapping:
        return 0
    leaves = (*_LEAVES, torch.Tensor, dist.ProcessGroup)

    def swap(value: Any) -> tuple[Any, bool]:
        new = mapping.get(id(value))
        if new is not None:
            return new, True
        if isinstance(value, tuple) and value:
            items = [swap(v) for v in value]
            if any(changed for _, changed in items):
                vals = [v for v, _ in items]
                return (type(value)(*vals) if hasattr(value, "_fields") else type(value)(vals)), True
        return value, False

    replaced, seen, stack = 0, set(), list(roots)
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, leaves):
            continue
        seen.add(id(obj))
        if len(seen) > max_objects:
            raise RuntimeError(f"refreshing Megatron group handles visited more than {max_objects} objects; "
                               "pass a narrower root")
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                new, changed = swap(v)
                if changed:
                    obj[k], replaced = new, replaced + 1
                else:
                    stack.append(v)
        elif isinstance(obj, list):
            for i, v in enumerate(obj):
                new, changed = swap(v)
                if changed:
                    obj[i], replaced = new, replaced + 1
                else:
                    stack.append(v)
        elif isinstance(obj, tuple | set | frozenset):
            stack.extend(obj)  # a tuple holding a group directly is rebuilt by its holder (swap)
        elif isinstance(obj, functools.partial):
            args = [swap(a) for a in obj.args]
            if any(changed for _, changed in args):
                obj.__setstate__((obj.func, tuple(a for a, _ in args), obj.keywords, obj.__dict__ or None))  # type: ignore[attr-defined]
                replaced += sum(changed for _, changed in args)
            stack.extend([obj.func, obj.keywords, *obj.args])
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    v = cell.cell_contents
                except ValueError:  # an empty cell
                    continue
                new, changed = swap(v)
                if changed:
                    cell.cell_contents, replaced = new, replaced + 1
                else:
                    stack.append(v)
            stack.extend(obj.__defaults__ or ())
        elif isinstance(obj, types.MethodType):
            stack.extend([obj.__self__, obj.__func__])
        else:
            replaced += _refresh_attributes(obj, swap, stack)
    return replaced


def _refresh_attributes(obj: Any, swap: Any, stack: list[Any]) -> int:
    """An instance: its ``__dict__`` (walked as a dict) and its slots."""
    replaced = 0
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        stack.append(d)
    for cls in type(obj).__mro__:
        for slot in cls.__dict__.get("__slots__", ()):
            if slot in ("__dict__", "__weakref__"):
                continue
            try:
                v = object.__getattribute__(obj, slot)
            except AttributeError:
                continue
            new, changed = swap(v)
            if changed:
                object.__setattr__(obj, slot, new)
                replaced += 1
            else:
                stack.append(v)
    return replaced
