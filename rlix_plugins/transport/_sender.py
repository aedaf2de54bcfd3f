"""Sender API: push the published cache version to the targets of a comm plan.

``sync_weights``: ask every target where its workers run and check the plan against it (``_place``) -> lock cache ->
[setup group on the sender's node IP] -> per bucket: stage -> send (IPC payloads and/or
broadcast) -> barrier -> destroy (after a failure: sender first, then receivers; after success all
ranks concurrently, each teardown being local) -> [finish] -> unlock -> [verify].

Every wait is bounded by ``timeout_s`` (per phase: setup, each bucket, teardown, finish, verify). After any
failure the sender's group, its TCPStore port and its staging buffer are released, receivers are
asked to destroy the group (bounded, errors only logged), and ``TransportError`` is raised; the
next sync builds a fresh group under a fresh name and port.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, final, runtime_checkable

import torch

from rlix_plugins.errors import (
    RlixConfigError,
    RlixTimeoutError,
    TransportError,
    WeightVerificationError,
    typed_error,
)
from rlix_plugins.transport._broadcast import GroupHost
from rlix_plugins.transport._cache import CacheSnapshot, VersionedBucketCache
from rlix_plugins.transport._memory import check_device_capacity
from rlix_plugins.transport._place import Place, check_comm_plan, local_place, rendezvous_address
from rlix_plugins.transport._plan import CommPlan
from rlix_plugins.transport._registry import same_gpu_transport
from rlix_plugins.transport._same_gpu import BucketTransport, SyncTransport

log = logging.getLogger(__name__)


@runtime_checkable
class PendingCall(Protocol):
    """A started call: ``concurrent.futures.Future`` fits, so does ``ray.ObjectRef.future()``."""

    def result(self, timeout: float | None = None) -> Any:
        """Block up to ``timeout`` s; return the value, raise the call's error, or raise TimeoutError."""
        ...


@runtime_checkable
class ReceiverEndpoint(Protocol):
    """One target DP rank (one vLLM engine). Each method starts the call on the rank's workers
    (every local/TP rank; a worker not named in the rank lists does nothing) and returns at once.

    Worker-side, each method maps to one receiver function of ``rlix_plugins.transport``.
    Arguments are plain types and bytes only.

    Dispatch rule: a method must have *sent* its request before it returns (``actor.m.remote()``
    does). The sender blocks in a collective right after starting the receiver calls; a request
    still queued behind a Python thread may never leave, and the collective never completes.
    """

    def setup_collective_group(
        self,
        group_name: str,
        master_addr: str,
        master_port: int,
        ranks_by_local_rank: dict[int, int],
        world_size: int,
        backend: str,
        timeout_s: float,
    ) -> PendingCall:
        """Worker with local rank ``r`` in ``ranks_by_local_rank`` calls
        ``setup_collective_group(group_name, master_addr, master_port, ranks_by_local_rank[r], world_size, backend, timeout_s)``."""
        ...

    def update_parameter_in_bucket(self, payload: dict[str, Any], ipc_local_ranks: list[int]) -> PendingCall:
        """Workers in ``ipc_local_ranks``: ``receive_bucket(payload, device)`` -> load -> synchronize -> return."""
        ...

    def broadcast_parameter(self, group_name: str, bucket_meta: dict[str, Any], broadcast_local_ranks: list[int]) -> PendingCall:
        """Workers in ``broadcast_local_ranks``: ``broadcast_parameter(group_name, bucket_meta, device)`` -> load -> return."""
        ...

    def destroy_collective_group(self, group_name: str) -> PendingCall:
        """Every worker: ``destroy_collective_group(group_name)`` (a no-op where it never joined)."""
        ...

    def verify_model(self, expected_checksums: dict[str, list[int]]) -> PendingCall:
        """Compare the checksums of the tensors received so far with the sender's
        (``verify_checksums``); raise ``WeightVerificationError`` on the first difference."""
        ...

    def report_places(self) -> PendingCall:
        """Every worker, in local-rank order: where it runs, ``local_place(its device).to_wire()`` (a list of
        dicts). The sender checks the plan against these before a sync (``check_comm_plan``)."""
        ...


