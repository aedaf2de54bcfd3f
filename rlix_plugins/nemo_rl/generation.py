"""Generation control over NeMo RL's ``VllmGeneration`` (DESIGN §7): the fleet, and routing for the collector.

* :class:`NemoVllmFleet` - :class:`~rlix_plugins.pipeline.protocols.RolloutFleet` over the DP-leader Ray workers
  of a ``VllmGeneration`` (``worker_group.workers[worker_group.get_dp_leader_worker_idx(r)]``): ``sleep`` =
  ``sleep_async(level=)`` (the runtime's ``rlix.sleep_level``, per call through patch 0003; the workers' own
  ``vllm_cfg.sleep_level`` is only their default), ``wake_up`` = ``wake_up_async(tags=)``, ``abort`` via
  :mod:`.worker_ops` (``__ray_call__``), ``memory_in_use`` from the leader's process tree (``__ray_call__``) and
  every TP worker's (``collective_rpc``), ``engine_rpc`` = ``RayEngineRpc(leader, "checkpoint_engine_rpc_async",
  "reset_prefix_cache_async")`` (NeMo RL's existing pass-through to ``collective_rpc``). Holds actor handles
  only: picklable, never a ``VllmGeneration`` (whose ``__del__`` shuts the workers down).
* :class:`RouterShardSelector` + :class:`RouterFleetMonitor` - installed with NeMo RL's existing seam
  ``policy_generation.attach_fleet_health(monitor, selector)`` BEFORE the generation object is pickled into
  the trajectory collector. The routing state lives in the runtime's router actor, so every copy
  (driver, collector) routes over the same active ranks. ``next_shard()`` never blocks; while no rank is active
  the request waits in ``rlix_dispatch`` (awaited on the loop).
  ``release`` ends the ticket and says whether a shrink took the shard meanwhile. Retry: patch 0004 lets
  :meth:`RouterShardSelector.rlix_dispatch` run the request, so one aborted by a shrink (vLLM finishes it with
  ``finish_reason="abort"``) is re-run on another active shard (completed results are kept).
* :func:`install_routing` - both of the above on a generation object; keeps the driver's object referenced.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections import defaultdict, deque
from collections.abc import AsyncIterator
from typing import Any, Final

from rlix_plugins import envs
from rlix_plugins.control.rpc import ray_get
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl import worker_ops
from rlix_plugins.nemo_rl.topology import rank_slices
from rlix_plugins.pipeline.protocols import ShardPreemptedError
from rlix_plugins.pipeline.router import RouterClient

__all__ = ["NemoVllmFleet", "RouterFleetMonitor", "RouterShardSelector", "install_routing"]

_KEEP_ALIVE: Final[list[Any]] = []  # driver-side generation objects we attached to: never garbage-collected here


def _get(refs: Any, what: str, timeout_s: float) -> Any:
    return ray_get(refs, what, timeout_s, dead="a vLLM worker died", unwrap=())


class NemoVllmFleet:
    """See the module docstring. ``leaders[r]`` = the DP-leader worker of rank r; ``devices[r]`` its GPUs."""

    def __init__(self, leaders: list[Any], devices: dict[int, list[tuple[int, int]]]) -> None:
        if sorted(devices) != list(range(len(leaders))):
            raise RlixConfigError(f"devices for dp ranks {sorted(devices)}; the generation has {len(leaders)} ranks")
        self.leaders = list(leaders)
        self._devices = {int(r): [(int(d[0]), int(d[1])) for d in devs] for r, devs in devices.items()}

    @classmethod
    def from_generation(cls, generation: Any, infer_devices: list[int], infer_tp: int,
                        gpus_per_node: int | None = None) -> NemoVllmFleet:
        """From a ``VllmGeneration``: its DP leaders and the registered inference GPUs (``tp`` per rank)."""
        wg = generation.worker_group
        dp = int(wg.dp_size)
        if dp * infer_tp != len(infer_devices):
            raise RlixConfigError(
                f"VllmGeneration has {dp} DP ranks x TP {infer_tp} but rlix.infer_devices lists {len(infer_devices)} "
                "GPUs: make policy.generation.colocated.resources match rlix.infer_devices"
            )
        per_node = gpus_per_node or max(infer_devices) + 1
        devices = {r: [(g // per_node, g % per_node) for g in gpus]
                   for r, gpus in enumerate(rank_slices(infer_devices, infer_tp))}
        leaders = [wg.workers[wg.get_dp_leader_worker_idx(r)] for r in range(dp)]
        return cls(leaders, devices)

    # RolloutFleet
    def dp_ranks(self) -> list[int]:
        return list(range(len(self.leaders)))

    def devices(self, dp_rank: int) -> list[tuple[int, int]]:
        return list(self._devices[dp_rank])

    def engine_rpc(self, dp_rank: int) -> Any:
        from rlix_plugins.vllm.driver import RayEngineRpc

        return RayEngineRpc(self.leaders[dp_rank], "checkpoint_engine_rpc_async", "reset_prefix_cache_async",
                            "wake_up_async")

    def abort(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int]:
        counts = _get([self.leaders[r].__ray_call__.remote(worker_ops.vllm_abort_all) for r in dp_ranks],
                      f"abort on dp ranks {dp_ranks}", timeout_s)
        return {r: int(n) for r, n in zip(dp_ranks, counts, strict=True)}

    def sleep(self, dp_ranks: list[int], level: int, timeout_s: float) -> None:
        """``sleep_async(level=level)`` on the ranks' DP leaders: the scheduler's configured level (``rlix.sleep_level``)
        reaches vLLM per call (patch 0003), whatever the workers' own ``vllm_cfg.sleep_level`` default is."""
        _get([self.leaders[r].sleep_async.remote(level=int(level)) for r in dp_ranks],
             f"sleep_async(level={level}) on dp ranks {dp_ranks}", timeout_s)

    def wake_up(self, dp_ranks: list[int], tags: list[str] | None, timeout_s: float) -> None:
        _get([self.leaders[r].wake_up_async.remote(tags=tags) for r in dp_ranks],
             f"wake_up_async on dp ranks {dp_ranks}", timeout_s)

    def dead_engines(self, dp_ranks: list[int], timeout_s: float) -> dict[int, str]:
        """The ranks whose vLLM engine died (its EngineCore process is gone: OOM killer, CUDA fault) while the Ray
        actor lives on, with vLLM's error; Ray sees nothing of it. Asked by the runtime's watchdog."""
        errors = _get([self.leaders[r].__ray_call__.remote(worker_ops.vllm_engine_error) for r in dp_ranks],
                      f"engine health on dp ranks {dp_ranks}", timeout_s)
        return {r: e for r, e in zip(dp_ranks, errors, strict=True) if e}

    def memory_in_use(self, dp_ranks: list[int], timeout_s: float) -> dict[int, int | None]:
        """Bytes each rank still holds on its fullest GPU: its DP leader's process tree (the engine front-end and,
        without Ray workers, the engine core with its worker) and every TP worker's own reading through
        ``collective_rpc``: NeMo RL runs TP > 1 on vLLM's Ray executor, whose workers are Ray actors outside the
        leader's tree (the leader itself asks no GPU), so the leader alone saw none of what a TP rank kept."""
        from rlix_plugins.pipeline.gpu_memory import fullest_gpu_bytes

        # The workers first: each hands torch's cached blocks back before the leader reads its tree (the engine
        # core with its worker, where TP is 1), so that the reading counts only what the next tenant cannot get.
        what = f"memory probe on dp ranks {dp_ranks}"
        deadline = time.monotonic() + timeout_s
        workers = _get([self.leaders[r].checkpoint_engine_rpc_async.remote("rlix_device_usage") for r in dp_ranks],
                       what, timeout_s)
        leaders = _get([self.leaders[r].__ray_call__.remote(worker_ops.device_usage) for r in dp_ranks], what,
                       max(deadline - time.monotonic(), 1.0))
        return {r: fullest_gpu_bytes([lead, *(work or ())])
                for r, lead, work in zip(dp_ranks, leaders, workers, strict=True)}


