"""Router actor + client on real Ray: blocking acquire, least-outstanding choice, drain, retry after a shrink,
and the stale-routing-copy regression (a pickled copy must see resizes)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from rlix_plugins.errors import RlixTimeoutError
from rlix_plugins.pipeline.protocols import ShardPreemptedError
from rlix_plugins.pipeline.router import ROUTER_MAX_CONCURRENCY, RolloutRouter, RouterClient
from tests.pipeline.standins import LoopRouterCaller


@pytest.fixture
def router(ray_cluster: Any) -> Iterator[Any]:
    actor = ray.remote(RolloutRouter).options(num_cpus=0, max_concurrency=ROUTER_MAX_CONCURRENCY).remote(3)
    yield actor
    ray.kill(actor)


def test_acquire_blocks_until_a_rank_is_active_and_prefers_least_outstanding(router: Any) -> None:
    client = RouterClient(router, 3, timeout_s=0.3)
    with pytest.raises(RlixTimeoutError, match="no active rollout rank"):
        client.acquire()
    ref = router.acquire.remote(10.0)
    time.sleep(0.3)
    assert ray.wait([ref], timeout=0.1)[0] == [], "acquire returned while no rank was active"
    ray.get(router.activate.remote([1, 2]))
    rank, t1 = ray.get(ref, timeout=5)
    assert rank == 1
    rank2, _t2 = client.acquire()
    assert rank2 == 2  # least outstanding
    rank3, _ = client.acquire()
    assert rank3 == 1
    assert client.release(t1) is False
    assert ray.get(router.stats.remote())["in_flight"] == {0: 0, 1: 1, 2: 1}


def test_deactivate_marks_tickets_preempted_and_drain_waits(router: Any) -> None:
    ray.get(router.activate.remote([0, 1]))
    client = RouterClient(router, 3, timeout_s=2)
    rank, ticket = client.acquire()
    assert ray.get(router.deactivate.remote([rank])) == [1 - rank]
    with pytest.raises(RlixTimeoutError, match="did not drain"):
        ray.get(router.wait_drained.remote([rank], 0.2))
    drained = router.wait_drained.remote([rank], 10.0)
    assert client.release(ticket, ok=False) is True  # the caller learns its request was preempted
    ray.get(drained, timeout=5)
    assert client.acquire()[0] == 1 - rank  # never routes to the deactivated rank


def test_route_retries_a_request_aborted_by_a_shrink_on_another_rank(router: Any) -> None:
    ray.get(router.activate.remote([0, 1]))
    client = RouterClient(router, 3, timeout_s=5)
    calls: list[int] = []

    def generate(rank: int) -> dict[str, Any]:
        calls.append(rank)
        if len(calls) == 1:
            ray.get(router.deactivate.remote([rank]))  # a shrink arrives while the request runs ...
            return {"aborted": True}  # ... and the engine returns it aborted
        return {"aborted": False, "rank": rank}

    out = client.route(generate, is_aborted=lambda r: r["aborted"])
    assert out["rank"] != calls[0] and len(calls) == 2


def test_route_reraises_failures_that_were_not_preemptions(router: Any) -> None:
    ray.get(router.activate.remote([0]))
    client = RouterClient(router, 3, timeout_s=2, max_attempts=3)

    def boom(rank: int) -> None:
        raise ValueError("engine bug")

    with pytest.raises(ValueError, match="engine bug"):
        client.route(boom)
    with pytest.raises(ShardPreemptedError):  # aborted although nobody shrank it: not retried silently
        client.route(lambda rank: {"aborted": True}, is_aborted=lambda r: r["aborted"])
    assert ray.get(router.in_flight.remote()) == 0  # every ticket was returned


@ray.remote(num_cpus=0)
class _Collector:
    """Holds a pickled RouterClient, like NeMo RL's collector holds its pickled VllmGeneration copy."""

    def __init__(self, client: RouterClient) -> None:
        self.client = client

    def route_once(self) -> int:
        rank, ticket = self.client.acquire()
        self.client.release(ticket)
        return rank


def test_stale_routing_copy_collector_sees_resizes_made_elsewhere(router: Any) -> None:
    """Routing state changed by the resizer after the collector got its copy must reach it."""
    ray.get(router.activate.remote([0]))
    collector = _Collector.remote(RouterClient(router, 3, timeout_s=5))
    assert ray.get(collector.route_once.remote()) == 0
    ray.get(router.deactivate.remote([0]))
    ray.get(router.activate.remote([2]))
    assert ray.get(collector.route_once.remote()) == 2
    ray.kill(collector)