@runtime_checkable
class FinishingEndpoint(ReceiverEndpoint, Protocol):
    """An endpoint whose receivers end a sync in one call (``sync_weights(finish=True)``)."""

    def finish(self, expected_checksums: Mapping[str, list[int]] | None) -> PendingCall:
        """Every worker: once it read every host page of this sync, make the sync's weights the served ones and,
        with ``expected_checksums``, verify them as ``verify_model`` does (same ``WeightVerificationError``).
        The sender's last call of a sync, made under the cache lock: a host_pull may return before its reads
        land (``deferred``), this call is their barrier."""
        ...


@final
@dataclass(frozen=True)
class SyncReport:
    """What one ``sync_weights`` call did."""

    version: int
    num_buckets: int
    #: bytes of bucket payload moved once (per bucket ``used_bytes``, summed)
    payload_bytes: int
    ipc_dp_ranks: tuple[int, ...]
    broadcast_dp_ranks: tuple[int, ...]
    group_name: str | None
    setup_seconds: float
    transfer_seconds: float
    #: part of ``transfer_seconds`` from each bucket's send to its barrier (wire + receiver load), summed
    wire_seconds: float
    #: GPU time of the host->device staging copies (CUDA events on the copy stream; 0 without GPU staging)
    staging_copy_seconds: float
    teardown_seconds: float
    verified: bool
    #: the sender's checksums of the version sent (``{name: [nbytes, word_sum, weighted_sum]}``)
    checksums: Mapping[str, list[int]]
    #: ``finish=True``: seconds of the finish calls (a deferred host_pull's last copies land in them) and their
    #: results by dp rank
    finish_seconds: float = 0.0
    finished: Mapping[int, Any] = field(default_factory=dict)
    #: where the broadcast group met (the sender's node IP by default); None without broadcast targets
    rendezvous: str | None = None


#: how long ``wait_all`` waits on one call before it looks at the next, while several are out
_POLL_S = 0.05


def wait_all(calls: Mapping[int, PendingCall], timeout_s: float, what: str, *,
             verification: str | None = None) -> dict[int, Any]:
    """Bounded barrier over started calls (one deadline for all); their results by dp rank. The first failure
    ends it, whichever call it is.

    Every error names the dp rank. A receiver's ``WeightVerificationError`` stays one, with its fields, also
    through Ray (``RayTaskError``) and vLLM's ``collective_rpc`` (its text, see ``errors.carried_in_text``),
    named ``verification`` (default ``what``: a call that also does other work reports its verification
    as the verification alone); any other failure is a ``TransportError``.
    """
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    waiting = dict(calls)
    while waiting:
        # The calls in turn, briefly each while several are out: the first failure ends the wait, wherever it is
        # (a rank that died must not wait behind a live one stuck in a collective with it).
        for dp_rank, call in list(waiting.items()):
            left = deadline - time.monotonic()
            try:
                out[dp_rank] = call.result(timeout=max(min(left, _POLL_S) if len(waiting) > 1 else left, 0.0))
            except TimeoutError as exc:
                if left > 0:
                    continue
                raise RlixTimeoutError(
                    f"{what}: dp rank {dp_rank} did not answer within {timeout_s:.0f} s (receiver dead or stuck)"
                ) from exc
            except Exception as exc:
                typed = typed_error(exc)
                if isinstance(typed, WeightVerificationError):
                    raise WeightVerificationError(
                        f"{verification or what}: dp rank {dp_rank}: {typed}", parameter=typed.parameter,
                        dp_rank=dp_rank
                    ) from exc
                raise TransportError(f"{what}: dp rank {dp_rank} failed: {exc!r}") from exc
            del waiting[dp_rank]
    return {dp_rank: out[dp_rank] for dp_rank in calls}