class RouterShardSelector:
    """NeMo RL ``HealthyShardSelector`` surface (``next_shard``/``acquire``/``release``/``inflight``) over the
    runtime's router actor. Picklable: the pickled copy in the collector talks to the same router.

    ``next_shard`` takes a router ticket when a rank is active and NEVER blocks: NeMo RL calls it synchronously
    inside its async ``_async_generate_base``, so a wait there froze the collector's event loop; requests already
    on a rank could then never return their tickets, and the next shrink's drain timed out and failed the
    pipeline (seen on one H100 with two real NeMo RL pipelines). With no active rank it returns shard 0 and
    marks this thread's call deferred; :meth:`rlix_dispatch`, which patch 0004 runs next on the same thread
    with no ``await`` in between, then awaits a rank without blocking the loop. ``release(shard)`` returns the
    oldest ticket this process holds on that shard. Threads of one process share the ticket table.
    """

    def __init__(self, client: RouterClient) -> None:
        self.client = client
        self._init_local()

    def _init_local(self) -> None:
        self._lock = threading.Lock()
        self._tickets: dict[int, deque[int]] = defaultdict(deque)
        self._deferred = threading.local()  # .pending: next_shard found no active rank for this thread's call
        self.preempted_releases = 0

    def __getstate__(self) -> dict[str, Any]:
        return {"client": self.client}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.client = state["client"]
        self._init_local()

    def next_shard(self) -> int:
        got = self.client.try_acquire()
        self._deferred.pending = got is None
        # shard 0 is a placeholder when no rank is active: rlix_dispatch takes the real ticket once one is
        return 0 if got is None else self._keep(*got)

    def _keep(self, rank: int, ticket: int) -> int:
        """Remember a router ticket for :meth:`release` (oldest first per shard); returns the rank."""
        with self._lock:
            self._tickets[rank].append(ticket)
        return rank

    def acquire(self, shard_idx: int) -> None:
        """Counted by ``next_shard`` already (the ticket is the in-flight count)."""

    def release(self, shard_idx: int) -> bool:
        """End this process's oldest ticket on the shard; True when a shrink took the shard meanwhile."""
        ticket = self._pop_ticket(shard_idx)
        preempted = ticket is not None and self.client.release(ticket)
        if preempted:
            with self._lock:
                self.preempted_releases += 1
        return preempted

    async def rlix_dispatch(self, generation: Any, *, data: Any, method_name: str, greedy: bool,
                            dp_shard_idx: int) -> AsyncIterator[Any]:
        """Patch 0004's seam in ``VllmGeneration._async_generate_base`` (``RLIX_CONTROL_PLANE=rlix``): run the
        request on ``dp_shard_idx`` (already acquired by ``next_shard``); if a shrink took that shard while it ran
        (vLLM finished it as aborted, or the call failed), run it again on another active shard, at most
        ``client.max_attempts`` times. A failure on a shard that was NOT shrunk is re-raised unchanged. Results
        are yielded only from the attempt that completed (one sample per call, so buffering costs nothing).

        Every wait here is awaited on the caller's loop, never in an executor thread: the SingleController runs its
        rollouts, its training-grant wait and its environment steps on ONE loop and one default thread pool, and a
        ticket that needed a free thread to go back could wait behind the very grant its shrink is draining for.
        A cancelled request (a failed sibling, a deadline, a stale-rollout abort) hands its ticket back at once."""
        shard = dp_shard_idx
        if getattr(self._deferred, "pending", False):  # no rank was active in next_shard: await one here
            self._deferred.pending = False
            shard = self._keep(*await self.client.acquire_async())
        tried: list[int] = []
        for attempt in range(self.client.max_attempts):
            leader = generation.worker_group.get_dp_leader_worker_idx(shard)
            results: list[Any] = []
            try:
                async for result in _generate_on_shard(generation, data=data, method_name=method_name,
                                                       greedy=greedy, dp_shard_idx=shard, leader_worker_idx=leader):
                    results.append(result)
            except Exception:
                if not await self._release_async(shard, ok=False):
                    raise
            except BaseException:  # cancelled / closed: nobody retries this request
                self._release_nowait(shard)
                raise
            else:
                if not await self._release_async(shard):
                    for result in results:
                        yield result
                    return
            tried.append(shard)
            if attempt + 1 == self.client.max_attempts:
                break  # no ticket for an attempt that will not run: it would never go back (the drain waits on it)
            shard = self._keep(*await self.client.acquire_async(exclude=tried))
        raise ShardPreemptedError(shard, f"aborted by shrinks on {self.client.max_attempts} attempts (ranks {tried})")

    def _pop_ticket(self, shard_idx: int) -> int | None:
        with self._lock:
            queue = self._tickets.get(shard_idx)
            return queue.popleft() if queue else None

    async def _release_async(self, shard_idx: int, ok: bool = True) -> bool:
        """:meth:`release` awaited on the loop."""
        ticket = self._pop_ticket(shard_idx)
        preempted = ticket is not None and await self.client.release_async(ticket, ok)
        if preempted:
            with self._lock:
                self.preempted_releases += 1
        return preempted

    def _release_nowait(self, shard_idx: int) -> None:
        ticket = self._pop_ticket(shard_idx)
        if ticket is not None:
            self.client.release_nowait(ticket)

    def active_ranks(self) -> list[int]:
        """The DP ranks the scheduler left active (the SingleController pushes only their URLs to NeMo-Gym's
        router, patch 0006)."""
        return [int(r) for r in self.client._get(self.client.router.active.remote(), "active", 60.0)]

    def inflight(self, shard_idx: int) -> int:
        return int(self.client._get(self.client.router.in_flight.remote([shard_idx]), "in_flight", 30.0))


