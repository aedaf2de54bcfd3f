"""Tear down and rebuild Megatron's communication groups INSIDE a training worker.

Released GPUs are only a bookkeeping state: a long-lived Megatron worker keeps its NCCL communicators (and their
device buffers) until it destroys them, and the next tenant's vLLM wake-up then runs out of memory. So after
each step's offload every training worker runs :func:`destroy_groups` (through ``__ray_call__``, in the worker
process where ``megatron.core.parallel_state`` lives - never in the driver), and before the next step's first
use :func:`rebuild_groups` replays the ``initialize_model_parallel`` call that built the layout.

* Record (:func:`record_initialize_calls`): wraps the module attribute ``parallel_state.initialize_model_parallel``
  (Megatron-Bridge's ``_initialize_distributed`` calls it through that attribute), so each call that returns keeps
  its positional and keyword arguments as given: sizes, virtual pipeline size, ``order`` (``tp-cp-ep-pp-dp`` with
  ``use_tp_pp_dp_mapping``), optimizer instances, hierarchical CP sizes, timeout, embedding-rank callbacks, NCCL
  options, the gloo switch - whatever the installed megatron-core takes. It must run in the worker before
  Megatron's setup, and our code reaches NeMo RL's Megatron workers only through ``__ray_call__`` after their
  construction, so it is installed by Ray's worker-process setup hook (:func:`worker_process_setup_hook`), which
  runs in the worker process at its start, before Ray loads the actor class and runs its constructor.
* Why that hook, and how it gets there: NeMo RL builds each Megatron policy worker's ``runtime_env`` itself
  (``RayWorkerGroup._create_workers_from_bundle_indices``: only ``env_vars`` and ``py_executable``), and the only
  part of it a config reaches is ``env_vars``: ``Policy`` passes ``policy.megatron_cfg.env_vars`` to its worker
  group, which adds the driver's environment for every other key. Ray's ``worker_process_setup_hook`` is itself
  carried by one environment variable (``ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR``: ``ray.init`` turns the
  ``runtime_env`` field into it, and ``default_worker.py`` imports and calls the ``module.function`` it names at
  start), so :func:`.placement.nemo_rl_placement` - the ``rlix_placement`` hook, which runs only when
  ``RLIX_CONTROL_PLANE=rlix`` and before ``setup()`` creates the ``Policy`` - writes it into
  ``policy.megatron_cfg.env_vars`` (:func:`megatron_worker_env`). No patch line is needed; standalone NeMo RL
  never calls our placement, so nothing of ours is set or imported there. Not the alternatives: a worker
  extension class (``Policy(worker_extension_cls_fqn=...)``) needs its own ``ACTOR_ENVIRONMENT_REGISTRY`` entry,
  and NeMo RL builds one uv venv per worker class name (a second Megatron venv) and it would replace the
  quantized-worker override; the ``nemo_rl.rlix_hooks`` entry point is loaded only in the driver (``setup()``,
  ``async_grpo_train``); a ``.pth`` file would load in standalone mode. A setup hook the job already had (the
  same variable inherited from the driver's environment or set in ``megatron_cfg.env_vars``) is kept and run
  first (:data:`CHAINED_SETUP_HOOK_ENV`). The variable reaches only the policy worker group (NeMo RL's
  worker initializer actors get ``HF_HOME``/``HF_MODULES_CACHE``/``PYTHONPATH`` only); a process it reaches
  without megatron-core installs nothing. The variable's name is Ray's own (read from ``ray_constants``, so a Ray
  that renames it fails at placement, loudly); ``tests/nemo_rl/without_nemo/test_megatron_setup_hook.py`` runs
  the route on a real Ray worker.
* Destroy: every DISTINCT process group held by a ``parallel_state`` global whose backend is in ``backends``
  (default: NCCL only; Gloo groups are CPU-only and stay) is destroyed once, then ``destroy_model_parallel``
  resets the globals. The snapshot keeps the recorded call (or, when none was recorded, a fall-back derived from
  ``parallel_state``: TP/PP/CP/EP/ETP sizes, the virtual pipeline size and whether Megatron's own gloo groups
  existed - logged as such; every other argument, ``order`` and the callbacks included, is then Megatron's
  default) and the ranks of every group. Idempotent; a no-op when model parallel is not initialized.
* Rebuild: the snapshot's call is replayed, then every group's ranks (and the virtual pipeline size) are compared
  with those before the destroy, and the ranks agree (one all-reduce over the default group) on whether any of
  them failed. If one did (the replay raised or built another layout), every rank undoes its replay (the groups
  it created are destroyed, ``parallel_state`` reset) and raises :class:`MegatronRebuildError`; the snapshot is
  kept, so the rebuild can be retried. Lockstep: every rank of the default process group must call destroy and
  rebuild together, retries included (group creation is collective).
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
import os
import sys
import time
import types
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from rlix_plugins import envs
from rlix_plugins.errors import RlixError

__all__ = ["CHAINED_SETUP_HOOK_ENV", "SETUP_HOOK", "InitCall", "MegatronRebuildError", "NcclSnapshot",
           "destroy_groups", "megatron_worker_env", "rebuild_groups", "record_initialize_calls",
           "recorded_initialize_call", "refresh_group_handles", "worker_process_setup_hook"]

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
_RECORDER_MARK: Final = "_rlix_records_calls"


class MegatronRebuildError(RlixError, RuntimeError):
    """Rebuilding Megatron's groups failed on this rank; what it created was undone and the snapshot kept, so
    :func:`rebuild_groups` may be called again (on every rank together)."""


@dataclass(frozen=True)
class InitCall:
    """One ``initialize_model_parallel`` call: its arguments as given (``recorded``), or the fall-back's."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    recorded: bool = True

    def describe(self, limit: int = 400) -> str:
        text = ", ".join([repr(a) for a in self.args] + [f"{k}={v!r}" for k, v in self.kwargs.items()])
        return f"initialize_model_parallel({text[:limit]}{'...' if len(text) > limit else ''})"