def _failed_calls(calls: Mapping[int, PendingCall], grace_s: float) -> str:
    """Which receivers failed (for the error message): the failures so far, else the first within ``grace_s``."""
    deadline = time.monotonic() + grace_s
    while True:
        failed = []
        for dp_rank, call in calls.items():
            try:
                call.result(timeout=0)
            except TimeoutError:
                continue
            except Exception as exc:
                failed.append(f"dp rank {dp_rank}: {exc!r}")
        if failed or time.monotonic() >= deadline:
            return "; ".join(failed)
        time.sleep(_POLL_S)


def _check_endpoints(plan: CommPlan, endpoints: Mapping[int, ReceiverEndpoint], *, finish: bool,
                     after_issue: Callable[[], None] | None) -> None:
    missing = [t.dp_rank for t in plan.targets if t.dp_rank not in endpoints]
    if missing:
        raise RlixConfigError(f"no receiver endpoint for target dp ranks {missing}; endpoints given: {sorted(endpoints)}")
    unplaced = [t.dp_rank for t in plan.targets if not callable(getattr(endpoints[t.dp_rank], "report_places", None))]
    if unplaced:
        raise RlixConfigError(f"the endpoints of dp ranks {unplaced} have no report_places: every sync checks its plan "
                              "against where the receivers run (transport.ReceiverEndpoint)")
    if after_issue is not None and not finish:
        raise RlixConfigError("sync_weights(after_issue=...) needs finish=True: the finish call is the barrier on the "
                              "host pages that a deferred host_pull still reads")
    if finish:
        lacking = [t.dp_rank for t in plan.targets if not isinstance(endpoints[t.dp_rank], FinishingEndpoint)]
        if lacking:
            raise RlixConfigError(f"finish=True needs endpoints with a finish method; dp ranks {lacking} have none: "
                                  "give FinishingEndpoints or sync with finish=False")