class RouterFleetMonitor:
    """The ``GenerationFleetHealth`` surface ``VllmGeneration`` calls (``shard_count``, ``report_failure``,
    ``report_success``); eligibility is the router's, so failures are only counted."""

    def __init__(self, shard_count: int) -> None:
        self._shard_count = int(shard_count)
        self.failures: dict[int, int] = defaultdict(int)

    @property
    def shard_count(self) -> int:
        return self._shard_count

    def report_failure(self, shard_idx: int, error: BaseException) -> None:
        self.failures[shard_idx] += 1

    def report_success(self, shard_idx: int) -> None:
        pass

    def serving_shards(self) -> list[int]:
        return list(range(self._shard_count))


def install_routing(generation: Any, client: RouterClient) -> RouterShardSelector:
    """Route ``generation`` (and every later pickled copy) through the router; call before the collector exists."""
    selector = RouterShardSelector(client)
    if hasattr(generation, "attach_fleet_health"):  # NeMo RL main: its fleet-health seam (patch 0004 asks it)
        generation.attach_fleet_health(RouterFleetMonitor(client.num_dp_ranks), selector)
    else:  # NeMo RL v0.7.0 has no fleet-health seam: its series' patch 0004 reads this attribute
        generation.rlix_router = selector
    _KEEP_ALIVE.append(generation)
    return selector


