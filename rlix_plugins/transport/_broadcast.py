"""``broadcast`` transport: a process group created for ONE sync and destroyed after it.

NCCL on GPU, gloo on CPU. Groups are *stateless* (``ProcessGroupNCCL/Gloo`` built on a
``PrefixStore`` over a ``TCPStore``): they never touch ``torch.distributed``'s default group, which
vLLM workers and Megatron already own.

Lifecycle (sender = rank 0, hosts the TCPStore on a free port of the rendezvous address only: the sender's node
IP, ``_place.rendezvous_address``)::

    sender: GroupHost(...)  -> port        receivers: (wait for the port in the setup RPC)
    sender: join(world)  ||  receivers: setup_collective_group(name, addr, port, rank, world, ...)
            (receivers count themselves in the store; the sender waits for all of them, watching for a receiver
            whose call failed, then both sides build the group: warm-up broadcast of one element from rank 0)
    per bucket: receivers broadcast_parameter(...)  ||  sender broadcast(buf)
    sender: close()  ->  receivers: destroy_collective_group(name)

Lockstep: every rank calls ``broadcast`` once per bucket in the same bucket order. Ownership: the
receiver registry (``_GROUPS``) is per process; a group name is unique per sync (uuid), so a stale
group from a failed sync never collides with the next one. Destroying a group this process never
joined is a no-op. Teardown is local on every rank: NCCL groups are aborted (``ncclCommAbort``)
after the last barrier, gloo groups shut down; ``ProcessGroupNCCL.shutdown()`` is NOT used because
its finalize waits for every peer and deadlocks the sender-first order (seen on 2x H200, torch 2.11).
Measured there: NCCL setup (rendezvous + communicator init + warm-up) ~0.19 s; the abort ~0.5 s, which
runs in the background after a successful sync (``wait_for_teardowns`` waits for it).
Hazard: NCCL's watchdog may kill a process whose collective exceeds the group
timeout when ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` is 1 or 3 (torch's default); callers that must
survive a dead peer set it to 2 before the first NCCL group is created.
"""

from __future__ import annotations

import atexit
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from rlix_plugins.errors import RlixConfigError, TransportError
from rlix_plugins.transport._bucket import BucketMeta, unpack_bucket
from rlix_plugins.transport._memory import DEFAULT_SCRATCH_BYTES, check_device_capacity

log = logging.getLogger(__name__)

BACKENDS: tuple[str, ...] = ("nccl", "gloo")


@dataclass
class _Group:
    name: str
    backend: str
    rank: int
    world_size: int
    device: torch.device
    timeout_s: float
    pg: Any
    store: Any


#: counter in a group's store: receivers that reached it (``GroupHost.join`` waits for all before its rendezvous)
_ARRIVED_KEY = "rlix_arrived"

_GROUPS: dict[str, _Group] = {}
_GROUPS_LOCK = threading.Lock()


def comm_device(backend: str, device: torch.device | str | None) -> torch.device:
    """The device a backend moves bytes on: CPU for gloo, the given (or current) CUDA device for NCCL."""
    if backend not in BACKENDS:
        raise RlixConfigError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "gloo":
        return torch.device("cpu")
    dev = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if dev.type != "cuda":
        raise RlixConfigError(f"backend 'nccl' needs a CUDA device, got {dev}; use backend='gloo' on CPU")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _new_pg(store: Any, rank: int, world_size: int, backend: str, timeout_s: float) -> Any:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, world_size, opts)


def _start_broadcast(pg: Any, tensor: torch.Tensor) -> Any:
    try:
        return pg.broadcast(tensor, 0)
    except TypeError:  # builds whose backends only bind broadcast(tensors, opts)
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return pg.broadcast([tensor], opts)


def _broadcast(pg: Any, tensor: torch.Tensor, timeout_s: float) -> None:
    """Broadcast from rank 0; returns when this rank's part is complete (CPU-side), or raises."""
    if tensor.device.type == "cuda":
        with torch.cuda.device(tensor.device):
            work = _start_broadcast(pg, tensor)
            work.wait(timedelta(seconds=timeout_s))
            torch.cuda.current_stream(tensor.device).synchronize()
    else:
        _start_broadcast(pg, tensor).wait(timedelta(seconds=timeout_s))


