"""``host_pull`` transport: receivers copy straight from the sender's pinned cache pages.

The cache's buffers live in anonymous shared memory (``memfd``), pinned once in the sender with
``cudaHostRegister``. A receiver on the same machine opens a buffer through ``/proc/<pid>/fd/<fd>``,
maps it and pins it in its own process - once per buffer (at prewarm or the first sync), then reused
for every later version; a buffer the cache replaces by a larger one is a new buffer, mapped anew while the
old mapping is dropped - and copies host -> its own GPU. Per sync no bytes cross a pipe, no sender
GPU staging, no IPC handle and no collective group exist: the payload is metadata only and the copy
runs at the raw pinned host-to-device speed (measured on an H100: 54.5 GB/s from the mapped pages,
54.6 GB/s from a ``cudaHostAlloc`` buffer).

Payload (plain dict, msgpack-safe)::

    {"transport": "host_pull", "buckets": [{"meta": BucketMeta.to_wire(), "host": handle}, ...]}

``handle`` = ``{"boot_id", "pid", "fd", "inode", "nbytes"}`` names one cache buffer. Lockstep: the
receiver must have finished reading (its host->device copies complete) before its RPC returns; the
sender holds the cache lock until then, so no build can rewrite the pages mid-read.

Needs sender and receiver on one machine, as one user (``/proc`` access). Elsewhere: ``cuda_ipc`` or
the broadcast path.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import uuid
import weakref
from collections.abc import Sequence
from typing import Any, Final

import torch

from rlix_plugins.errors import TransportError
from rlix_plugins.transport._bucket import BucketMeta, BucketRecord
from rlix_plugins.transport._same_gpu import SyncTransport

TRANSPORT: Final = "host_pull"
log = logging.getLogger(__name__)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as fh:
            return fh.read().strip()
    except OSError:
        return "unknown"


BOOT_ID: Final = _boot_id()


def _register(tensor: torch.Tensor, what: str) -> bool:
    """Pin ``tensor``'s pages for DMA (``cudaHostRegister``); False when CUDA is absent."""
    if not torch.cuda.is_available() or tensor.numel() == 0:
        return False
    rc = torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), tensor.numel(), 0)
    code = rc[0] if isinstance(rc, tuple) else rc
    if int(code) != 0:
        raise TransportError(f"{what}: cudaHostRegister of {tensor.numel()} bytes failed with CUDA error {int(code)}")
    return True