def _generate_on_shard(generation: Any, *, data: Any, method_name: str, greedy: bool, dp_shard_idx: int,
                       leader_worker_idx: int) -> AsyncIterator[Any]:
    """One request on one shard: NeMo RL main's ``VllmGeneration._generate_on_shard``; v0.7.0 has none, so
    :func:`_generate_on_leader` does what its ``_async_generate_base`` does after choosing the shard."""
    on_shard = getattr(generation, "_generate_on_shard", None)
    if on_shard is not None:
        result: AsyncIterator[Any] = on_shard(data=data, method_name=method_name, greedy=greedy,
                                             dp_shard_idx=dp_shard_idx, leader_worker_idx=leader_worker_idx)
        return result
    return _generate_on_leader(generation, data=data, method_name=method_name, greedy=greedy,
                               leader_worker_idx=leader_worker_idx)


async def _generate_on_leader(generation: Any, *, data: Any, method_name: str, greedy: bool,
                              leader_worker_idx: int) -> AsyncIterator[Any]:
    """NeMo RL v0.7.0's request body (same call, bound and result key), plus main's cancellation: a cancelled
    request cancels its Ray call, so a failed sibling or a deadline does not leave it running on the engine."""
    import ray

    timeout_s = envs.nemo_rl_async_timeout_s()
    proxy = generation.worker_group.run_single_worker_single_data(
        method_name=method_name, worker_idx=leader_worker_idx, data=data, greedy=greedy)
    try:
        try:
            ref = await anext(proxy)
        except StopAsyncIteration:
            raise RuntimeError(f"Worker produced no output for the given sample {data}.") from None
        try:
            original_idx, batch = await asyncio.wait_for(ref, timeout=timeout_s)
        except TimeoutError:
            raise RuntimeError(f"Timeout waiting for worker results after {timeout_s:.0f}s; for longer sequences "
                               f"set NRL_VLLM_ASYNC_TIMEOUT_SECONDS={int(timeout_s * 2)}") from None
    except asyncio.CancelledError:
        with contextlib.suppress(Exception):  # best effort: the request ends here either way
            ray.cancel(proxy)
        raise
    batch["gen_leader_worker_idx"] = [int(leader_worker_idx)]
    yield original_idx, batch