def _detached(exc: BaseException) -> BaseException:
    """``exc`` without its traceback. Hazard: a traceback keeps every frame's locals alive, and the
    frames of a failed collective hold the process group, whose store keeps the TCP port bound for as
    long as the caller keeps the error (pytest, a log record, a Ray error). Chain the detached cause."""
    return exc.with_traceback(None)


def _warm_up(pg: Any, rank: int, device: torch.device, timeout_s: float, name: str) -> None:
    probe = torch.full((1,), 1 if rank == 0 else 0, dtype=torch.int32, device=device)
    _broadcast(pg, probe, timeout_s)
    if int(probe.item()) != 1:
        raise TransportError(f"group {name!r}: warm-up broadcast delivered {int(probe.item())}, expected 1")


def _release_pg(pg: Any, backend: str, device: torch.device, *, clean: bool) -> None:
    """Shut a group down; ``clean=False`` aborts (peers may be dead or mid-collective)."""
    try:
        if backend == "nccl" and clean:
            torch.cuda.synchronize(device)
        # NCCL: always abort (local, like ncclCommDestroy). shutdown() finalizes collectively and
        # blocks until every peer finalizes too, which deadlocks "sender first, then receivers".
        name = "shutdown" if clean and backend != "nccl" else "abort"
        method = getattr(pg, name, None) or getattr(pg, "abort", None)
        if method is not None:
            method()
    except Exception as exc:  # teardown must never mask the error that brought us here
        log.warning("process group teardown (%s, clean=%s) raised %r", backend, clean, exc)


# NCCL communicator teardown (``ncclCommAbort`` through ``ProcessGroupNCCL.abort``) took ~0.5 s per rank on
# 2x H200 (NCCL 2.28), on the critical path of every expand and in-flight refresh. After a successful sync no
# collective is in flight, so it runs on a background thread and the sync returns at once; the group is already
# out of the registry (its name is unique per sync), and its TCPStore port closes when the thread drops it.
# Failure paths still tear down inline (peers may be stuck mid-collective).
_TEARDOWNS: list[threading.Thread] = []
_TEARDOWNS_LOCK = threading.Lock()


def _release_in_background(pg: Any, backend: str, device: torch.device) -> None:
    holder = [pg]

    def run() -> None:
        _release_pg(holder[0], backend, device, clean=True)
        holder.clear()  # last reference: the group (and the store it holds) is freed on this thread

    thread = threading.Thread(target=run, name="rlix-group-teardown", daemon=True)
    with _TEARDOWNS_LOCK:
        _TEARDOWNS[:] = [t for t in _TEARDOWNS if t.is_alive()]
        _TEARDOWNS.append(thread)
    thread.start()


def wait_for_teardowns(timeout_s: float = 30.0) -> bool:
    """Block until this process's background group teardowns finished (their GPU memory and ports are free);
    False if some are still running after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    with _TEARDOWNS_LOCK:
        pending = list(_TEARDOWNS)
    for thread in pending:
        thread.join(max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in pending)


atexit.register(wait_for_teardowns, 10.0)


def _release(pg: Any, backend: str, device: torch.device, *, clean: bool) -> None:
    """Clean NCCL teardown in the background (see above); everything else inline."""
    if clean and backend == "nccl":
        _release_in_background(pg, backend, device)
    else:
        _release_pg(pg, backend, device, clean=clean)


# ---------------------------------------------------------------------------------------------
# receiver side (called inside receiver processes, e.g. by the vLLM worker extension)
# ---------------------------------------------------------------------------------------------


def _probe(group_name: str, addr: str, port: int, timeout_s: float) -> None:
    """The sender's store listens before any receiver is asked to join, so a refused connection means the address is
    wrong (a receiver on another node dialing its own loopback) or the sender is gone: fail at once, not after
    TCPStore's retries (about twice ``timeout_s``)."""
    try:
        with socket.create_connection((addr, port), timeout=timeout_s):
            pass
    except OSError as exc:
        raise TransportError(
            f"could not join group {group_name!r} at {addr}:{port}: {exc.strerror or exc!r}; nothing of the sender "
            "listens there: the rendezvous address is not the sender's node IP as seen from this node, or the sender "
            "is gone"
        ) from None


