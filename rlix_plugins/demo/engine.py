"""Demo rollout ranks: one Ray actor per vLLM DP rank (real vLLM with the rlix receiver) and the fleet over them.

:class:`DemoEngine` owns ``vllm.LLM`` and drives its ``LLMEngine`` from ONE thread (``_loop``): requests are
added and stepped there, and every other engine call (weight-sync ``collective_rpc``, prefix-cache reset, sleep,
wake, abort) is queued to that thread and runs between two decode steps. So a weight refresh of an active
rank lands "in flight" without draining it, exactly one thread touches vLLM (it is not thread-safe), and an
abort finishes the caller's request itself (vLLM's ``abort_request`` never completes the request's output,
so the caller would hang).

:class:`DemoFleet` implements :class:`~rlix_plugins.pipeline.protocols.RolloutFleet` over those actors.
"""

from __future__ import annotations

import itertools
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Final

import ray

from rlix_plugins import envs
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError

__all__ = ["DemoEngine", "DemoFleet"]

_IDLE_WAIT_S: Final = 0.02


@dataclass
class _Request:
    future: Future[dict[str, Any]]
    outputs: list[list[int]] = field(default_factory=list)


def gpu_of_slot(visible: str | None, slot: int) -> str:
    """The ``CUDA_VISIBLE_DEVICES`` that shows a process only GPU ``slot`` of those its raylet sees: ``visible`` is
    the raylet's own list (a raylet started on GPUs 2,3 of its machine has slot 0 = GPU 2), None or empty when
    it saw every GPU (slot = the machine's index)."""
    if not visible:
        return str(slot)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if not 0 <= slot < len(ids):
        raise RlixConfigError(f"GPU {slot} of this node, but its raylet sees only CUDA_VISIBLE_DEVICES={visible!r}: "
                              "start the raylet with every GPU it declares to Ray visible")
    return ids[slot]


