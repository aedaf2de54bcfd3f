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

Apply modes (``apply_mode``; ``"auto"`` = staged on CPU, eager elsewhere):

* ``"staged"`` - received tensors are kept (on the worker's device; cuda_ipc views are cloned) until finalize, which
  loads them in one pass. Atomic: an aborted or timed-out sync leaves the served weights untouched.
  Costs one extra model copy of memory. Required on vLLM-CPU (layer-wise reload needs whole layers).
* ``"eager"`` - each bucket is loaded on arrival (NeMo RL's own refit behaviour, memory bounded by one
  bucket). A failed sync leaves a mix of old and new weights: the worker reports ``dirty`` and the
  caller must not route to it until a later sync finalizes (expand never activates a failed rank).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlix_plugins import envs, transport
from rlix_plugins.errors import RlixConfigError, TransportError, WeightVerificationError, carried_in_text
from rlix_plugins.transport import finish_checksums, start_checksums, verify_checksums
from rlix_plugins.transport._checksum import segment_checksums
from rlix_plugins.transport._checksum_kernel import KernelChecksums, kernel_checksums, self_check
from rlix_plugins.transport._copy_kernel import KernelCopies, kernel_copies
from rlix_plugins.vllm.internals import runner_model, sleeping_weight_backups
from rlix_plugins.vllm.loading import WeightLoader, refresh_cpu_packed_copies, select_loader
from rlix_plugins.vllm.replay import BucketReplay, CopyRecorder, DirectCopies, parameter_storages

if TYPE_CHECKING:
    import torch

    from rlix_plugins.transport import BucketMeta

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


@dataclass
class _Sync:
    """What one worker received in one sync (``sync_id``) and has not finalized yet."""

    sync_id: str
    mode: str
    staged: list[tuple[str, torch.Tensor]] = field(default_factory=list)
    #: launched, not yet read: (names, nbytes, (n, 3) int32 partial sums) - read once, at finalize
    pending_sums: list[tuple[list[str], list[int], torch.Tensor]] = field(default_factory=list)
    buckets: int = 0
    loaded_eagerly: bool = False
    #: host_pull straight into the parameters: the layouts used, and the event after their last host read
    direct: list[tuple[BucketMeta, DirectCopies]] = field(default_factory=list)
    reads_done: Any = None
    #: a direct pull's checksums of the landed bytes, launched per bucket as its copies land: (names, pieces, partial)
    landed_sums: list[tuple[tuple[str, ...], list[list[Any]], Any]] = field(default_factory=list)
    landed_done: Any = None
    #: layouts first recorded in this sync: (meta, key, replay) - checked for the direct form at finalize
    recorded: list[tuple[BucketMeta, tuple[Any, ...], BucketReplay]] = field(default_factory=list)
    #: host_pull: per layout key, the address of the pages this sync read it from (a new direct layout's copy plan)
    sources: dict[tuple[Any, ...], int] = field(default_factory=dict)

    def wait_reads(self) -> None:
        """Block until every host page read of this sync landed (the sender may then rebuild its cache)."""
        if self.reads_done is not None:
            self.reads_done.synchronize()

    def checksums(self) -> dict[str, list[int]]:
        """Read every launched checksum (one host sync for the whole sync)."""
        out: dict[str, list[int]] = {}
        for names, nbytes, partial in self.pending_sums:
            out.update(zip(names, finish_checksums(nbytes, partial), strict=True))
        return out


@dataclass
class _State:
    loader: WeightLoader
    sync: _Sync | None = None
    #: checksums of every parameter this worker finalized, latest value per name
    model_checksums: dict[str, list[int]] = field(default_factory=dict)
    finalized: list[str] = field(default_factory=list)
    #: an eager sync failed half-way: the model holds a mix of weights until the next finalize
    dirty: bool = False
    buckets_total: int = 0
    #: side stream for host_pull's host->device copies (created on the first pull)
    copy_stream: Any = None
    #: where the last sync's time went on this worker (seconds per phase; ``rlix_receiver_info``)
    timing: dict[str, float] = field(default_factory=dict)
    pulls: int = 0
    finishes: int = 0
    #: host_pull: per bucket layout, the loader's copies recorded at its first load (:mod:`.replay`)
    replays: dict[tuple[Any, ...], BucketReplay] = field(default_factory=dict)
    no_replay: set[tuple[Any, ...]] = field(default_factory=set)
    #: host_pull: layouts whose recorded copies go straight from the host pages into the parameters
    direct: dict[tuple[Any, ...], DirectCopies] = field(default_factory=dict)
    #: side stream for the checksums of a direct pull (they follow each bucket's copies)
    check_stream: Any = None
    #: direct layout (``id`` of a ``direct`` value) -> its landed-bytes checksum plan
    landed_plans: dict[int, PiecesChecksums | KernelChecksums] = field(default_factory=dict)
    #: direct layout (``id``) -> its SM copy plan from the pages it was last read from (an expand's copies)
    copy_plans: dict[int, KernelCopies] = field(default_factory=dict)
    #: checksums of parameter bytes as the last finalize left them, with the address of the one piece holding them
    #: (None: several pieces); one use: that sync's ``verify_model``
    landed: dict[str, tuple[list[int], int | None]] = field(default_factory=dict)


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
    ``rlix_discard_weight_backup``, ``rlix_report_place``, ``rlix_receiver_info``).

    Runs on the vLLM worker's own thread with no background thread, so the RPC reply is the barrier the sender
    waits on. The one exception is on the GPU: a deferred host_pull leaves its copies (and their checksums) queued
    on side streams when it returns; ``rlix_finish_weight_update``, finalize and any dropped sync wait for them.
    """

    # ---------------------------------------------------------------- state
    def _rlix(self) -> _State:
        state: _State | None = getattr(self, "_rlix_state", None)
        if state is None:
            state = _State(loader=select_loader(self))
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

    def _rlix_begin(self, sync_id: str, apply_mode: str) -> _Sync:
        state = self._rlix()
        mode = self._rlix_mode(apply_mode)
        if state.sync is not None and state.sync.sync_id != sync_id:
            # A new sync while an older one was never finalized: the older one was aborted by its sender.
            logger.warning("rlix: dropping unfinalized sync %s (new sync %s)", state.sync.sync_id, sync_id)
            self._rlix_drop(state)
        if state.sync is None:
            state.sync = _Sync(sync_id=sync_id, mode=mode)
        elif state.sync.mode != mode:
            raise RlixConfigError(f"sync {sync_id}: apply_mode changed from {state.sync.mode} to {mode} mid-sync")
        return state.sync

    @staticmethod
    def _rlix_drop(state: _State) -> None:
        if state.sync is not None:
            state.sync.wait_reads()  # no copy may still write into parameters (or read pages) once dropped,
            if state.sync.landed_done is not None:  # nor a checksum read them (a sleep may unmap them next)
                state.sync.landed_done.synchronize()
            if state.sync.loaded_eagerly:
                state.dirty = True
        state.sync = None

    def _rlix_accept(self, sync: _Sync, named: list[tuple[str, torch.Tensor]], *, borrowed: bool) -> int:
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
        state.landed = self._rlix_landed(sync, received)
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
        with python_profiled(f"finish{state.finishes}", _PROFILE_CALLS):
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
    def _rlix_pull(self, sync: _Sync, payload: dict[str, Any]) -> int:
        state = self._rlix()
        state.pulls += 1
        t0 = time.perf_counter()
        with profiled(f"pull{state.pulls}", state.pulls == _PROFILE_PULL), \
                python_profiled(f"pullcall{state.pulls}", _PROFILE_CALLS):
            count = self._rlix_pull_buckets(sync, payload)
        state.timing["pull_call_s"] = time.perf_counter() - t0  # the whole call on this worker (RPC aside)
        return count

    def _rlix_pull_buckets(self, sync: _Sync, payload: dict[str, Any]) -> int:
        """Every bucket of a ``host_pull`` sync, in one call: map the sender's pinned pages (once per
        process), copy host -> GPU on a side stream into two alternating receive buffers, and load group by
        group as soon as a group's bytes landed (the next copies overlap the current loads); checksums
        run on the received bytes, batched per bucket. Returns after the last host read (the sender may
        rebuild its cache once every receiver returned)."""
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
            direct = [state.direct.get(layout_key(m)) for m, _ in opened]
            if all(d is not None and d.valid(params) for d in direct):
                t_checked = time.perf_counter()
                count = self._rlix_pull_direct(sync, opened, direct, deferred=bool(payload.get("deferred")),  # type: ignore[arg-type]
                                               sm_reads=bool(payload.get("overlaps_wake")))
                state.timing.update(pull_open_s=t_opened - t0, pull_check_layouts_s=t_checked - t_opened)
                return count
        copy_stream, main = state.copy_stream, torch.cuda.current_stream(device)
        capacity = max((transport.align_up(m.used_bytes) for m, _ in opened), default=0)
        count = min(2, len(opened))
        largest = max((m.largest() for m, _ in opened), key=lambda t: t[1], default=("", 0))
        transport.check_device_capacity(count * capacity, device, what=f"host_pull receive buffers ({count})",
                                        largest=largest)
        receive = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
        loaded: list[Any] = [None] * len(opened)
        landed: list[list[tuple[list[int], Any]]] = [[] for _ in opened]

        def copy_in(i: int) -> None:
            meta, host = opened[i]
            buf = receive[i % count]
            with torch.cuda.stream(copy_stream):
                if i >= count:
                    copy_stream.wait_event(loaded[i - count])  # the buffer's previous bucket was loaded
                # zero the rest of the last row first: the checksums read whole rows, and they wait only on the
                # group events below (a zero queued after them raced the checksum: caught by verification)
                buf[meta.used_bytes : transport.align_up(meta.used_bytes)].zero_()
                for group, lo, hi in group_ranges(meta):
                    buf[lo:hi].copy_(host[lo:hi], non_blocking=True)
                    done = torch.cuda.Event()
                    done.record(copy_stream)
                    landed[i].append((group, done))

        tensors = replayed = 0
        t0 = time.perf_counter()
        load_s = 0.0
        for i in range(count):
            copy_in(i)
        for i, (meta, host) in enumerate(opened):
            buf = receive[i % count]
            views = transport.unpack_bucket(meta, buf)
            key = layout_key(meta)
            sync.sources[key] = host.data_ptr()
            replay = state.replays.get(key) if sync.mode == "eager" else None
            if replay is not None and not replay.valid(params):
                logger.warning("rlix: parameters moved since bucket %d's load was recorded: loading it again", meta.index)
                state.replays.pop(key, None)
                state.direct.pop(key, None)
                state.landed_plans.clear()
                state.copy_plans.clear()
                replay = None
            record = sync.mode == "eager" and replay is None and key not in state.no_replay
            recorders: list[CopyRecorder] = []
            for g, (group, done) in enumerate(landed[i]):
                main.wait_event(done)
                named = [views[k] for k in group]
                if sync.mode == "eager":
                    t_load = time.perf_counter()
                    if replay is not None:
                        replay.apply(g, buf)
                    elif record:
                        recorders.append(CopyRecorder(buf))
                        with recorders[-1]:
                            state.loader.load(self, named)
                    else:
                        state.loader.load(self, named)
                    load_s += time.perf_counter() - t_load
                    sync.loaded_eagerly = True
                else:
                    sync.staged.extend((name, t.clone()) for name, t in named)
            replayed += replay is not None
            if record:
                built = BucketReplay.from_recording(recorders, params)
                if built is None:
                    state.no_replay.add(key)
                    logger.info("rlix: bucket %d is loaded by the model's loader every sync (%s)", meta.index,
                                next((r.foreign for r in recorders if r.foreign), "copies into non-parameters"))
                else:
                    state.replays[key] = built
                    sync.recorded.append((meta, key, built))
            nbytes = [meta.nbytes(k) for k in range(len(meta.names))]
            padded = receive[i % count][: transport.align_up(meta.used_bytes)]
            sync.pending_sums.append(
                (list(meta.names), nbytes, transport.bucket_checksums(padded, list(meta.offsets), nbytes))
            )
            loaded[i] = torch.cuda.Event()
            loaded[i].record(main)
            if i + count < len(opened):
                copy_in(i + count)
            sync.buckets += 1
            state.buckets_total += 1
            tensors += len(views)
        t_issued = time.perf_counter()
        copy_stream.synchronize()  # every host read is done before we return
        state.timing = {"pull_issue_s": t_issued - t0, "pull_load_s": load_s, "pull_replayed_buckets": replayed,
                        "pull_wait_copies_s": time.perf_counter() - t_issued}
        return tensors

    def _rlix_pull_direct(self, sync: _Sync, opened: list[tuple[BucketMeta, Any]], direct: list[DirectCopies],
                          *, deferred: bool, sm_reads: bool = False) -> int:
        """Every bucket straight from the sender's pinned pages into the parameters: one host->device copy per
        recorded range, on the side stream, ordered after the work already queued on the model. ``deferred``: return
        once the copies are queued (the sender's ``after_issue`` work - the KV cache's wake - overlaps them, and
        ``rlix_finish_weight_update`` is the barrier); otherwise return after the last host read. ``sm_reads`` (an
        expand: memory is being mapped): one copy kernel per bucket reads the pages through their device address,
        since the driver's work on the memory a wake maps halves copy-engine throughput - a triton kernel of few
        programs (:mod:`rlix_plugins.transport._copy_kernel`: a shallow PCIe read queue does not hold the KV wake
        back), torch's foreach copy where it is unavailable. Verified at finalize, on the parameters themselves."""
        import torch

        state = self._rlix()
        stream = state.copy_stream
        if state.check_stream is None:
            state.check_stream = torch.cuda.Stream(self._rlix_device())
        t0 = time.perf_counter()
        stream.wait_stream(torch.cuda.current_stream(self._rlix_device()))
        landed = []
        kernel = 0
        with torch.cuda.stream(stream):
            for (_, host), layout in zip(opened, direct, strict=True):
                if sm_reads:
                    view = transport.device_view(host, self._rlix_device())
                    plan = self._rlix_copy_plan(layout, view.data_ptr())
                    if plan is not None:
                        plan.launch()
                        kernel += 1
                        landed.append(torch.cuda.Event())
                        landed[-1].record(stream)
                        continue
                    dsts, srcs = layout.word_copies(view)
                else:
                    dsts, srcs = [dst for dst, _, _ in layout.copies], [host[lo:hi] for _, lo, hi in layout.copies]
                torch._foreach_copy_(dsts, srcs, non_blocking=True)
                landed.append(torch.cuda.Event())
                landed[-1].record(stream)
            sync.reads_done = torch.cuda.Event()
            sync.reads_done.record(stream)
        t_copies = time.perf_counter()
        # The checksums of what landed, bucket by bucket as its copies finish (they read the parameters on the GPU
        # while the next buckets cross PCIe): the sync's verification costs little more than the last bucket's sums.
        check = state.check_stream
        with torch.cuda.stream(check):
            for (meta, _), layout, event in zip(opened, direct, landed, strict=True):
                check.wait_event(event)
                sync.landed_sums.append((meta.names, layout.pieces, self._rlix_landed_plan(layout).start()))
            sync.landed_done = torch.cuda.Event()
            sync.landed_done.record(check)
        sync.direct.extend((meta, layout) for (meta, _), layout in zip(opened, direct, strict=True))
        sync.loaded_eagerly = True
        sync.buckets += len(opened)
        state.buckets_total += len(opened)
        t_issued = time.perf_counter()
        if not deferred:
            sync.wait_reads()
        state.timing = {"pull_issue_s": t_issued - t0, "pull_issue_checksums_s": t_issued - t_copies,
                        "pull_direct_copies": sum(len(d.copies) for d in direct), "pull_deferred": deferred,
                        "pull_sm_reads": sm_reads, "pull_copy_kernel_buckets": kernel,
                        "pull_checksum_kernel": all(isinstance(state.landed_plans.get(id(d)), KernelChecksums)
                                                    for d in direct),
                        "pull_wait_copies_s": time.perf_counter() - t_issued}
        return sum(len(m.names) for m, _ in opened)

    def _rlix_landed(self, sync: _Sync, received: dict[str, list[int]]) -> dict[str, tuple[list[int], int | None]]:
        """Checksums of the bytes in the parameters after a direct pull (what verification reads; launched by the pull as
        each bucket landed), and a check of the layouts this sync recorded: one becomes direct when its copies tile its
        tensors and the parameters, after the loader's post-processing, hold exactly the received bytes (a
        post-processing that rewrites weights keeps the layout on the receive-buffer path; one that leaves them as
        they are lets a direct sync's sums, taken before it, stand for the parameters after it)."""
        state = self._rlix()
        landed: dict[str, tuple[list[int], int | None]] = {}
        for names, pieces, partial in sync.landed_sums:
            sums = finish_checksums([sum(p.numel() for p in item) for item in pieces], partial)
            landed.update((name, (sum_, item[0].data_ptr() if len(item) == 1 else None))
                          for name, item, sum_ in zip(names, pieces, sums, strict=True))
        items: list[tuple[str, list[Any]]] = []
        candidates: list[tuple[tuple[Any, ...], BucketMeta, DirectCopies]] = []
        for meta, key, replay in sync.recorded:
            found = DirectCopies.from_replay(replay, meta.offsets, [meta.nbytes(k) for k in range(len(meta.names))])
            if isinstance(found, str):
                logger.info("rlix: bucket %d stays on the receive-buffer path: %s", meta.index, found)
                continue
            candidates.append((key, meta, found))
        for meta, layout in ((m, d) for _, m, d in candidates):
            items.extend(zip(meta.names, layout.pieces, strict=True))
        if not items:
            return landed
        t0 = time.perf_counter()
        plan = PiecesChecksums([pieces for _, pieces in items])  # a first load: once per layout
        sums = finish_checksums(plan.nbytes, plan.start())
        if self._rlix_device().type == "cuda":  # the checksum kernel's one comparison (and compile) per process
            self_check([pieces for _, pieces in items], sums)
        landed.update((name, (sum_, pieces[0].data_ptr() if len(pieces) == 1 else None))
                      for (name, pieces), sum_ in zip(items, sums, strict=True))
        state.timing["finalize_candidate_checksums_s"] = time.perf_counter() - t0
        for key, meta, found in candidates:
            if all(landed[n][0] == received.get(n) for n in meta.names):
                state.direct[key] = found
                state.landed_plans.clear()
                state.copy_plans.clear()
            else:
                logger.info("rlix: bucket %d stays on the receive-buffer path: the parameters differ from the received "
                            "bytes after post-processing", meta.index)
        if self._rlix_device().type == "cuda":  # the plans now, not in the next pull: building one is a blocking copy
            for key, layout in state.direct.items():
                self._rlix_landed_plan(layout)
                if key in sync.sources:
                    self._rlix_copy_plan(layout, sync.sources[key])
        return landed

    def _rlix_copy_plan(self, layout: DirectCopies, source: int) -> KernelCopies | None:
        """The SM copy plan of a direct layout from the pages at ``source`` (built when the layout became direct, again
        if the pages moved); None where the copy kernel is unavailable (:mod:`rlix_plugins.transport._copy_kernel`)."""
        plans = self._rlix().copy_plans
        plan = plans.get(id(layout))
        if plan is None or plan.source != source:
            built = kernel_copies(source, [(dst.data_ptr(), lo, hi) for dst, lo, hi in layout.copies],
                                  self._rlix_device())
            if built is None:
                return None
            plan = plans[id(layout)] = built
        return plan

    def _rlix_landed_plan(self, layout: DirectCopies) -> PiecesChecksums | KernelChecksums:
        """The landed-bytes checksum plan of a direct layout, built once: one kernel launch when the kernel passed
        its self-check (:mod:`rlix_plugins.transport._checksum_kernel`), else ~40 torch ops per 256 MiB."""
        plans = self._rlix().landed_plans
        plan = plans.get(id(layout))
        if plan is None:
            plan = plans[id(layout)] = kernel_checksums(layout.pieces) or PiecesChecksums(layout.pieces)
        return plan

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
            "direct_layouts": len(state.direct),
            #: direct layouts whose checksum plan is built (all, after the sync that made them direct), by kind
            "landed_plans": sorted(type(p).__name__ for p in state.landed_plans.values()),
            "copy_plans": len(state.copy_plans),
            "timing": dict(state.timing),
        }