def setup_collective_group(
    group_name: str,
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float,
    device: torch.device | str | None = None,
) -> None:
    """Join the per-sync group ``group_name`` as ``rank`` (>= 1; rank 0 is the sender).

    Blocks until every rank joined and the warm-up broadcast arrived, at most ~``timeout_s``.
    A leftover group of the same name (a failed sync whose destroy never came) is destroyed first.
    On failure nothing is registered and ``TransportError`` says what to check.
    """
    if not 1 <= rank < world_size:
        raise RlixConfigError(f"receiver rank must be in [1, {world_size}), got {rank} (rank 0 is the sender)")
    dev = comm_device(backend, device)
    destroy_collective_group(group_name)
    _probe(group_name, master_addr, int(master_port), timeout_s)
    store = pg = None
    try:
        store = dist.TCPStore(
            master_addr, int(master_port), None, False, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        prefixed = dist.PrefixStore(group_name, store)
        prefixed.add(_ARRIVED_KEY, 1)  # the sender starts its part of the rendezvous once every receiver is here
        pg = _new_pg(prefixed, rank, world_size, backend, timeout_s)
        _warm_up(pg, rank, dev, timeout_s, group_name)
    except Exception as exc:
        if pg is not None:
            _release_pg(pg, backend, dev, clean=False)
        pg = store = None
        raise TransportError(
            f"could not join group {group_name!r} at {master_addr}:{master_port} as rank {rank}/{world_size} "
            f"({backend}) within {timeout_s:.0f} s: {exc}; the sender may have failed, or the port is not reachable"
        ) from _detached(exc)
    with _GROUPS_LOCK:
        _GROUPS[group_name] = _Group(group_name, backend, rank, world_size, dev, float(timeout_s), pg, store)


def broadcast_parameter(
    group_name: str,
    bucket_meta: dict[str, Any] | BucketMeta,
    device: torch.device | str | None = None,
    *,
    scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
) -> list[tuple[str, torch.Tensor]]:
    """Receive one bucket over ``group_name``; ``(name, tensor)`` views of one fresh buffer.

    The buffer is allocated on the group's device (CPU for gloo) after a free-memory check and
    moved to ``device`` when that differs. The caller owns the result (it may drop it after loading).
    """
    with _GROUPS_LOCK:
        group = _GROUPS.get(group_name)
    if group is None:
        raise TransportError(
            f"broadcast_parameter: this process has no group {group_name!r} (known: {sorted(_GROUPS)}); "
            "setup_collective_group must succeed first"
        )
    meta = BucketMeta.from_wire(bucket_meta)
    check_device_capacity(meta.used_bytes, group.device, scratch_bytes=scratch_bytes, what=f"bucket {meta.index}",
                          largest=meta.largest())
    buffer = torch.empty(meta.used_bytes, dtype=torch.uint8, device=group.device)
    if meta.used_bytes:
        try:
            _broadcast(group.pg, buffer, group.timeout_s)
        except Exception as exc:
            raise TransportError(
                f"group {group_name!r}: receiving bucket {meta.index} ({meta.used_bytes} bytes) failed: {exc!r}"
            ) from _detached(exc)
    out_dev = torch.device(device) if device is not None else group.device
    if out_dev != group.device:
        buffer = buffer.to(out_dev)
    return unpack_bucket(meta, buffer)


def destroy_collective_group(group_name: str) -> bool:
    """Leave and free ``group_name``; a no-op returning False when this process never joined it."""
    with _GROUPS_LOCK:
        group = _GROUPS.pop(group_name, None)
    if group is None:
        return False
    pg, group.pg, group.store = group.pg, None, None
    _release(pg, group.backend, group.device, clean=True)
    return True


def group_names() -> list[str]:
    """Names of the groups this process holds now (diagnostics and leak tests)."""
    with _GROUPS_LOCK:
        return sorted(_GROUPS)


# ---------------------------------------------------------------------------------------------
# sender side (rank 0)
# ---------------------------------------------------------------------------------------------


def _listen(addr: str) -> int:
    """A listening TCP socket on ``addr`` (a free port), as a descriptor the caller owns."""
    try:
        family, kind, proto, _, sockaddr = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise RlixConfigError(f"weight broadcast rendezvous address {addr!r} does not resolve: {exc}") from exc
    try:
        # as TCPStore's own server does: its accepted connections' TIME_WAIT must not block a later bind of the port
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(512)
    except OSError as exc:
        sock.close()
        raise RlixConfigError(
            f"weight broadcast: cannot listen on {addr} ({exc.strerror}); the rendezvous address must be an address "
            "of the sender's own node (its Ray node IP)"
        ) from exc
    return sock.detach()


class GroupHost:
    """Rank 0 of one per-sync group: owns the TCPStore (a free port) and the sender's process group.

    ``GroupHost(...)`` -> ``.port`` -> ``join(world_size)`` -> ``broadcast(buf)`` per bucket -> ``close(clean)``.
    ``close`` is idempotent and releases the port; always call it (``try/finally``).
    """

    def __init__(self, group_name: str, backend: str, device: torch.device | str | None, timeout_s: float, master_addr: str) -> None:
        self.name = group_name
        self.backend = backend
        self.device = comm_device(backend, device)
        self.timeout_s = float(timeout_s)
        self._pg: Any = None
        self.master_addr = master_addr
        # TCPStore's own server listens on every interface whatever host it is given; a socket bound to the
        # rendezvous address alone means a receiver told another address fails instead of meeting it by accident
        # (and the store is not exposed on interfaces nobody uses). The store takes the descriptor over.
        self._store: Any = dist.TCPStore(
            master_addr, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False,
            master_listen_fd=_listen(master_addr),
        )
        self.port = int(self._store.port)

    def join(self, world_size: int, failed: Callable[[], str] | None = None) -> None:
        """Build the group as rank 0 and run the warm-up; blocks until all ranks joined (bounded).

        ``failed`` (what has gone wrong on the receivers' side so far, "" while nothing has) is asked while the
        receivers arrive: a receiver that cannot come (its engine died) fails the join at once, not after
        ``timeout_s`` (the group's own rendezvous cannot be interrupted)."""
        missing = self._await_arrivals(world_size - 1, failed)
        if missing:  # raised here, not in the wait: no frame of this error may hold the store (its port stays bound)
            raise TransportError(missing)
        try:
            self._pg = _new_pg(dist.PrefixStore(self.name, self._store), 0, world_size, self.backend, self.timeout_s)
            _warm_up(self._pg, 0, self.device, self.timeout_s, self.name)
        except Exception as exc:
            raise TransportError(
                f"group {self.name!r} ({self.backend}, world {world_size}, at {self.master_addr}:{self.port}): not "
                f"every receiver joined within {self.timeout_s:.0f} s: {exc}"
            ) from _detached(exc)

    def _await_arrivals(self, receivers: int, failed: Callable[[], str] | None) -> str:
        """"" once ``receivers`` receivers reached the store, else what went wrong (a failure, or the bound)."""
        # The key as the receivers' PrefixStore names it. No local may hold the store: the receivers' errors that
        # ``failed`` catches keep their frames, this one among them, and a store kept alive keeps its port bound.
        key = f"{self.name}/{_ARRIVED_KEY}"
        deadline = time.monotonic() + self.timeout_s
        pause = 0.001
        while (arrived := int(self._store.add(key, 0))) < receivers:
            why = failed() if failed is not None else ""
            if why or time.monotonic() > deadline:
                return (f"group {self.name!r} ({self.backend}, at {self.master_addr}:{self.port}): {arrived} of "
                        f"{receivers} receivers arrived" + (f"; {why}" if why else f" within {self.timeout_s:.0f} s"))
            time.sleep(pause)
            pause = min(pause * 2, 0.02)
        return ""

    def broadcast(self, buffer: torch.Tensor) -> None:
        if self._pg is None:
            raise TransportError(f"group {self.name!r}: broadcast before join")
        if buffer.numel():
            try:
                _broadcast(self._pg, buffer, self.timeout_s)
            except Exception as exc:
                raise TransportError(f"group {self.name!r}: sender broadcast failed: {exc!r}") from _detached(exc)

    def close(self, *, clean: bool) -> None:
        pg, self._pg = self._pg, None
        if pg is not None:
            _release(pg, self.backend, self.device, clean=clean)
        del pg
        self._store = None  # last reference: the store's listening socket closes here