class DemoEngine:
    """One DP rank: one engine, of ``tensor_parallel_size`` workers (``llm_kwargs``). ``env`` is applied before vLLM
    is imported (e.g. ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). ``gpu_slots``: on GPUs, the index of each of its GPUs
    among those its raylet sees (the node table's local ids), in TP-rank order."""

    def __init__(self, dp_rank: int, llm_kwargs: dict[str, Any], env: dict[str, str] | None = None, *,
                 gpu_slots: Sequence[int] | None = None) -> None:
        """Imports vLLM (slow, touches no device); the engine itself is built by :meth:`load`."""
        env = dict(env or {})
        if gpu_slots is not None:
            visible = envs.cuda_visible_devices()
            env[envs.CUDA_VISIBLE_DEVICES] = ",".join(gpu_of_slot(visible, slot) for slot in gpu_slots)
        os.environ.update(env)
        import vllm  # noqa: F401

        self.dp_rank = dp_rank
        self._llm_kwargs = dict(llm_kwargs)
        self.llm: Any = None
        self.start_seconds = 0.0
        self._cmds: queue.Queue[tuple[Callable[[], Any], Future[Any]]] = queue.Queue()
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._sleeping = False
        self._stats = {"steps": 0, "requests": 0, "aborted": 0, "rpcs": 0}
        self._mem_log: list[dict[str, Any]] = []

    def load(self) -> float:
        """Build ``vllm.LLM`` (allocates weights and KV cache: call it while the rank's GPUs are granted)."""
        from vllm import LLM

        if self.llm is not None:
            return self.start_seconds
        from rlix_plugins.transport import export_node_env

        t0 = time.perf_counter()
        export_node_env()  # the engine core and its workers are child processes: they report this Ray node
        self.llm = LLM(**self._llm_kwargs)
        self.start_seconds = time.perf_counter() - t0
        self._engine = self.llm.llm_engine
        self._thread = threading.Thread(target=self._loop, name=f"rlix-engine-{self.dp_rank}", daemon=True)
        self._thread.start()
        return self.start_seconds

    # ------------------------------------------------------------------ engine thread
    def _loop(self) -> None:
        while True:
            try:
                fn, fut = self._cmds.get(timeout=_IDLE_WAIT_S if not self._requests else 0.0)
            except queue.Empty:
                fn = None
            if fn is not None:
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as exc:
                        fut.set_exception(exc)
                continue  # drain every queued command before the next step
            if self._requests:
                try:
                    outs = self._engine.step()
                except BaseException as exc:  # the engine died: fail every caller instead of hanging them
                    for req in self._requests.values():
                        req.future.set_exception(exc)
                    self._requests.clear()
                    continue
                self._stats["steps"] += 1
                for out in outs:
                    pending = self._requests.get(out.request_id)
                    if pending is not None and out.finished:
                        del self._requests[out.request_id]
                        pending.future.set_result({"tokens": [list(c.token_ids) for c in out.outputs], "aborted": False})

    def _run(self, fn: Callable[[], Any], timeout_s: float, what: str) -> Any:
        if self.llm is None:
            raise TransportError(f"engine dp{self.dp_rank}: {what} before load() built the engine")
        fut: Future[Any] = Future()
        self._cmds.put((fn, fut))
        try:
            return fut.result(timeout=timeout_s)
        except TimeoutError:
            fut.cancel()
            raise RlixTimeoutError(f"engine dp{self.dp_rank}: {what} did not run within {timeout_s:.0f} s") from None

    # ------------------------------------------------------------------ requests
    def generate(self, prompt_token_ids: list[int], n: int, max_tokens: int, temperature: float = 1.0,
                 seed: int | None = None, timeout_s: float = 120.0) -> dict[str, Any]:
        """``n`` samples for one prompt. ``{"tokens": [[ids]...], "aborted": bool, "dp_rank": int}``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(n=n, max_tokens=max_tokens, temperature=temperature, seed=seed)
        rid = f"dp{self.dp_rank}-{next(self._ids)}"
        req = _Request(Future())

        def add() -> None:
            if self._sleeping:
                raise TransportError(f"engine dp{self.dp_rank} is asleep: the router must not send requests here")
            self._engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt_token_ids)), params)
            self._requests[rid] = req
            self._stats["requests"] += 1

        self._run(add, timeout_s, "add_request")
        try:
            result = req.future.result(timeout=timeout_s)
        except TimeoutError:
            self.abort_all()
            raise RlixTimeoutError(f"engine dp{self.dp_rank}: request {rid} did not finish within {timeout_s:.0f} s") from None
        return {**result, "dp_rank": self.dp_rank}

    def abort_all(self, timeout_s: float = 30.0) -> int:
        """Abort every in-flight request; each caller returns ``aborted=True`` at once."""

        def abort() -> int:
            ids = list(self._requests)
            if ids:
                self._engine.abort_request(ids)
            for rid in ids:
                self._requests.pop(rid).future.set_result({"tokens": [], "aborted": True})
            self._stats["aborted"] += len(ids)
            return len(ids)

        return int(self._run(abort, timeout_s, "abort"))

    def in_flight(self) -> int:
        return len(self._requests)

    # ------------------------------------------------------------------ weight sync surface (RayEngineRpc)
    def rlix_rpc(self, method: str, args: tuple[Any, ...] = (), timeout_s: float = 300.0) -> list[Any]:
        def rpc() -> list[Any]:
            self._stats["rpcs"] += 1
            return list(self.llm.collective_rpc(method, args=tuple(args)))

        return list(self._run(rpc, timeout_s, f"collective_rpc({method})"))

    def reset_prefix_cache(self) -> bool:
        return bool(self._run(self.llm.reset_prefix_cache, 60.0, "reset_prefix_cache"))

    # ------------------------------------------------------------------ sleep / wake / memory
    def sleep(self, level: int, timeout_s: float = 60.0) -> None:
        def sleep() -> None:
            if self._requests:
                raise TransportError(f"engine dp{self.dp_rank}: sleep with {len(self._requests)} requests in flight "
                                     "(a shrink must abort and drain first)")
            if not self._sleeping:
                before, t0 = self._device_free(), time.perf_counter()
                self.llm.sleep(level=level)
                self._sleeping = True
                self._mem_log.append({"op": f"sleep{level}", "time": time.time(), "seconds": time.perf_counter() - t0,
                                      "free_before": before, "free_after": self._device_free()})

        self._run(sleep, timeout_s, f"sleep(level={level})")

    def wake_up(self, tags: list[str] | None = None, timeout_s: float = 60.0) -> None:
        def wake() -> None:
            if self._sleeping:
                before, t0 = self._device_free(), time.perf_counter()
                self.llm.wake_up(tags=tags)
                self._sleeping = tags is not None and "kv_cache" not in tags
                self._mem_log.append({"op": "wake", "time": time.time(), "seconds": time.perf_counter() - t0,
                                      "free_before": before, "free_after": self._device_free()})

        self._run(wake, timeout_s, "wake_up")

    def memory_in_use(self) -> int | None:
        """Device bytes this process tree holds on its fullest GPU (the engine and any TP workers are in it), per
        NVML; None on CPU or when the driver lists other PIDs. Device-wide numbers would count the co-tenant
        pipelines' engines on the same GPU, so they are only logged (``memory_log``), never checked. The workers
        read first (``rlix_device_usage``: each hands torch's cached blocks back, then reads its own tree), so the
        reading counts what the next tenant cannot get; their readings and this tree's join per process, as the
        NeMo RL fleet joins them."""
        from rlix_plugins.pipeline.gpu_memory import fullest_gpu_bytes, process_tree_gpu_usage

        workers = self.rlix_rpc("rlix_device_usage", timeout_s=60.0)
        return fullest_gpu_bytes([process_tree_gpu_usage(), *workers])

    def _device_free(self) -> int | None:
        from rlix_plugins.pipeline.gpu_memory import visible_gpu_free_bytes

        return visible_gpu_free_bytes()  # NVML: no CUDA context here (a TP engine's workers are other processes)

    def memory_log(self) -> list[dict[str, Any]]:
        """(op, time, seconds, device-wide free bytes before/after) of every sleep and wake (the bytes are None on
        CPU). Device-wide: on a shared GPU ``free_after - free_before`` of a sleep is what THIS rank gave back."""
        return list(self._mem_log)

    def stats(self) -> dict[str, Any]:
        return {**self._stats, "sleeping": self._sleeping, "in_flight": len(self._requests),
                "start_seconds": self.start_seconds, "pid": os.getpid()}


def _get_all(refs: dict[int, Any], timeout_s: float, what: str) -> dict[int, Any]:
    deadline = time.monotonic() + timeout_s
    out: dict[int, Any] = {}
    for rank, ref in refs.items():
        try:
            out[rank] = ray.get(ref, timeout=max(deadline - time.monotonic(), 0.0))
        except ray.exceptions.GetTimeoutError:
            raise RlixTimeoutError(f"{what}: dp rank {rank} did not answer within {timeout_s:.0f} s") from None
        except ray.exceptions.RayTaskError as exc:
            raise TransportError(f"{what}: dp rank {rank} failed: {exc.cause!r}") from None
        except ray.exceptions.RayActorError:
            raise TransportError(f"{what}: the engine actor of dp rank {rank} died") from None
    return out


class DemoFleet:
    """:class:`~rlix_plugins.pipeline.protocols.RolloutFleet` over :class:`DemoEngine` actors (picklable)."""

    def __init__(self, engines: list[Any], devices: list[list[tuple[int, int]]]) -> None:
        self.engines = list(engines)
        self._devices = [list(d) for d in devices]

    def dp_ranks(self) -> list[int]:
        return list(range(len(self.engines)))

    def devices(self, dp_rank: int) -> list[tuple[int, int]]:
        return list(self._devices[dp_rank])

    def engine_rpc(self, dp_rank: int) -> Any:
        from rlix_plugins.vllm.driver import RayEngineRpc

        return RayEngineRpc(self.engines[dp_rank], rpc_method="rlix_rpc", reset_method="reset_prefix_cache")

    def abort(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int]:
        return _get_all({r: self.engines[r].abort_all.remote(timeout_s) for r in dp_ranks}, timeout_s + 10, "abort")

    def sleep(self, dp_ranks: list[int], level: int, timeout_s: float) -> None:
        _get_all({r: self.engines[r].sleep.remote(level, timeout_s) for r in dp_ranks}, timeout_s + 10, "sleep")

    def wake_up(self, dp_ranks: list[int], tags: list[str] | None, timeout_s: float) -> None:
        _get_all({r: self.engines[r].wake_up.remote(tags, timeout_s) for r in dp_ranks}, timeout_s + 10, "wake_up")

    def memory_in_use(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int | None]:
        return _get_all({r: self.engines[r].memory_in_use.remote() for r in dp_ranks}, timeout_s, "memory_in_use")
