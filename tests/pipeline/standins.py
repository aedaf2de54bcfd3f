"""Stand-ins for the three host seams (fleet, weight source, publisher) that record every call in a Ray actor.

They implement the protocols of ``rlix_plugins.pipeline.protocols`` without vLLM or a trainer, so the runtime,
router and resizer (the things under test) run for real on real Ray and the real control plane. The vLLM-backed
implementations are exercised end to end by tests/demo.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import ray

from rlix_plugins.errors import TransportError
from rlix_plugins.pipeline.protocols import SyncResult


@ray.remote(num_cpus=0, max_concurrency=16)
class Recorder:
    """Call log plus knobs: ``fail_sync`` (raise in the next syncs), ``memory_after_sleep`` (bytes or None)."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, str, Any]] = []
        self.knobs: dict[str, Any] = {"fail_sync": False, "memory_after_sleep": None, "cache_version": None}
        self.lock = threading.Lock()

    def log(self, what: str, arg: Any = None) -> None:
        with self.lock:
            self.calls.append((time.time(), what, arg))

    def get(self) -> list[tuple[float, str, Any]]:
        with self.lock:
            return list(self.calls)

    def set(self, key: str, value: Any) -> None:
        self.knobs[key] = value

    def knob(self, key: str) -> Any:
        return self.knobs[key]


class RecordingFleet:
    def __init__(self, rec: Any, num_ranks: int, tp: int = 1) -> None:
        self.rec, self.n, self.tp = rec, num_ranks, tp

    def dp_ranks(self) -> list[int]:
        return list(range(self.n))

    def devices(self, dp_rank: int) -> list[tuple[int, int]]:
        return [(0, dp_rank * self.tp + i) for i in range(self.tp)]

    def engine_rpc(self, dp_rank: int) -> Any:
        return ("rpc", dp_rank)

    def abort(self, dp_ranks: list[int], timeout_s: float) -> None:
        ray.get(self.rec.log.remote("abort", sorted(dp_ranks)))

    def sleep(self, dp_ranks: list[int], level: int, timeout_s: float) -> None:
        ray.get(self.rec.log.remote("sleep", (sorted(dp_ranks), level)))

    def wake_up(self, dp_ranks: list[int], tags: list[str] | None, timeout_s: float) -> None:
        ray.get(self.rec.log.remote("wake", sorted(dp_ranks) if tags is None else (sorted(dp_ranks), tags)))

    def memory_in_use(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int | None]:
        ray.get(self.rec.log.remote("memory", sorted(dp_ranks)))
        mem = ray.get(self.rec.knob.remote("memory_after_sleep"))
        return dict.fromkeys(dp_ranks, mem)


class RecordingWeights:
    def __init__(self, rec: Any) -> None:
        self.rec = rec

    def build_cache(self, version: int, timeout_s: float) -> int:
        ray.get(self.rec.set.remote("cache_version", version))
        ray.get(self.rec.log.remote("build", version))
        return version

    def sync(self, targets: dict[int, Any], timeout_s: float, verify: bool,
             wake_tags: list[str] | None = None) -> SyncResult:
        ranks = sorted(targets)
        ray.get(self.rec.log.remote("sync", ranks if wake_tags is None else (ranks, wake_tags)))
        if ray.get(self.rec.knob.remote("fail_sync")):
            raise TransportError(f"stand-in sync to {ranks} told to fail")
        version = ray.get(self.rec.knob.remote("cache_version"))
        return SyncResult(version=version, dp_ranks=tuple(ranks), seconds=0.0, verified_params=dict.fromkeys(ranks, 3))


class RecordingPublisher:
    def __init__(self, rec: Any) -> None:
        self.rec = rec

    def wait_ready(self, timeout_s: float) -> None:
        return None

    def set_weight_version(self, version: int, timeout_s: float) -> None:
        ray.get(self.rec.log.remote("publish", version))


class SlowStartCollector:
    """A collector whose actor takes 3 s to start (a real one imports its world first)."""

    def __init__(self) -> None:
        time.sleep(3.0)
        self.versions: list[int] = []

    def set_weight_version(self, version: int) -> None:
        self.versions.append(version)


def ops(rec: Any, *, memory: bool = False) -> list[tuple[str, Any]]:
    """The recorded calls in order; memory probes only with ``memory=True``."""
    return [(what, arg) for _, what, arg in ray.get(rec.get.remote()) if memory or what != "memory"]


class LoopRouterCaller:
    """An async Ray actor (Ray runs it on uvloop, as NeMo RL's collector and SingleController actors): awaits the
    client's event-loop calls with its default thread pool held by blocking calls."""

    def __init__(self, client: Any) -> None:
        self.client = client

    async def acquire_release_with_a_busy_pool(self, n: int) -> list[bool]:
        loop = asyncio.get_running_loop()
        gate = threading.Event()
        blockers = [loop.run_in_executor(None, gate.wait, 30) for _ in range(64)]  # more than the pool's threads
        got = [await self.client.acquire_async() for _ in range(n)]
        out = [await self.client.release_async(ticket) for _rank, ticket in got]
        gate.set()
        await asyncio.gather(*blockers)
        return out

    async def cancelled_while_waiting(self) -> None:
        waiter = asyncio.ensure_future(self.client.acquire_async())
        await asyncio.sleep(0.3)
        waiter.cancel()
        await asyncio.gather(waiter, return_exceptions=True)
