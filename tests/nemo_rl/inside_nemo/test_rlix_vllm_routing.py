"""Runs INSIDE a patched NeMo RL copy with NeMo RL's pytest: our router-backed fleet selector on the REAL
``VllmGeneration`` class, built the way NeMo RL's ``test_vllm_shard_selection.py`` builds it (``object.__new__``
plus a worker group that records dispatches), with the real router actor on Ray.
Driven by ``tests/nemo_rl/drives_nemo/test_nemo_rl_time_sharing.py`` of rlix-plugins; not part of NeMo RL.
"""

import asyncio
import os
import sys
import threading
import time

import cloudpickle
import pytest
import ray
import torch
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration

from rlix_plugins.nemo_rl.generation import RouterShardSelector, install_routing
from rlix_plugins.pipeline.router import RolloutRouter, RouterClient


@pytest.fixture(scope="session", autouse=True)
def init_ray_cluster():
    """Overrides NeMo RL's: join this run's private head (RAY_ADDRESS) or start a small one."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="rlix_routing")
    else:
        ray.init(address="local", num_cpus=4, include_dashboard=False, namespace="rlix_routing")
    yield
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def ray_gpu_monitor(init_ray_cluster):
    yield None


class _WorkerGroup:
    """NeMo RL's shard-selection test double, plus an optional 'shrink while serving' on some workers."""

    def __init__(self, dp_size, router=None, shrink_on=()):
        self.dp_size = dp_size
        self.router = router
        self.shrink_on = set(shrink_on)
        self.dispatched = []

    def get_dp_leader_worker_idx(self, dp_shard_idx):
        return dp_shard_idx

    def run_single_worker_single_data(self, *, method_name, worker_idx, data, greedy):
        self.dispatched.append(worker_idx)
        aborted = worker_idx in self.shrink_on
        if aborted:  # the scheduler shrinks this shard while the request runs; vLLM finishes it as aborted
            self.shrink_on.discard(worker_idx)
            ray.get(self.router.deactivate.remote([worker_idx]))
        return _one_result(worker_idx, aborted)


async def _one_result(worker_idx, aborted):
    async def _ref():
        return (0, {"served_by": worker_idx, "aborted": aborted})

    yield _ref()


def _make_generation(dp_size, router=None, shrink_on=()):
    gen = object.__new__(VllmGeneration)
    gen.worker_group = _WorkerGroup(dp_size, router, shrink_on)
    gen.current_generate_dp_shard_idx = 0
    gen.fleet_monitor = None
    gen.fleet_selector = None
    gen.cfg = {"vllm_cfg": {"async_engine": True}}
    return gen


def _sample():
    return BatchedDataDict({"input_ids": torch.tensor([[1, 2]]), "input_lengths": torch.tensor([2], dtype=torch.int32)})


def _generate(gen):
    async def run():
        return [item async for item in gen._async_generate_base(_sample(), "generate_async", lambda _d: True)]

    [(_, out)] = asyncio.run(run())
    return out


def _router(n, active):
    router = ray.remote(RolloutRouter).options(max_concurrency=64).remote(n)
    ray.get(router.activate.remote(active))
    return router


def _routed(n, active, shrink_on=(), timeout_s=30.0):
    router = _router(n, active)
    gen = _make_generation(n, router, shrink_on)
    selector = install_routing(gen, RouterClient(router, n, timeout_s=timeout_s))
    return gen, router, selector


@pytest.fixture
def rlix_env(monkeypatch):
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")


#: NeMo RL main routes through its fleet-health seam; v0.7.0 has none (its patch 0004 reads ``rlix_router``).
FLEET_HEALTH = hasattr(VllmGeneration, "attach_fleet_health")


def test_routes_over_active_ranks_only(rlix_env):
    gen, router, selector = _routed(3, [1, 2])
    assert isinstance(selector, RouterShardSelector)
    assert (gen.fleet_selector if FLEET_HEALTH else gen.rlix_router) is selector
    served = {_generate(gen)["served_by"] for _ in range(6)}
    assert served and served <= {1, 2}  # sequential requests: least-outstanding, ties to the lowest active rank
    assert ray.get(router.in_flight.remote()) == 0  # every ticket returned