def test_concurrent_acquires_are_spread_and_all_wake(router: Any) -> None:
    client = RouterClient(router, 3, timeout_s=10)
    got: list[int] = []
    threads = [threading.Thread(target=lambda: got.append(client.acquire()[0])) for _ in range(6)]
    for t in threads:
        t.start()
    time.sleep(0.2)
    ray.get(router.activate.remote([0, 1, 2]))
    for t in threads:
        t.join(10)
    assert sorted(got) == [0, 0, 1, 1, 2, 2]


def test_one_rank_request_waits_out_repeated_preemptions_by_default(ray_cluster: Any) -> None:
    """One-GPU topology: the only rank is slept by every training step (the pipeline's own and each co-tenant's).
    A request aborted by those shrinks waits for the rank to come back and runs again; with the old default bound
    (max(DP ranks, 2) attempts) the third preemption failed it, and NeMo RL's collector (max_generation_failures=0)
    would have aborted the run."""
    router = ray.remote(RolloutRouter).options(num_cpus=0, max_concurrency=16).remote(1)
    try:
        ray.get(router.activate.remote([0]))
        client = RouterClient(router, 1, timeout_s=10)
        calls: list[int] = []

        def generate(rank: int) -> dict[str, Any]:
            calls.append(rank)
            if len(calls) <= 3:
                ray.get(router.deactivate.remote([rank]))  # a training step takes the GPU ...
                threading.Timer(0.2, lambda: ray.get(router.activate.remote([rank]))).start()  # ... and gives it back
                return {"aborted": True}
            return {"aborted": False, "rank": rank}

        assert client.route(generate, is_aborted=lambda r: r["aborted"]) == {"aborted": False, "rank": 0}
        assert calls == [0, 0, 0, 0]
        assert ray.get(router.stats.remote())["preempted"] == 3
    finally:
        ray.kill(router)


def test_close_fails_waiting_and_new_acquires_at_once(router: Any) -> None:
    """A failed pipeline's router: a request blocked for an active rank and every later one raise at once."""
    from rlix_plugins.errors import PipelineUnregisteredError

    client = RouterClient(router, 3, timeout_s=30.0)
    blocked = router.acquire.remote(30.0)
    time.sleep(0.3)
    ray.get(router.close.remote("pipeline p was failed by the scheduler"))
    with pytest.raises(PipelineUnregisteredError, match="failed by the scheduler"):
        ray.get(blocked, timeout=5)
    t0 = time.monotonic()
    with pytest.raises(PipelineUnregisteredError):
        client.route(lambda rank: rank)
    with pytest.raises(PipelineUnregisteredError):
        client.try_acquire()
    assert time.monotonic() - t0 < 5


def test_loop_calls_need_no_thread_and_a_cancelled_wait_leaks_no_ticket(router: Any) -> None:
    ray.get(router.activate.remote([0]), timeout=30)
    caller = ray.remote(LoopRouterCaller).options(num_cpus=0).remote(RouterClient(router, 3, timeout_s=10))
    try:
        assert ray.get(caller.acquire_release_with_a_busy_pool.remote(3), timeout=60) == [False] * 3
        ray.get(router.deactivate.remote([0]), timeout=30)
        ray.get(caller.cancelled_while_waiting.remote(), timeout=30)
        ray.get(router.activate.remote([1]), timeout=30)  # the abandoned acquire is granted now: its ticket goes back
        deadline = time.monotonic() + 10
        while ray.get(router.in_flight.remote(), timeout=30) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ray.get(router.in_flight.remote(), timeout=30) == 0
    finally:
        ray.kill(caller)


#: Control calls of a resize are bounded at 30 s by their callers; asserted well below, yet far above a fast answer.
_CONTROL_BOUND_S = 10.0


def _control(what: str, refs: Any) -> Any:
    """The answer of a resize's control call (or of a batch of them), which must come within ``_CONTROL_BOUND_S``."""
    try:
        return ray.get(refs, timeout=_CONTROL_BOUND_S)
    except ray.exceptions.GetTimeoutError:
        pytest.fail(f"router control call {what} did not answer within {_CONTROL_BOUND_S:.0f} s "
                    "(queued behind the waiting acquire calls)")