#: The latest call of this process that returned (the one that built the current layout).
_last_call: InitCall | None = None
_fallback_logged = False


def record_initialize_calls() -> bool:
    """Wrap ``megatron.core.parallel_state.initialize_model_parallel`` so that every call that returns is recorded
    for :func:`rebuild_groups`. Idempotent (returns False when already installed). Callers that bound the function
    before this ran (``from ... import initialize_model_parallel``) are not seen."""
    from megatron.core import parallel_state as ps

    original = ps.initialize_model_parallel
    if getattr(original, _RECORDER_MARK, False):
        return False

    @functools.wraps(original)  # keeps __wrapped__: Megatron-Bridge inspects the signature for optional arguments
    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        global _last_call
        call = InitCall(tuple(args), dict(kwargs))
        result = original(*args, **kwargs)
        _last_call = call
        return result

    setattr(initialize_model_parallel, _RECORDER_MARK, True)
    ps.initialize_model_parallel = initialize_model_parallel
    return True


#: What Ray's worker-process setup hook names (``module.function``): :func:`worker_process_setup_hook`.
SETUP_HOOK: Final = f"{__name__}.worker_process_setup_hook"
#: A setup hook the worker had before ours (Ray's variable's old value): run first by ours.
CHAINED_SETUP_HOOK_ENV: Final = envs.RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK


def _ray_setup_hook_env() -> str:
    from ray._private import ray_constants

    return str(ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR)


def megatron_worker_env(env_vars: dict[str, str] | None, inherited: dict[str, str] | None = None) -> dict[str, str]:
    """``policy.megatron_cfg.env_vars`` with Ray's setup-hook variable naming :func:`worker_process_setup_hook`
    (see the module docstring). A hook already named there or in ``inherited`` (default: this process's
    environment, which NeMo RL's worker group copies into its workers for keys the config lacks) is chained."""
    env, key = dict(env_vars or {}), _ray_setup_hook_env()
    previous = env.get(key, (os.environ if inherited is None else inherited).get(key))
    if previous and previous != SETUP_HOOK:
        env[CHAINED_SETUP_HOOK_ENV] = previous
    env[key] = SETUP_HOOK
    return env


def worker_process_setup_hook() -> None:
    """Ray runs this at the start of every worker process whose environment names it (NeMo RL's Megatron policy
    workers, in time-sharing mode): runs a chained hook, then :func:`record_initialize_calls` when
    ``RLIX_CONTROL_PLANE=rlix`` and megatron-core is importable (a process without it installs nothing)."""
    chained = envs.chained_setup_hook()
    if chained:
        from ray._private.runtime_env.setup_hook import load_and_execute_setup_hook

        error = load_and_execute_setup_hook(chained)
        if error is not None:
            raise RuntimeError(f"the worker-process setup hook rlix chains ({chained}) failed: {error}")
    if not envs.time_sharing():
        return
    try:
        import megatron.core.parallel_state  # noqa: F401
    except ImportError:
        logger.info("rlix: megatron-core is not importable in this worker; no initialize_model_parallel recorder")
        return
    record_initialize_calls()


def recorded_initialize_call() -> InitCall | None:
    """The call :func:`rebuild_groups` will replay after the next destroy; None when none was recorded."""
    return _last_call