def test_pickled_copy_sees_resizes(rlix_env):
    """Stale routing copy: the collector routes with its own pickled copy; the state lives in the router actor."""
    gen, router, _ = _routed(2, [0, 1])
    copy = cloudpickle.loads(cloudpickle.dumps(gen))
    ray.get(router.deactivate.remote([0]))
    assert {_generate(copy)["served_by"] for _ in range(4)} == {1}
    ray.get(router.activate.remote([0]))
    ray.get(router.deactivate.remote([1]))
    assert {_generate(copy)["served_by"] for _ in range(4)} == {0}


def test_blocks_while_no_rank_is_active(rlix_env):
    gen, router, _ = _routed(2, [])
    done = {}
    t = threading.Thread(target=lambda: done.setdefault("out", _generate(gen)))
    t.start()
    time.sleep(1.5)
    assert "out" not in done and t.is_alive()  # blocked, not failed
    ray.get(router.activate.remote([1]))
    t.join(timeout=30)
    assert done["out"]["served_by"] == 1


def test_waiting_for_a_rank_never_blocks_the_event_loop(rlix_env):
    """Seen on one H100 with two real pipelines: the collector runs every request of a batch on ONE event loop
    and NeMo RL picks the shard synchronously; a selector that blocked there froze the loop, so a request already
    on a rank could never return its ticket, and the scheduler's next shrink failed its drain (the pipeline was
    failed). Here: no rank is active, three requests wait, the loop keeps ticking, and after activation every
    request is served and every ticket returned."""
    gen, router, _ = _routed(2, [])

    async def run():
        ticks = 0
        stop = asyncio.Event()

        async def ticker():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0.05)

        async def one():
            return [item async for item in gen._async_generate_base(_sample(), "generate_async", lambda _d: True)]

        tick_task = asyncio.create_task(ticker())
        requests = [asyncio.create_task(one()) for _ in range(3)]
        await asyncio.sleep(1.5)
        waiting_ticks = ticks
        assert not any(r.done() for r in requests)  # waiting for a rank, not failed
        await asyncio.to_thread(ray.get, router.activate.remote([1]))
        outs = await asyncio.wait_for(asyncio.gather(*requests), timeout=30)
        stop.set()
        await tick_task
        return waiting_ticks, outs

    waiting_ticks, outs = asyncio.run(run())
    assert waiting_ticks >= 10  # ~30 expected in 1.5 s; a blocked loop ticks once
    assert [out["served_by"] for [(_, out)] in outs] == [1, 1, 1]
    assert ray.get(router.in_flight.remote()) == 0


def test_request_aborted_by_a_shrink_is_retried_on_another_active_rank(rlix_env):
    gen, router, selector = _routed(2, [0, 1], shrink_on={0})
    out = _generate(gen)
    assert gen.worker_group.dispatched == [0, 1]  # the shrunk shard first, then the other active one
    assert (out["served_by"], out["aborted"]) == (1, False)
    assert selector.preempted_releases == 1
    stats = ray.get(router.stats.remote())
    assert stats["preempted"] == 1 and stats["active"] == [1] and sum(stats["in_flight"].values()) == 0


class _EveryRankShrunk(_WorkerGroup):
    """Every dispatch is aborted by a shrink of its shard, which wakes the other one (two pipelines' rollouts taking
    turns on one GPU every few seconds, as a thrashing scheduler did on one H200)."""

    def run_single_worker_single_data(self, *, method_name, worker_idx, data, greedy):
        self.dispatched.append(worker_idx)
        ray.get(self.router.activate.remote([1 - worker_idx]))
        ray.get(self.router.deactivate.remote([worker_idx]))
        return _one_result(worker_idx, True)