def sync_weights(
    cache: VersionedBucketCache,
    plan: CommPlan,
    endpoints: Mapping[int, ReceiverEndpoint],
    *,
    staging_device: torch.device | str = "cpu",
    master_addr: str | None = None,
    backend: str | None = None,
    timeout_s: float = 150.0,
    verify: bool = False,
    group_prefix: str = "rlix_sync",
    after_issue: Callable[[], None] | None = None,
    finish: bool = False,
) -> SyncReport:
    """Send the cache's published version to every target of ``plan``; see the module docstring.

    :param staging_device: ``"cuda:N"`` on a GPU sender (one staging buffer of the largest bucket,
        allocated per sync and freed after it); ``"cpu"`` sends from the pinned cache directly
        (gloo broadcast and cpu_serialize only).
    :param master_addr: the broadcast group's rendezvous address, an address of this process's node: default its
        Ray node IP (``rendezvous_address``; without Ray it must be given).
    :param backend: broadcast backend; default ``nccl`` for a CUDA staging device, else ``gloo``.
    :param verify: ask every target to verify against the version's checksums: in the finish call, else after
        the unlock (``verify_model``).
    :param finish: end the sync with one ``FinishingEndpoint.finish`` call per target, after the teardown and
        still under the cache lock (results in ``SyncReport.finished``). host_pull receivers then return as soon
        as their copies are queued (``deferred``); the finish call is the barrier on the host pages.
    :param after_issue: work to overlap with the transfer (an expand wakes the KV cache here), called under the
        cache lock once every receiver call was answered; needs ``finish``.
    """
    _check_endpoints(plan, endpoints, finish=finish, after_issue=after_issue)
    staging_dev = torch.device(staging_device)
    backend = backend or ("nccl" if staging_dev.type == "cuda" else "gloo")
    same_gpu = same_gpu_transport(plan.same_gpu_transport)
    if same_gpu.reads_staging and any(t.ipc_local_ranks for t in plan.targets) and staging_dev.type != "cuda":
        raise RlixConfigError(
            f"same_gpu_transport={same_gpu.name!r} needs a CUDA staging_device; use 'cpu_serialize' on CPU"
        )
    if backend == "nccl" and staging_dev.type != "cuda":
        raise RlixConfigError("backend='nccl' needs a CUDA staging_device")
    ipc_ranks = tuple(t.dp_rank for t in plan.targets if t.ipc_local_ranks)
    bcast_targets = [t for t in plan.targets if t.broadcast_ranks]
    group_name = f"{group_prefix}_{uuid.uuid4().hex[:8]}" if plan.needs_group else None
    if group_name is not None:
        master_addr = rendezvous_address(master_addr)
    # Before the lock and before any byte: a same-GPU transport to a rank elsewhere is refused, never attempted.
    check_comm_plan(plan, local_place(staging_dev), report_places(plan, endpoints, timeout_s))
    with cache.read(timeout_s) as snap:
        t0 = time.perf_counter()
        host: GroupHost | None = None
        ok = False
        setup_s = transfer_s = wire_s = copy_s = 0.0
        try:
            if group_name is not None:
                assert master_addr is not None  # resolved above
                host = GroupHost(group_name, backend, staging_dev, timeout_s, master_addr)
                calls = {
                    t.dp_rank: endpoints[t.dp_rank].setup_collective_group(
                        group_name, master_addr, host.port, t.broadcast_rank_map(), plan.broadcast_world_size, backend, timeout_s
                    )
                    for t in bcast_targets
                }
                try:
                    host.join(plan.broadcast_world_size, failed=lambda: _failed_calls(calls, grace_s=0.0))
                except TransportError as exc:  # say why: a receiver's own error names the address it dialed
                    # its own bound (timeout_s) may have started later than the host's (a busy actor or machine)
                    culprits = _failed_calls(calls, grace_s=min(timeout_s, 30.0))
                    if culprits and culprits in str(exc):  # the join stopped on these failures and named them
                        raise
                    raise TransportError(f"{exc}; receivers: {culprits or 'none reported an error yet'}") from exc
                wait_all(calls, timeout_s, f"setup_collective_group({group_name})")
            setup_s = time.perf_counter() - t0
            wire_s, copy_s = _send_buckets(snap, plan, endpoints, host, group_name, staging_dev, timeout_s, after_issue,
                                           deferred=finish)
            transfer_s = time.perf_counter() - t0 - setup_s
            ok = True
        except (TransportError, RlixConfigError):
            raise
        except Exception as exc:
            raise TransportError(f"weight sync of version {snap.version} failed: {exc!r}") from exc
        finally:
            t1 = time.perf_counter()
            _teardown(host, group_name, bcast_targets, endpoints, staging_dev, timeout_s, ok=ok)
            teardown_s = time.perf_counter() - t1
        version, checksums, num_buckets, payload = snap.version, snap.checksums, len(snap.buckets), snap.used_bytes
        finished: dict[int, Any] = {}
        t2 = time.perf_counter()
        if finish:  # under the lock: it waits for any host page a deferred pull still reads
            calls = {t.dp_rank: _finishing(endpoints[t.dp_rank]).finish(checksums if verify else None)
                     for t in plan.targets}
            finished = wait_all(calls, timeout_s, f"finish of version {version}",
                                verification=f"verify_model(version {version})")
        finish_s = time.perf_counter() - t2
    if verify and not finish:
        calls = {t.dp_rank: endpoints[t.dp_rank].verify_model(checksums) for t in plan.targets}
        wait_all(calls, timeout_s, f"verify_model(version {version})")
    return SyncReport(
        version=version,
        num_buckets=num_buckets,
        payload_bytes=payload,
        ipc_dp_ranks=ipc_ranks,
        broadcast_dp_ranks=tuple(t.dp_rank for t in bcast_targets),
        group_name=group_name,
        setup_seconds=setup_s,
        transfer_seconds=transfer_s,
        wire_seconds=wire_s,
        staging_copy_seconds=copy_s,
        teardown_seconds=teardown_s,
        verified=verify,
        checksums=checksums,
        finish_seconds=finish_s,
        finished=finished,
        rendezvous=master_addr if group_name is not None else None,
    )