def _verify(expected: dict[str, list[int]], actual: dict[str, list[int]], context: str) -> None:
    """``verify_checksums`` with the error carried in its text: vLLM's RPC forwards only the text."""
    try:
        verify_checksums(expected, actual, context=context)
    except WeightVerificationError as exc:
        raise carried_in_text(exc) from None


#: bytes per load group of a host_pull bucket: the loader starts on a group as soon as it landed
GROUP_BYTES = 64 << 20


def layout_key(meta: BucketMeta) -> tuple[Any, ...]:
    """What makes two buckets load the same way: names, offsets and dtypes (shapes follow from the model)."""
    return (meta.names, meta.offsets, meta.dtypes)


def group_ranges(meta: Any) -> list[tuple[list[int], int, int]]:
    """Tensor indices of ``meta`` in consecutive groups of about ``GROUP_BYTES`` (a large tensor alone), each with
    its byte range ``[lo, hi)``. The ranges tile ``[0, used_bytes)`` - padding between groups included: the
    checksums read it (zero on the sender's side) - so a group ends where the next one starts."""
    groups: list[list[int]] = []
    size = 0
    for k in range(len(meta.names)):
        nbytes = meta.nbytes(k)
        if groups and size + nbytes <= GROUP_BYTES:
            groups[-1].append(k)
            size += nbytes
        else:
            groups.append([k])
            size = nbytes
    starts = [meta.offsets[g[0]] if i else 0 for i, g in enumerate(groups)]
    ends = [*starts[1:], meta.used_bytes]
    return [(g, lo, hi) for g, lo, hi in zip(groups, starts, ends, strict=True)]