@dataclass
class NcclSnapshot:
    initialized_before: bool
    #: the derived sizes (TP/PP/CP/EP/ETP and the gloo switch), for reports; the rebuild replays ``call``
    sizes: dict[str, int | bool] = field(default_factory=dict)
    #: what the rebuild replays: the recorded call, else the fall-back derived at destroy time
    call: InitCall | None = None
    groups_destroyed: int = 0
    backends_destroyed: list[str] = field(default_factory=list)
    #: every ``parallel_state`` global that held groups, with its value before the destroy (kept alive until the
    #: rebuild so the old groups' identities stay unique while references to them are replaced)
    globals_before: dict[str, Any] = field(default_factory=dict)
    #: the global ranks of each of those groups, checked against the rebuilt ones
    ranks_before: dict[str, list[list[int] | None]] = field(default_factory=dict)
    virtual_pipeline_size: int | None = None
    #: the replay succeeded and was checked (a failed refresh then retries only the refresh)
    replayed: bool = False
    rebuilt: bool = False


def _backend(group: Any) -> str:
    import torch.distributed as dist

    try:
        return str(dist.get_backend(group)).lower()
    except Exception:
        return "unknown"


def _ranks(group: Any) -> list[int] | None:
    import torch.distributed as dist

    try:
        return list(dist.get_process_group_ranks(group))
    except Exception:
        return None


def _groups_of(value: Any) -> list[Any]:
    import torch.distributed as dist

    items = value if isinstance(value, list | tuple) else [value]
    return [g for g in items if isinstance(g, dist.ProcessGroup)]


def _fallback_call(ps: Any, sizes: dict[str, int | bool]) -> InitCall:
    global _fallback_logged
    kwargs: dict[str, Any] = dict(sizes)
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp is not None:
        kwargs["virtual_pipeline_model_parallel_size"] = int(vpp)
    if not _fallback_logged:
        _fallback_logged = True
        logger.warning("rlix: no initialize_model_parallel call was recorded in this process (record_initialize_calls "
                       "did not run before Megatron's setup: was this worker started without rlix's setup hook, "
                       "policy.megatron_cfg.env_vars from nemo_rl_placement?); the Megatron rebuild replays sizes derived from "
                       "parallel_state instead: %s. Its order, embedding-rank callbacks, timeout and NCCL options are "
                       "Megatron's defaults; a layout they changed fails the rebuild's rank check", kwargs)
    return InitCall((), kwargs, recorded=False)


def destroy_groups(backends: tuple[str, ...] = ("nccl",)) -> NcclSnapshot:
    """See the module docstring. Returns what was destroyed and what :func:`rebuild_groups` needs."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return NcclSnapshot(initialized_before=False)
    sizes: dict[str, int | bool] = {k: int(getattr(ps, g)()) for k, g in _SIZE_GETTERS.items()}
    # Megatron creates its data-parallel gloo groups only when asked; rebuild the same way.
    sizes["create_gloo_process_groups"] = getattr(ps, "_DATA_PARALLEL_GROUP_GLOO", None) is not None
    snap = NcclSnapshot(initialized_before=True, sizes=sizes, call=_last_call or _fallback_call(ps, sizes),
                        virtual_pipeline_size=ps.get_virtual_pipeline_model_parallel_world_size())
    for name in sorted(vars(ps)):
        value = getattr(ps, name)
        groups = _groups_of(value)
        if groups:
            snap.globals_before[name] = list(value) if isinstance(value, list | tuple) else value
            snap.ranks_before[name] = [_ranks(g) for g in groups]  # all before any destroy: globals share groups
    seen: set[int] = set()
    world = dist.group.WORLD
    for value in snap.globals_before.values():
        for group in _groups_of(value):
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
    from ``megatron.*`` module globals) at the new ones; returns False when there was nothing to rebuild. Raises
    :class:`MegatronRebuildError` with the snapshot intact: call it again (on every rank) to retry."""
    from megatron.core import parallel_state as ps

    if not snapshot.initialized_before or snapshot.rebuilt:
        return False
    if not snapshot.replayed:
        if ps.model_parallel_is_initialized():
            return False
        _replay(snapshot, ps)
        snapshot.replayed = True
    mapping = _old_to_new(snapshot, ps)
    roots: list[Any] = [m.__dict__ for n, m in list(sys.modules.items())
                        if n.startswith("megatron.") and n != ps.__name__ and m is not None]
    if worker is not None:
        roots.append(worker)
    t0 = time.perf_counter()
    try:
        replaced = refresh_group_handles(mapping, roots)
    except Exception as e:
        raise MegatronRebuildError(f"Megatron's groups were rebuilt but pointing their holders at them failed: {e}; "
                                   "the snapshot is kept: rebuilding again redoes only this refresh") from e
    logger.info("rlix: Megatron groups rebuilt (%s call); %d references to old groups replaced in %.3f s",
                "recorded" if snapshot.call is not None and snapshot.call.recorded else "fall-back", replaced,
                time.perf_counter() - t0)
    snapshot.globals_before.clear()
    snapshot.rebuilt = True
    return True