def report_places(plan: CommPlan, endpoints: Mapping[int, ReceiverEndpoint], timeout_s: float) -> dict[int, list[Place]]:
    """Where every worker of every target of ``plan`` runs, as the workers report it (bounded by ``timeout_s``)."""
    calls = {t.dp_rank: endpoints[t.dp_rank].report_places() for t in plan.targets}
    reports = wait_all(calls, timeout_s, "report_places")
    return {dp: [Place.from_wire(w) for w in workers] for dp, workers in reports.items()}


def _finishing(endpoint: ReceiverEndpoint) -> FinishingEndpoint:
    assert isinstance(endpoint, FinishingEndpoint)  # checked by _check_endpoints
    return endpoint


def _send_buckets(
    snap: CacheSnapshot,
    plan: CommPlan,
    endpoints: Mapping[int, ReceiverEndpoint],
    host: GroupHost | None,
    group_name: str | None,
    staging_dev: torch.device,
    timeout_s: float,
    after_issue: Callable[[], None] | None = None,
    *,
    deferred: bool = False,
) -> tuple[float, float]:
    """Per bucket i: [staged] -> start receiver calls -> stage bucket i+1 -> sender broadcast -> barrier.
    Returns (seconds from each bucket's send to its barrier, summed: wire + load time; GPU seconds of
    the host->device staging copies, from CUDA events).

    On a CUDA sender two staging buffers alternate (a side stream copies bucket i+1 host->device while
    bucket i is broadcast and loaded). Buffer ``i % 2`` is rewritten for bucket i+2 only after bucket
    i's barrier: every receiver has returned, so no IPC view of it is still read.

    Measured (H200, 1 and 4 GiB): queueing copy i+1 *before* the receivers are called for bucket i
    made pushes slower (0.79 vs 0.83 and 0.85 vs 0.89 of a raw host->device copy): the receiver is
    another process on the same GPU, its loads wait for a time slice while the sender's copy queue
    is busy. The staging copies themselves run at 0.99 of the raw copy either way.
    """
    buckets = snap.buckets
    stagings: list[torch.Tensor] = []
    copy_stream: Any = None
    same_gpu = same_gpu_transport(plan.same_gpu_transport)
    ipc_targets = [t for t in plan.targets if t.ipc_local_ranks]
    bcast_targets = [t for t in plan.targets if t.broadcast_ranks]
    pulls: dict[int, PendingCall] = {}
    if ipc_targets and isinstance(same_gpu, SyncTransport):
        # one call per target with every bucket: the receiver pipelines its own copies, no per-bucket barrier
        payload = same_gpu.payload(buckets, deferred=deferred, overlaps_wake=after_issue is not None)
        t_send = time.perf_counter()
        pulls = {t.dp_rank: endpoints[t.dp_rank].update_parameter_in_bucket(payload, list(t.ipc_local_ranks))
                 for t in ipc_targets}
    per_bucket = same_gpu if ipc_targets and isinstance(same_gpu, BucketTransport) else None
    # Only a broadcast or a transport that reads the staging copy needs the GPU copy (cpu_serialize: the pinned bucket).
    reads_gpu_copy = host is not None or (per_bucket is not None and per_bucket.reads_staging)
    if staging_dev.type == "cuda" and buckets and reads_gpu_copy:
        count = 2 if len(buckets) > 1 else 1
        check_device_capacity(count * snap.capacity_bytes, staging_dev, what=f"sender staging ({count} buffers)",
                              largest=snap.largest_tensor)
        stagings = [torch.empty(snap.capacity_bytes, dtype=torch.uint8, device=staging_dev) for _ in range(count)]
        copy_stream = torch.cuda.Stream(staging_dev)

    copy_events: list[tuple[Any, Any]] = []

    def stage(i: int) -> Any:
        record = buckets[i]
        with torch.cuda.stream(copy_stream):
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(copy_stream)
            stagings[i % len(stagings)][: record.meta.used_bytes].copy_(record.payload, non_blocking=True)
            done.record(copy_stream)
        copy_events.append((start, done))
        return done

    wire_s = copy_s = 0.0
    try:
        pending: Any = stage(0) if stagings else None
        for i, record in enumerate(buckets if stagings or per_bucket is not None or host is not None else ()):
            data = record.payload
            if stagings:
                pending.synchronize()
                data = stagings[i % len(stagings)][: record.meta.used_bytes]
            t_send = time.perf_counter()
            calls: dict[int, PendingCall] = {}
            if per_bucket is not None:
                payload = per_bucket.payload(record, data)
                for t in ipc_targets:
                    calls[t.dp_rank] = endpoints[t.dp_rank].update_parameter_in_bucket(payload, list(t.ipc_local_ranks))
            if host is not None and group_name is not None:
                wire = record.meta.to_wire()
                for t in bcast_targets:
                    calls[t.dp_rank] = endpoints[t.dp_rank].broadcast_parameter(group_name, wire, list(t.broadcast_local_ranks))
            if stagings and i + 1 < len(buckets):
                pending = stage(i + 1)  # the other buffer: its last reader passed bucket i-1's barrier
            if host is not None:
                try:
                    host.broadcast(data)
                except Exception as exc:
                    culprits = _failed_calls(calls, grace_s=min(2.0, timeout_s))
                    raise TransportError(
                        f"bucket {record.meta.index}/{len(buckets)} of version {snap.version}: sender broadcast failed "
                        f"({exc!r}); failed receivers: {culprits or 'none reported yet'}"
                    ) from exc
            wait_all(calls, timeout_s, f"bucket {record.meta.index}/{len(buckets)} of version {snap.version}")
            wire_s += time.perf_counter() - t_send
        if pulls:
            wait_all(pulls, timeout_s, f"host_pull of version {snap.version} ({len(buckets)} buckets)")
        if after_issue is not None:
            after_issue()
        if pulls:
            wire_s = max(wire_s, time.perf_counter() - t_send)
    finally:
        if stagings:
            torch.cuda.synchronize(staging_dev)
            with contextlib.suppress(Exception):  # a diagnostic: never mask the error that got us here
                copy_s = sum(a.elapsed_time(b) for a, b in copy_events) / 1000.0
            stagings.clear()
            same_gpu.release(staging_dev)
            torch.cuda.empty_cache()  # give the staging memory back to the device (the GPU is shared)
    return wire_s, copy_s