#: ``RLIX_PROFILE_PULL=N``: profile this worker's N-th host_pull with the torch profiler (where a sync's time goes)
_PROFILE_PULL = envs.profile_pull()
#: ``RLIX_PROFILE_CALLS=1``: profile the host Python of every pull and finish call (cProfile, to ``RLIX_PROFILE_DIR``)
_PROFILE_CALLS = envs.profile_calls()


@contextlib.contextmanager
def python_profiled(name: str, active: bool) -> Iterator[None]:
    """When ``active`` and ``RLIX_PROFILE_DIR`` is set: cProfile around the block, the 40 costliest calls by
    cumulative time to ``<dir>/<name>_<pid>.txt`` (where host time goes in Python: the torch profiler sees ops)."""
    out = envs.profile_dir()
    if not (active and out):
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        with open(os.path.join(out, f"{name}_{os.getpid()}.txt"), "w", encoding="utf-8") as fh:
            fh.write(text.getvalue())


@contextlib.contextmanager
def profiled(name: str, active: bool) -> Iterator[None]:
    """When ``active``: torch profiler (CPU + CUDA) around the block; the op table goes to the log and, with
    ``RLIX_PROFILE_DIR`` set, to ``<dir>/<name>_<pid>.txt`` next to a Chrome trace (the timeline)."""
    if not active:
        yield
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    logger.warning("rlix: profile of %s\n%s", name, table)
    out = envs.profile_dir()
    if out:
        with open(os.path.join(out, f"{name}_{os.getpid()}.txt"), "w", encoding="utf-8") as fh:
            fh.write(table)
        prof.export_chrome_trace(os.path.join(out, f"{name}_{os.getpid()}.trace.json"))