def _replay(snapshot: NcclSnapshot, ps: Any) -> None:
    """Replay the snapshot's call and check the layout; when that failed on ANY rank, undo and raise on every rank
    (a rank that kept its rebuilt groups would skip the retry the others then run: a hang)."""
    call = snapshot.call or InitCall((), dict(snapshot.sizes), recorded=False)
    error: Exception | None = None
    differences = ""
    try:
        ps.initialize_model_parallel(*call.args, **call.kwargs)
        differences = _layout_differences(snapshot, ps)
    except Exception as e:
        error = e
    try:
        failed_somewhere = _any_rank_failed(error is not None or bool(differences))
    except Exception as e:  # no agreement possible: undo here and say why
        failed_somewhere, error = True, error or RuntimeError(f"the ranks could not agree on the outcome: {e!r}")
    if not failed_somewhere:
        return
    _undo_replay(snapshot, ps)
    retry = ("The groups it had created were destroyed and parallel_state reset; the snapshot is kept, so the rebuild "
             "may be retried (on every rank together)")
    if error is not None:
        raise MegatronRebuildError(f"rebuilding Megatron's groups with {call.describe()} failed: {error!r}. "
                                   f"{retry}") from error
    if differences:
        how = ("the recorded call" if call.recorded else
               "a fall-back derived from parallel_state, because no call was recorded: run record_initialize_calls() "
               "in the worker before Megatron's setup (worker_process_setup_hook, which nemo_rl_placement installs)")
        raise MegatronRebuildError(f"rebuilding Megatron's groups with {call.describe()} ({how}) did not reproduce "
                                   f"the layout before the destroy: {differences}. {retry} (a retry replays the same "
                                   "call)")
    raise MegatronRebuildError(f"rebuilding Megatron's groups failed on another rank (see its error); this rank's "
                               f"rebuild was undone as well. {retry}")


def _any_rank_failed(failed: bool) -> bool:
    """Every rank's verdict, through the default process group (which the destroy never touches)."""
    import torch
    import torch.distributed as dist

    on_cpu = "gloo" in str(dist.get_backend()).lower() or not torch.cuda.is_available()
    flag = torch.tensor([int(failed)], device="cpu" if on_cpu else torch.device("cuda", torch.cuda.current_device()))
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _layout_differences(snapshot: NcclSnapshot, ps: Any) -> str:
    """What differs from the layout before the destroy ('' when nothing): the globals, then the first few in full."""
    differ = {}
    for name in sorted(set(snapshot.ranks_before) | {n for n in vars(ps) if _groups_of(getattr(ps, n))}):
        before = snapshot.ranks_before.get(name, [])
        after = [_ranks(g) for g in _groups_of(getattr(ps, name, None))]
        if after != before:
            differ[name] = (before, after)
    text = [f"the group ranks of parallel_state.{', '.join(differ)} differ"] if differ else []
    text += [f"{name} {before} before, {after} now" for name, (before, after) in list(differ.items())[:3]]
    vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    if vpp != snapshot.virtual_pipeline_size:
        text.append(f"the virtual pipeline size was {snapshot.virtual_pipeline_size} and is {vpp}")
    return "; ".join(text)


def _undo_replay(snapshot: NcclSnapshot, ps: Any) -> None:
    """Destroy every group a (partly) failed replay left in ``parallel_state`` (mcore's ``_global_process_group_list``
    holds those not assigned to a global yet), then reset it, so that a retry starts from the destroyed state."""
    import torch.distributed as dist

    old = {id(g) for value in snapshot.globals_before.values() for g in _groups_of(value)}
    seen: set[int] = set()
    world = dist.group.WORLD
    for name in sorted(vars(ps)):
        for group in _groups_of(getattr(ps, name)):
            if group is world or id(group) in old or id(group) in seen:
                continue
            seen.add(id(group))
            try:
                dist.destroy_process_group(group)
            except Exception as e:  # keep undoing: the reset below must happen
                logger.warning("rlix: could not destroy a group of parallel_state.%s while undoing a failed rebuild: "
                               "%s", name, e)
    ps.destroy_model_parallel()


def _old_to_new(snapshot: NcclSnapshot, ps: Any) -> dict[int, Any]:
    """Old group (by id) -> the new group of the same global and position (the layout was checked by the replay)."""
    mapping: dict[int, Any] = {}
    for name, old in snapshot.globals_before.items():
        for o, n in zip(_groups_of(old), _groups_of(getattr(ps, name, None)), strict=True):
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
