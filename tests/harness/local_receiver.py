"""``SubprocessReceiver``: a ``ReceiverEndpoint`` whose workers are spawned local processes.

The reference endpoint for tests and benchmarks (the vLLM extension is the production one; test harness, not in
the package: see :mod:`tests.harness`): one process per local rank, each a tiny "model" that loads received tensors
into persistent parameters (``param.copy_(received)``, like vLLM's ``load_weights``) and records their checksums.
A host_pull bucket lands in one copy instead: this model owns its parameter storage, so the parameters of a bucket
layout are views of one buffer laid out like the bucket (the vLLM receiver, which does not own its storage, copies
each parameter's byte range; ``benchmarks/expand.py`` measures that path).

Calls to one worker run in order on one thread (like a Ray actor); calls to different workers and
endpoints overlap, which the broadcast needs. A dead worker fails its pending call promptly
(``TransportError``) instead of hanging. ``close()`` always ends the processes.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import signal
import threading
import traceback
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from rlix_plugins.errors import TransportError

#: Upper bound on any single call to a worker; the sender's own timeouts are usually shorter.
CALL_LIMIT_S = 900.0


def _gather(futures: list[Future[Any]]) -> Future[list[Any]]:
    """One future that completes when all complete (first exception wins)."""
    out: Future[list[Any]] = Future()
    results: list[Any] = [None] * len(futures)
    left = [len(futures)]
    lock = threading.Lock()

    def done(i: int, fut: Future[Any]) -> None:
        with lock:
            if out.done():
                return
            exc = fut.exception()
            if exc is not None:
                out.set_exception(exc)
                return
            results[i] = fut.result()
            left[0] -= 1
            if left[0] == 0:
                out.set_result(results)

    if not futures:
        out.set_result([])
    for i, fut in enumerate(futures):
        fut.add_done_callback(functools.partial(done, i))
    return out


def _on_every_worker(method: str) -> Callable[..., Future[list[Any]]]:
    """An endpoint method: ``method`` with the caller's arguments on every worker (``SubprocessReceiver.call_all``);
    the signatures are ``transport.ReceiverEndpoint``'s."""

    def start(self: SubprocessReceiver, *args: Any) -> Future[list[Any]]:
        return self.call_all(method, *args)

    start.__name__ = start.__qualname__ = method
    return start


class SubprocessReceiver:
    """One DP rank served by ``len(devices)`` spawned worker processes (local rank = index)."""

    def __init__(self, devices: Sequence[str] = ("cpu",), *, checksums: bool = True, start_timeout_s: float = 120.0) -> None:
        ctx = mp.get_context("spawn")
        self.devices = list(devices)
        self._conns: list[Any] = []
        self._procs: list[Any] = []
        self._pools: list[ThreadPoolExecutor] = []
        self._send_locks: list[threading.Lock] = []
        for local_rank, device in enumerate(self.devices):
            parent, child = ctx.Pipe()
            proc = ctx.Process(
                target=_worker_main, args=(child, local_rank, device, checksums), daemon=True, name=f"rlix-recv-{local_rank}"
            )
            proc.start()
            child.close()
            self._conns.append(parent)
            self._procs.append(proc)
            self._pools.append(ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"rlix-recv-{local_rank}"))
            self._send_locks.append(threading.Lock())
        for i in range(len(self.devices)):
            self._recv(i, start_timeout_s)

    # -- plumbing ----------------------------------------------------------------------------

    @property
    def pids(self) -> list[int]:
        return [int(p.pid) for p in self._procs]

    def _recv(self, i: int, limit_s: float) -> Any:
        conn, proc = self._conns[i], self._procs[i]
        waited = 0.0
        while not conn.poll(0.1):
            waited += 0.1
            if not proc.is_alive():
                raise TransportError(f"receiver worker {i} (pid {proc.pid}) exited with code {proc.exitcode}")
            if waited > limit_s:
                raise TransportError(f"receiver worker {i} (pid {proc.pid}) did not answer within {limit_s:.0f} s")
        try:
            status, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise TransportError(f"receiver worker {i} (pid {proc.pid}) closed its pipe: {exc!r}") from exc
        if status == "ok":
            return value
        exc_obj = None
        with contextlib.suppress(Exception):
            exc_obj = pickle.loads(value[0])
        if isinstance(exc_obj, BaseException):
            raise exc_obj
        raise TransportError(f"receiver worker {i} raised: {value[1]}")

    def call_worker(self, i: int, method: str, *args: Any) -> Future[Any]:
        """Send the request NOW (in the caller's thread), wait for the reply on the worker's thread.

        Hazard: dispatching from a helper thread instead would let a sender that blocks right
        after (in a collective that may hold the GIL) starve the very request its peer waits for.
        Replies come back in request order, and one thread per worker reads them in that order.
        """
        with self._send_locks[i]:
            try:
                self._conns[i].send((method, args))
            except (OSError, ValueError) as exc:
                failed: Future[Any] = Future()
                failed.set_exception(TransportError(f"receiver worker {i} is gone: {exc!r}"))
                return failed
            return self._pools[i].submit(self._recv, i, CALL_LIMIT_S)

    def call_all(self, method: str, *args: Any) -> Future[list[Any]]:
        return _gather([self.call_worker(i, method, *args) for i in range(len(self.devices))])

    # -- ReceiverEndpoint: each method starts the worker method of its name with its arguments -------------

    setup_collective_group = _on_every_worker("setup_collective_group")
    update_parameter_in_bucket = _on_every_worker("update_parameter_in_bucket")
    broadcast_parameter = _on_every_worker("broadcast_parameter")
    destroy_collective_group = _on_every_worker("destroy_collective_group")
    verify_model = _on_every_worker("verify_model")
    report_places = _on_every_worker("report_place")

    # -- lifetime ----------------------------------------------------------------------------

    def alive(self) -> bool:
        return all(p.is_alive() for p in self._procs)

    def close(self, timeout_s: float = 10.0) -> None:
        for conn in self._conns:
            with contextlib.suppress(Exception):
                conn.send(("exit", ()))
        for proc in self._procs:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
                proc.join(timeout_s)
        for pool in self._pools:
            pool.shutdown(wait=False, cancel_futures=True)
        for conn in self._conns:
            conn.close()