#: bytes per scratch chunk of the live check (params copied side by side, then checksummed as one bucket)
LIVE_CHUNK_BYTES = 256 << 20


def live_checksums(tensors: list[Any], batched: bool | None = None) -> Any:
    """:func:`start_checksums` of model parameters with a handful of kernels (:func:`pieces_checksums`). One
    kernel chain per parameter cost 23-31 ms for a 1.5B model's live check on the H100."""
    if not tensors or not (tensors[0].device.type == "cuda" if batched is None else batched):
        return start_checksums(tensors)
    import torch

    return pieces_checksums([[t.detach().contiguous().reshape(-1).view(torch.uint8)] for t in tensors])


def pieces_checksums(items: list[list[Any]]) -> Any:
    """Checksums of byte strings each given as uint8 pieces on one device (item ``k`` = ``cat(items[k])``), for
    :func:`finish_checksums`; see :class:`PiecesChecksums`."""
    return PiecesChecksums(items).start()


class PiecesChecksums:
    """:func:`pieces_checksums` worked out once for pieces that stay where they are (a direct layout's parameter
    slices): the pieces are copied into a scratch buffer at 512-byte aligned offsets (one ``cat`` per
    ``LIVE_CHUNK_BYTES``) and checksummed as one bucket; the row indices live on the device, so :meth:`start`
    only launches kernels (no host sync, a few ``cat`` calls)."""

    def __init__(self, items: list[list[Any]]) -> None:
        from rlix_plugins.transport._checksum import segment_rows

        self.nbytes = [sum(p.numel() for p in item) for item in items]
        self.chunks: list[tuple[list[Any], list[int], list[int], Any]] = []
        chunk: list[int] = []
        size = 0

        def flush() -> None:
            nonlocal chunk, size
            if not chunk:
                return
            pieces, offsets, nbytes, end = [], [], [], 0
            for k in chunk:
                n = self.nbytes[k]
                offsets.append(end)
                nbytes.append(n)
                pieces.extend(items[k])
                pad = transport.align_up(n) - n
                if pad:
                    pieces.append(_zeros(pad, items[chunk[0]][0].device))
                end += n + pad
            device = pieces[0].device
            self.chunks.append((pieces, offsets, nbytes, segment_rows(offsets, nbytes, device)))
            chunk, size = [], 0

        for k, item in enumerate(items):
            if not item:
                continue  # zero bytes: zeros, see start
            if chunk and size + self.nbytes[k] > LIVE_CHUNK_BYTES:
                flush()
            chunk.append(k)
            size += self.nbytes[k]
        flush()
        self.present = [k for k, item in enumerate(items) if item]

    def start(self) -> Any:
        """The ``(n, 3)`` partial sums of every item, for :func:`finish_checksums` (no host sync)."""
        import torch

        parts = [segment_checksums(torch.cat(pieces), offsets, nbytes, rows=rows)
                 for pieces, offsets, nbytes, rows in self.chunks]
        if len(self.present) == len(self.nbytes):
            return torch.cat(parts) if parts else start_checksums([])
        device = parts[0].device if parts else torch.device("cpu")
        out = torch.zeros((len(self.nbytes), 3), dtype=torch.int32, device=device)  # an empty item sums to zero
        if parts:
            out[torch.tensor(self.present, device=device)] = torch.cat(parts)
        return out


_zero_rows: dict[Any, Any] = {}


def _zeros(n: int, device: Any) -> Any:
    """``n`` (< 512) zero bytes on ``device``: a view of one cached row (the padding between checksummed items)."""
    import torch

    row = _zero_rows.get(device)
    if row is None:
        row = _zero_rows[device] = torch.zeros(transport.ALIGN_BYTES, dtype=torch.uint8, device=device)
    return row[:n]