def _teardown(
    host: GroupHost | None,
    group_name: str | None,
    bcast_targets: list[Any],
    endpoints: Mapping[int, ReceiverEndpoint],
    staging_dev: torch.device,
    timeout_s: float,
    *,
    ok: bool,
) -> None:
    """Failure path: sender first (its abort unblocks receivers stuck mid-collective), then the
    receivers, whose errors are logged, never raised over the cause. Success path: every bucket
    passed its barrier, so no collective is in flight and each rank's teardown is local (NCCL
    abort, gloo shutdown): receivers are told first and everyone tears down concurrently."""
    if not ok and host is not None:
        host.close(clean=False)
    calls: dict[int, PendingCall] = {}
    if group_name is not None:
        for t in bcast_targets:
            try:
                calls[t.dp_rank] = endpoints[t.dp_rank].destroy_collective_group(group_name)
            except Exception as exc:
                if ok:
                    if host is not None:
                        host.close(clean=True)
                    raise TransportError(f"destroy_collective_group({group_name}) on dp rank {t.dp_rank}: {exc!r}") from exc
                log.warning("destroy_collective_group(%s) on dp rank %s could not start: %r", group_name, t.dp_rank, exc)
    if ok:
        if host is not None:
            host.close(clean=True)
        wait_all(calls, timeout_s, f"destroy_collective_group({group_name})")
        return
    try:
        wait_all(calls, timeout_s, f"destroy_collective_group({group_name}) after a failed sync")
    except Exception as exc:
        log.warning("receiver teardown after a failed sync: %s", exc)