def _unregister_ptr(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _unregister(tensor: torch.Tensor) -> None:
    _unregister_ptr(tensor.data_ptr())


class SharedHostBuffer:
    """One cache buffer in shared memory: ``tensor`` (1-D uint8) plus the handle receivers open it by."""

    def __init__(self, nbytes: int, *, pin: bool) -> None:
        self.fd = os.memfd_create(f"rlix-cache-{uuid.uuid4().hex[:8]}")
        try:
            os.ftruncate(self.fd, nbytes)
            self._map = mmap.mmap(self.fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)
        self.pinned = _register(self.tensor, "bucket cache buffer") if pin else False
        # A registration must end before its pages are unmapped (even when the cache is dropped without close()):
        # the next mapping at the same address would fail to register ("already mapped", CUDA error 712).
        self._unpin = weakref.finalize(self, _unregister_ptr, self.tensor.data_ptr()) if self.pinned else None
        self.handle: dict[str, Any] = {
            "boot_id": BOOT_ID, "pid": os.getpid(), "fd": self.fd, "inode": os.fstat(self.fd).st_ino, "nbytes": nbytes,
        }

    def close(self) -> None:
        """Unpin and unmap; pages live on while a receiver still maps them (it drops stale maps)."""
        if self._unpin is not None:
            self._unpin()
            self.pinned = False
        del self.tensor
        try:
            self._map.close()
        except BufferError:  # a view is still referenced somewhere: the GC unmaps it with the last one
            log.debug("shared cache buffer still referenced at close; it is unmapped when released")
        os.close(self.fd)


def make_host_pull_payload(records: list[BucketRecord], *, deferred: bool = False,
                           overlaps_wake: bool = False) -> dict[str, Any]:
    """Sender side: the metadata of every bucket (each record's buffer must be a shared host buffer). ``deferred``:
    a receiver may return once its copies are queued; the sender then waits on its ``finish`` call before it lets
    go of the pages. ``overlaps_wake``: the receiving engine wakes memory while the reads run (an expand), so a
    receiver reads with its SMs rather than a copy engine (:func:`device_view`)."""
    missing = [r.meta.index for r in records if r.host is None]
    if missing:
        raise TransportError(
            f"host_pull needs the cache in shared host memory, buckets {missing} are not; build the cache with "
            "shared=True (the default on Linux) or use same_gpu_transport='cuda_ipc'"
        )
    return {"transport": TRANSPORT, "buckets": [{"meta": r.meta.to_wire(), "host": r.host} for r in records],
            "deferred": deferred, "overlaps_wake": overlaps_wake}


def device_view(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CUDA tensor over pinned host pages (their unified virtual address, no copy): a kernel reading it pulls the
    bytes over PCIe with the SMs instead of a copy engine. Why: for ~0.1-0.3 s after GPU memory is released or mapped
    (a sleep, a wake) something outside every process - most likely the driver's work on that memory - shares the copy
    engines: copy-engine host->device copies from any process run at half the link (H200: 29.5 vs 55 GB/s) while SM
    reads keep ~50 GB/s (``benchmarks/results/h200-2026-11-26-sm-reads/``). ``host`` must stay mapped and pinned
    while it is read."""

    class _Pages:
        __cuda_array_interface__ = {"shape": (host.numel(),), "typestr": "|u1", "data": (host.data_ptr(), False),
                                    "version": 3, "strides": None}

    view = torch.as_tensor(_Pages(), device=device)
    if view.data_ptr() != host.data_ptr():  # torch copied them: pages registered while another device was current
        raise TransportError(f"device_view: the pinned pages at {host.data_ptr():#x} are not addressable from "
                             f"{device} in place; register them with {device} current, or copy with a copy engine")
    return view


class _Mapped:
    def __init__(self, tensor: torch.Tensor, mapping: mmap.mmap, pinned: bool) -> None:
        self.tensor, self.mapping, self.pinned = tensor, mapping, pinned


_maps: dict[tuple[str, int, int, int], _Mapped] = {}
_maps_lock = threading.Lock()


def _key(handle: dict[str, Any]) -> tuple[str, int, int, int]:
    return (str(handle["boot_id"]), int(handle["pid"]), int(handle["fd"]), int(handle["inode"]))


def map_host_buffer(handle: dict[str, Any], *, pin: bool) -> torch.Tensor:
    """Receiver side: the sender's buffer as a uint8 CPU tensor, mapped (and pinned when ``pin``) once per
    process and reused by every later sync."""
    key = _key(handle)
    with _maps_lock:
        found = _maps.get(key)
        if found is not None:
            if pin and not found.pinned:
                found.pinned = _register(found.tensor, "host_pull receive mapping")
            return found.tensor
        if key[0] != BOOT_ID:
            raise TransportError(
                "host_pull: the sender runs on another machine (boot id differs); host_pull works only for a "
                "receiver on the sender's machine: use same_gpu_transport='cuda_ipc' or the broadcast path"
            )
        path = f"/proc/{key[1]}/fd/{key[2]}"
        try:
            fd = os.open(path, os.O_RDWR)  # read-write: cudaHostRegister of read-only pages needs a newer driver
        except OSError as exc:
            raise TransportError(
                f"host_pull: cannot open the sender's cache buffer {path} ({exc.strerror}); the sender process is "
                "gone, or runs as another user / in another PID namespace: use same_gpu_transport='cuda_ipc'"
            ) from exc
        try:
            if os.fstat(fd).st_ino != key[3]:
                raise TransportError(f"host_pull: {path} is not the cache buffer the sender named (inode differs)")
            mapping = mmap.mmap(fd, int(handle["nbytes"]), mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # never written here
        _forget_dead_senders(keep_pid=key[1])
        _maps[key] = _Mapped(tensor, mapping, _register(tensor, "host_pull receive mapping") if pin else False)
        return tensor


def _forget_dead_senders(keep_pid: int) -> None:
    """Unmap buffers of senders that exited (their pages stay alive while we map them)."""
    for key in [k for k in _maps if k[1] != keep_pid and not os.path.exists(f"/proc/{k[1]}")]:
        _unmap(_maps.pop(key))


def _unmap(found: _Mapped) -> None:
    if found.pinned:
        _unregister(found.tensor)
    del found.tensor
    try:
        found.mapping.close()
    except BufferError:
        log.debug("host_pull mapping still referenced; unmapped when released")


def open_host_pull(payload: dict[str, Any], *, pin: bool = False) -> list[tuple[BucketMeta, torch.Tensor]]:
    """A ``host_pull`` payload -> per bucket its metadata and its ``used_bytes`` as a CPU view of the sender's
    pages (zero-copy; valid while the sender holds the cache lock, i.e. until the RPC returns). Buffers of
    the same sender that the payload no longer names (a closed cache) are unmapped."""
    if payload.get("transport") != TRANSPORT:
        raise TransportError(f"expected a {TRANSPORT!r} payload, got transport={payload.get('transport')!r}")
    buckets = payload["buckets"]
    _forget_stale({_key(b["host"]) for b in buckets})
    out = []
    for bucket in buckets:
        meta = BucketMeta.from_wire(bucket["meta"])
        host = map_host_buffer(bucket["host"], pin=pin)
        if host.numel() < meta.used_bytes:
            raise TransportError(
                f"host_pull bucket {meta.index}: buffer of {host.numel()} bytes < used_bytes {meta.used_bytes}"
            )
        out.append((meta, host[: meta.used_bytes]))
    return out


def _forget_stale(current: set[tuple[str, int, int, int]]) -> None:
    pids = {k[1] for k in current}
    with _maps_lock:
        for key in [k for k in _maps if k[1] in pids and k not in current]:
            _unmap(_maps.pop(key))


class HostPull(SyncTransport):
    """Every bucket's metadata and shared-buffer handle in one payload; receivers read the pinned pages."""

    name = TRANSPORT

    def payload(self, records: Sequence[BucketRecord], *, deferred: bool = False,
                overlaps_wake: bool = False) -> dict[str, Any]:
        return make_host_pull_payload(list(records), deferred=deferred, overlaps_wake=overlaps_wake)