# ---------------------------------------------------------------------------------------------
# worker process
# ---------------------------------------------------------------------------------------------


class _Worker:
    def __init__(self, local_rank: int, device: str, checksums: bool) -> None:
        import torch

        self.torch = torch
        torch.set_num_threads(1)
        self.local_rank = local_rank
        self.device = torch.device(device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.use_checksums = checksums
        self.params: dict[str, Any] = {}
        #: host_pull: bucket layout -> the buffer whose views are that layout's parameters
        self.bucket_storage: dict[tuple[Any, ...], Any] = {}
        self.checksums: dict[str, list[int]] = {}
        self.faults: dict[str, int] = {}
        self.calls: dict[str, int] = {}

    def _load(self, named: list[tuple[str, Any]]) -> int:
        """Copy into persistent parameters and checksum them; returns once the copies landed."""
        from rlix_plugins.transport import finish_checksums, start_checksums

        on_gpu = self.device.type == "cuda"
        params = []
        for name, tensor in named:
            param = self.params.get(name)
            if param is None or param.shape != tensor.shape or param.dtype != tensor.dtype:
                param = self.params[name] = self.torch.empty_like(tensor, device=self.device)
            param.copy_(tensor, non_blocking=on_gpu)
            params.append(param)
        if self.use_checksums:
            sums = finish_checksums([p.numel() * p.element_size() for p in params], start_checksums(params))
            self.checksums.update(zip((n for n, _ in named), sums, strict=True))
        if on_gpu:
            self.torch.cuda.current_stream(self.device).synchronize()
        return len(named)

    def _land_bucket(self, meta: Any, host: Any) -> int:
        """A host_pull bucket into its layout's buffer in one copy (asynchronous from pinned pages on a GPU)."""
        from rlix_plugins.transport import bucket_checksums, finish_checksums, unpack_bucket

        key = (meta.names, meta.offsets, meta.dtypes, meta.shapes)
        flat = self.bucket_storage.get(key)
        if flat is None:  # a new layout: its names' parameters move into a buffer of their own
            for stale in [k for k in self.bucket_storage if set(k[0]) & set(meta.names)]:
                del self.bucket_storage[stale]
            flat = self.bucket_storage[key] = self.torch.empty(meta.used_bytes, dtype=self.torch.uint8, device=self.device)
            self.params.update(unpack_bucket(meta, flat))
        flat.copy_(host[: meta.used_bytes], non_blocking=self.device.type == "cuda")
        if self.use_checksums:
            nbytes = [meta.nbytes(k) for k in range(len(meta.names))]
            sums = finish_checksums(nbytes, bucket_checksums(flat, list(meta.offsets), nbytes))
            self.checksums.update(zip(meta.names, sums, strict=True))
        return len(meta.names)

    def setup_collective_group(self, name: str, addr: str, port: int, ranks: dict[Any, int], world: int, backend: str, timeout_s: float) -> bool:
        from rlix_plugins.transport import setup_collective_group

        ranks = {int(k): int(v) for k, v in ranks.items()}
        if self.local_rank not in ranks:
            return False
        setup_collective_group(name, addr, port, ranks[self.local_rank], world, backend, timeout_s, device=self.device)
        return True

    def update_parameter_in_bucket(self, payload: dict[str, Any], ipc_local_ranks: list[int]) -> int:
        from rlix_plugins.transport import receive_bucket

        if self.local_rank not in ipc_local_ranks:
            return 0
        from rlix_plugins.transport import SyncTransport, same_gpu_transport

        if isinstance(same_gpu_transport(str(payload.get("transport"))), SyncTransport):  # host_pull: every bucket
            from rlix_plugins.transport import open_host_pull

            count = 0
            for meta, host in open_host_pull(payload, pin=self.device.type == "cuda"):  # every bucket in one call
                count += self._land_bucket(meta, host)
            if self.device.type == "cuda":
                self.torch.cuda.current_stream(self.device).synchronize()  # every host read done before returning
            return count
        named = receive_bucket(payload, self.device)
        n = self._load(named)
        del named  # cuda_ipc views must be dropped before the RPC returns
        return n

    def broadcast_parameter(self, name: str, meta: dict[str, Any], local_ranks: list[int]) -> int:
        from rlix_plugins.transport import broadcast_parameter

        if self.local_rank not in local_ranks:
            return 0
        return self._load(broadcast_parameter(name, meta, self.device))

    def raw_broadcast(self, name: str, nbytes: int) -> int:
        """Receive one flat buffer over ``name`` without loading it (benchmark baseline)."""
        from rlix_plugins.transport import BucketMeta, broadcast_parameter

        meta = BucketMeta(names=("flat",), shapes=((nbytes,),), dtypes=("uint8",), offsets=(0,), used_bytes=nbytes)
        (_, flat), = broadcast_parameter(name, meta.to_wire(), self.device)
        del flat
        return nbytes

    def destroy_collective_group(self, name: str) -> bool:
        from rlix_plugins.transport import destroy_collective_group

        existed = destroy_collective_group(name)
        if self.device.type == "cuda":
            self.torch.cuda.empty_cache()
        return existed

    def report_place(self) -> dict[str, Any]:
        """Where this worker runs (its node from Ray's env handed down by a Ray parent, else the machine)."""
        from rlix_plugins.transport import local_place

        return local_place(self.device).to_wire()

    def verify_model(self, expected: dict[str, list[int]]) -> bool:
        from rlix_plugins.transport import verify_checksums

        verify_checksums(expected, self.checksums, context=f"local rank {self.local_rank}")
        return True

    # -- test hooks --------------------------------------------------------------------------

    def fail_on(self, method: str, nth_call: int) -> bool:
        """Exit the process (simulated crash) on the ``nth_call``-th future call of ``method``."""
        self.faults[method] = self.calls.get(method, 0) + nth_call
        return True

    def state(self) -> dict[str, Any]:
        from rlix_plugins.transport import group_names

        info: dict[str, Any] = {"groups": group_names(), "num_params": len(self.params), "pid": os.getpid(),
                                "calls": dict(self.calls)}
        if self.device.type == "cuda":
            free, total = self.torch.cuda.mem_get_info(self.device)
            info.update(free=int(free), total=int(total), allocated=int(self.torch.cuda.memory_allocated(self.device)))
        return info

    def wait_for_teardowns(self, timeout_s: float = 30.0) -> bool:
        """This worker's background group teardowns finished (memory and ports released)."""
        from rlix_plugins.transport import wait_for_teardowns

        return wait_for_teardowns(timeout_s)

    def tensors(self) -> dict[str, tuple[str, list[int], bytes]]:
        from rlix_plugins.transport import dtype_to_str

        out = {}
        for name, t in self.params.items():
            raw = t.detach().cpu().contiguous().reshape(-1).view(self.torch.uint8)
            out[name] = (dtype_to_str(t.dtype), list(t.shape), raw.numpy().tobytes())
        return out

    def corrupt(self, name: str) -> bool:
        """Flip one bit of a loaded parameter and its recorded checksum source (verification tests)."""
        from rlix_plugins.transport import tensor_checksum

        raw = self.params[name].view(-1).view(self.torch.uint8)
        raw[0] ^= 1
        self.checksums[name] = tensor_checksum(self.params[name])
        return True


def _worker_main(conn: Any, local_rank: int, device: str, checksums: bool) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # `kill -USR1 <pid>` dumps a stuck worker's stacks
    worker = _Worker(local_rank, device, checksums)
    conn.send(("ok", None))
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        if method == "exit":
            return
        worker.calls[method] = worker.calls.get(method, 0) + 1
        if worker.faults.get(method) == worker.calls[method]:
            os._exit(3)  # simulated crash mid-sync
        try:
            conn.send(("ok", getattr(worker, method)(*args)))
        except BaseException as exc:
            try:
                blob = pickle.dumps(exc)
            except Exception:
                blob = b""
            conn.send(("err", (blob, f"{exc!r}\n{traceback.format_exc()}")))