def test_a_request_aborted_on_every_attempt_fails_and_leaves_no_ticket_out(rlix_env):
    """After its last allowed attempt a request fails with the ranks it tried, and holds no ticket: the one taken
    for an attempt that never ran was never handed back, so the next shrink's drain of that rank waited for it and
    the scheduler failed the pipeline (16 such requests, one H200, two 1.5B pipelines)."""
    from rlix_plugins.pipeline.protocols import ShardPreemptedError

    router = _router(2, [0])
    gen = _make_generation(2)
    gen.worker_group = _EveryRankShrunk(2, router)
    install_routing(gen, RouterClient(router, 2, timeout_s=30, max_attempts=2))
    with pytest.raises(ShardPreemptedError, match=r"2 attempts \(ranks \[0, 1\]\)"):
        _generate(gen)
    assert gen.worker_group.dispatched == [0, 1]
    assert ray.get(router.in_flight.remote(), timeout=30) == 0
    ray.get(router.wait_drained.remote([0, 1], 5.0), timeout=30)  # what the next shrink waits for


class _HoldingEngine:
    """A Ray actor serving NeMo RL's streaming ``generate_async`` call shape: the first ``hold`` requests stay in
    the engine until ``abort()`` (then end as aborted, as vLLM's abort ends them); later ones are served at once."""

    def __init__(self, hold):
        self.hold, self.calls, self.aborted = hold, 0, False

    @ray.method(num_returns="streaming")
    async def generate_async(self, worker_idx):
        self.calls += 1
        held = self.calls <= self.hold
        while held and not self.aborted:
            await asyncio.sleep(0.01)
        yield (0, {"served_by": worker_idx, "aborted": held})

    def abort(self):
        self.aborted = True


class _HoldingWorkerGroup(_WorkerGroup):
    """Dispatches to a real Ray actor (an ``ObjectRefGenerator``, so NeMo RL's cancel path runs as in production)."""

    def __init__(self, dp_size, hold):
        super().__init__(dp_size)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # not importable in Ray's workers
        self.engine = ray.remote(num_cpus=0)(_HoldingEngine).remote(hold)

    def run_single_worker_single_data(self, *, method_name, worker_idx, data, greedy):
        self.dispatched.append(worker_idx)
        return self.engine.generate_async.remote(worker_idx)


def _holding(n, active, hold):
    router = _router(n, active)
    gen = _make_generation(n)
    gen.worker_group = _HoldingWorkerGroup(n, hold)
    selector = install_routing(gen, RouterClient(router, n, timeout_s=30))
    return gen, router, selector


def test_a_shrink_drains_while_every_executor_thread_waits_for_its_grant(rlix_env):
    """The SingleController's first GPU shrink (one H100): its train pump waits for the training grant in a thread
    of the loop's default executor while its rollouts run on the same loop; the grant shrinks the rollout rank and
    drains it. Here the pool has ONE thread and the grant holds it for the whole drain: the aborted requests must
    hand their tickets back without a thread (the drain finishes), then wait for the rank without one, and are run
    again once it is back."""
    gen, router, selector = _holding(1, [0], hold=3)

    def grant():  # what the scheduler does for the training grant: shrink (deactivate, abort, drain), then expand
        ray.get(router.deactivate.remote([0]), timeout=30)
        ray.get(gen.worker_group.engine.abort.remote(), timeout=30)
        ray.get(router.wait_drained.remote([0], 20.0), timeout=30)
        ray.get(router.activate.remote([0]), timeout=30)

    async def run():
        from concurrent.futures import ThreadPoolExecutor

        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=1))

        async def one():
            return [item async for item in gen._async_generate_base(_sample(), "generate_async", lambda _d: True)]

        requests = [asyncio.create_task(one()) for _ in range(3)]
        while len(gen.worker_group.dispatched) < 3:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(grant)  # the train pump's hook call: it takes the pool's only thread
        return await asyncio.wait_for(asyncio.gather(*requests), timeout=30)

    outs = asyncio.run(run())
    assert [(out["served_by"], out["aborted"]) for [(_, out)] in outs] == [(0, False)] * 3  # re-run after the drain
    assert gen.worker_group.dispatched == [0] * 6 and selector.preempted_releases == 3
    assert ray.get(router.in_flight.remote(), timeout=30) == 0


