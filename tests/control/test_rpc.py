"""``control/rpc.ray_aget`` on a real Ray actor: the awaiting side of every loop-side router call."""

from __future__ import annotations

import asyncio
import gc
import logging
from typing import Any

import pytest
import ray

from rlix_plugins.control.rpc import ray_aget
from rlix_plugins.errors import ActorDeadError, RlixTimeoutError
from tests.control._ray_helpers import Sleeper


def test_a_cancelled_wait_on_an_actor_that_dies_later_logs_nothing(ray_cluster: Any,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Seen at the end of the SingleController's H200 run: its rollouts waiting on the router were cancelled, the
    router was killed at teardown, and asyncio logged 'Future exception was never retrieved' for every one."""
    actor = ray.remote(Sleeper).options(num_cpus=0).remote()
    ray.get(actor.sleep.remote(0), timeout=60)

    async def scenario() -> None:
        waits = [asyncio.ensure_future(ray_aget(actor.sleep.remote(30), "sleep", 60)) for _ in range(3)]
        await asyncio.sleep(0.2)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)
        ray.kill(actor)
        with pytest.raises(ActorDeadError):  # a wait that is not cancelled gets the rlix error
            await ray_aget(actor.sleep.remote(0), "sleep", 30)
        await asyncio.sleep(1.0)  # the shielded inner futures fail with the actor's death meanwhile

    with caplog.at_level(logging.ERROR, logger="asyncio"):
        asyncio.run(scenario())
        gc.collect()
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()], caplog.text


def test_a_wait_past_its_timeout_raises_the_rlix_timeout(ray_cluster: Any) -> None:
    actor = ray.remote(Sleeper).options(num_cpus=0).remote()
    try:
        with pytest.raises(RlixTimeoutError, match="sleep: no answer within 1 s"):
            asyncio.run(ray_aget(actor.sleep.remote(5), "sleep", 1))
    finally:
        ray.kill(actor)