@pytest.mark.slow
def test_thousands_of_waiting_acquires_never_block_resize_control_calls(ray_cluster: Any) -> None:
    """A shrink that takes a pipeline's last active rank leaves whole batches of aborted requests waiting in the
    router. Waiting must not hold a slot a control call needs: with 2,048 requests waiting (more than the 256
    threads of the former threaded actor), shrinks and expands run their control calls at once, and every request
    ends with exactly one served ticket."""
    n_requests, rounds = 2048, 3
    router = ray.remote(RolloutRouter).options(num_cpus=0, max_concurrency=ROUTER_MAX_CONCURRENCY).remote(2)
    try:
        ray.get(router.ping.remote(), timeout=60)
        # request -> its outstanding acquire; every request waits: no rank is active yet.
        waiting = {router.acquire.remote(120.0): req for req in range(n_requests)}
        assert ray.wait(list(waiting), timeout=1.0)[0] == [], "acquire returned while no rank was active"
        assert _control("in_flight", router.in_flight.remote()) == 0
        seen: set[int] = set()  # every ticket granted in the test
        preempted = 0

        def grant() -> dict[int, tuple[int, int]]:
            """The waiting requests' tickets (request -> (rank, ticket)), each checked never granted before."""
            got = ray.get(list(waiting), timeout=120)
            out = {waiting[ref]: (int(r), int(t)) for ref, (r, t) in zip(waiting, got, strict=True)}
            waiting.clear()
            tickets = [t for _r, t in out.values()]
            assert len(set(tickets)) == len(tickets) and seen.isdisjoint(tickets), "a ticket was granted twice"
            seen.update(tickets)
            return out

        def release(what: str, held: dict[int, tuple[int, int]], *, expect_preempted: bool, retry: bool) -> None:
            """End ``held``'s tickets (each once); ``retry``: the caller sends each request again at once."""
            nonlocal preempted
            refs = []
            for req, (_rank, ticket) in held.items():
                refs.append(router.release.remote(ticket, not expect_preempted))
                if retry:
                    waiting[router.acquire.remote(120.0)] = req
            assert _control(what, refs) == [expect_preempted] * len(held)
            preempted += len(held) if expect_preempted else 0

        for step in range(rounds):
            assert _control("activate", router.activate.remote([0, 1])) == [0, 1]  # expand
            held = grant()
            assert len(held) == n_requests
            counts = [sum(r == rank for r, _t in held.values()) for rank in (0, 1)]
            assert abs(counts[0] - counts[1]) <= 1, f"not least-outstanding: {counts}"
            assert _control("in_flight", router.in_flight.remote()) == n_requests
            # Partial shrink: rank `gone`'s requests are aborted and run again on the other rank at once.
            gone = step % 2
            assert _control("deactivate", router.deactivate.remote([gone])) == [1 - gone]
            on_gone = {req: rt for req, rt in held.items() if rt[0] == gone}
            release("release (partial shrink)", on_gone, expect_preempted=True, retry=True)
            _control("wait_drained", router.wait_drained.remote([gone], _CONTROL_BOUND_S))
            regranted = grant()
            assert {r for r, _t in regranted.values()} == {1 - gone}
            held.update(regranted)
            # Full shrink while every ticket is out: all requests are aborted and wait in the router again.
            assert _control("deactivate", router.deactivate.remote([0, 1])) == []
            release("release (full shrink)", held, expect_preempted=True, retry=True)
            _control("wait_drained", router.wait_drained.remote([0, 1], _CONTROL_BOUND_S))
            assert len(waiting) == n_requests and ray.wait(list(waiting), timeout=0.5)[0] == []
            stats = _control("stats", router.stats.remote())
            assert stats["active"] == [] and stats["in_flight"] == {0: 0, 1: 0}

        assert _control("activate", router.activate.remote([1, 0])) == [0, 1]  # the last expand: all run to the end
        final = grant()
        assert sorted(final) == list(range(n_requests))
        release("release (served)", final, expect_preempted=False, retry=False)
        assert _control("in_flight", router.in_flight.remote()) == 0
        stats = _control("stats", router.stats.remote())
        assert stats["served"] == {rank: sum(r == rank for r, _t in final.values()) for rank in (0, 1)}, stats
        assert stats["preempted"] == preempted == rounds * (n_requests + n_requests // 2), stats
        assert len(seen) == n_requests + preempted  # one ticket per acquire, each released once
    finally:
        ray.kill(router)