def test_a_cancelled_request_hands_its_ticket_back(rlix_env):
    """NeMo RL cancels rollouts (a failed sibling of the group, a deadline, the SingleController's stale-rollout
    abort): the ticket of a request cancelled in its engine, or while it waits for a rank, goes back to the router
    (else the next shrink's drain waits for a request that no longer exists)."""
    gen, router, _ = _holding(2, [0], hold=1)

    async def run():
        async def one():
            return [item async for item in gen._async_generate_base(_sample(), "generate_async", lambda _d: True)]

        in_engine = asyncio.create_task(one())
        while not gen.worker_group.dispatched:
            await asyncio.sleep(0.01)
        await asyncio.to_thread(ray.get, router.deactivate.remote([0]), timeout=30)
        waiting = asyncio.create_task(one())  # no active rank: waits in rlix_dispatch
        await asyncio.sleep(0.5)
        in_flight = await asyncio.to_thread(ray.get, router.in_flight.remote(), timeout=30)
        in_engine.cancel()
        waiting.cancel()
        await asyncio.gather(in_engine, waiting, return_exceptions=True)
        return in_flight

    assert asyncio.run(run()) == 1  # the request in the engine held a ticket; the waiting one none yet
    ray.get(router.wait_drained.remote([0, 1], 10.0), timeout=30)  # both tickets are back (none was granted later)
    ray.get(router.activate.remote([1]), timeout=30)  # a rank for the waiter's acquire, had it not been given back
    time.sleep(0.5)
    assert ray.get(router.in_flight.remote(), timeout=30) == 0


def test_without_the_variable_the_seam_is_inert(monkeypatch):
    """RLIX_CONTROL_PLANE unset: VllmGeneration keeps its own path (no retry): on main its fleet selector's
    acquire/next/release; on v0.7.0 its round-robin, which never asks the router."""
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    gen, router, selector = _routed(2, [0, 1], shrink_on={0})
    out = _generate(gen)
    assert gen.worker_group.dispatched == [0]
    assert out["aborted"] is True and selector.preempted_releases == (1 if FLEET_HEALTH else 0)
    assert ray.get(router.in_flight.remote()) == 0


class _RecordingAsyncLLM:
    """Stands in for vLLM's ``AsyncLLM`` (vLLM cannot be installed in the conformance venv): records the sleep calls
    NeMo RL's real ``sleep_async`` makes."""

    def __init__(self):
        self.calls = []

    async def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    async def sleep(self, level):
        self.calls.append(("sleep", level))


def _real_async_worker_cls():
    from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

    class _Worker(VllmAsyncGenerationWorkerImpl):
        """NeMo RL's async vLLM worker with its engine start skipped (``sleep_async`` is NeMo RL's, patched)."""

        def __init__(self, sleep_level=None):
            vllm_cfg = {"async_engine": True}
            if sleep_level is not None:
                vllm_cfg["sleep_level"] = sleep_level
            self.cfg = {"vllm_cfg": vllm_cfg}
            self.llm = _RecordingAsyncLLM()

        def llm_calls(self):
            return list(self.llm.calls)

    # This test module is not importable in Ray's workers (no package): ship the class by value.
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.remote(num_cpus=0)(_Worker)


def test_fleet_sleep_passes_the_configured_level_to_the_real_worker():
    """rlix.sleep_level reaches vLLM: NemoVllmFleet.sleep(level) calls NeMo RL's real (patched) sleep_async with that
    level, whatever the worker's own vllm_cfg.sleep_level default is; NeMo RL's own level-less call is unchanged."""
    from rlix_plugins.nemo_rl.generation import NemoVllmFleet

    cls = _real_async_worker_cls()
    default, configured = cls.remote(), cls.remote(sleep_level=1)
    try:
        fleet = NemoVllmFleet([default, configured], {0: [(0, 0)], 1: [(0, 1)]})
        fleet.sleep([0, 1], 2, 60)
        fleet.sleep([1], 1, 60)
        assert ray.get(default.llm_calls.remote()) == ["reset_prefix_cache", ("sleep", 2)]
        assert ray.get(configured.llm_calls.remote()) == ["reset_prefix_cache", ("sleep", 2),
                                                          "reset_prefix_cache", ("sleep", 1)]
        ray.get(default.sleep_async.remote())  # NeMo RL's own call (no level): its config's level, default 1
        assert ray.get(default.llm_calls.remote())[-1] == ("sleep", 1)
    finally:
        ray.kill(default)
        ray.kill(configured)


class _SamplingParams:
    """Stands in for vLLM's ``SamplingParams`` (not installable here): keeps the keywords, with vLLM's own rule that
    stop strings need detokenization (its ``_verify_args``)."""

    def __init__(self, **kwargs):
        if kwargs.get("stop") and not kwargs.get("detokenize", True):
            raise ValueError("stop strings are only supported when detokenize is True")
        self.kwargs = kwargs


class _Logprob:
    def __init__(self, logprob):
        self.logprob = logprob


class _Completion:
    def __init__(self, token_ids, text):
        self.token_ids = token_ids
        self.text = text
        self.logprobs = [{t: _Logprob(-0.5 * (i + 1))} for i, t in enumerate(token_ids)]
        self.finish_reason = "length"


class _Request:
    def __init__(self, completion):
        self.outputs = [completion]


class _TokenOnlyAsyncLLM:
    """Stands in for vLLM's ``AsyncLLM``: answers every request with three tokens and their logprobs, and text only
    where the request asked for it (as vLLM does); records each request's keywords."""

    def __init__(self):
        self.asked = []

    async def generate(self, prompt, sampling_params, request_id):
        self.asked.append(sampling_params.kwargs)
        text = "abc" if sampling_params.kwargs.get("detokenize", True) else ""
        yield _Request(_Completion([7, 8, 9], text))


def _generating_worker(**vllm_cfg):
    from nemo_rl.models.generation.vllm.vllm_worker_async import VllmAsyncGenerationWorkerImpl

    worker = object.__new__(VllmAsyncGenerationWorkerImpl)  # NeMo RL's worker; its engine start skipped
    worker.cfg = {"vllm_cfg": {"async_engine": True, "max_model_len": 64, **vllm_cfg}, "_pad_token_id": 0,
                  "max_new_tokens": 3, "temperature": 1.0, "top_p": 1.0, "top_k": None, "stop_token_ids": None,
                  "stop_strings": None}
    worker.llm = _TokenOnlyAsyncLLM()
    worker.SamplingParams = _SamplingParams
    worker.routed_experts_dtype = torch.int16
    return worker


def _generate_async(worker, stop_strings=None):
    data = _sample()
    if stop_strings is not None:
        data["stop_strings"] = [stop_strings]

    async def run():
        return [item async for item in worker.generate_async(data)]

    [(_, out)] = asyncio.run(run())
    return out


def test_token_only_requests_where_no_stop_string_needs_text():
    """``vllm_cfg.detokenize: false`` (what ``rlix recipe`` writes; patch 0003): NeMo RL's real ``generate_async``
    asks vLLM for no text where the request has no stop strings, and still returns the tokens and their logprobs;
    a request with stop strings keeps its text (vLLM needs it to match them); without the key nothing changes."""
    worker = _generating_worker(detokenize=False)
    out = _generate_async(worker)
    assert worker.llm.asked[-1]["detokenize"] is False
    assert out["output_ids"].tolist() == [[1, 2, 7, 8, 9]]
    assert out["logprobs"].tolist() == [[0.0, 0.0, -0.5, -1.0, -1.5]]
    _generate_async(worker, stop_strings=["</answer>"])
    assert worker.llm.asked[-1]["detokenize"] is True and worker.llm.asked[-1]["stop"] == ["</answer>"]

    standalone = _generating_worker()
    assert _generate_async(standalone)["logprobs"].tolist() == out["logprobs"].tolist()
    assert standalone.llm.asked[-1]["detokenize"] is True
