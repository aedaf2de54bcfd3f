"""How long one RPC may go unanswered: the bounds every package passes to :func:`rlix_plugins.control.rpc.ray_get`.

One constant per meaning (not per module). Standard library only, so the NeMo RL hooks can import it without Ray.
"""

from __future__ import annotations

from typing import Final

__all__ = ["CONTROL_RPC_TIMEOUT_S", "PROGRESS_RPC_TIMEOUT_S", "ROLLOUT_RPC_TIMEOUT_S"]

#: A control RPC: one call to a control-plane actor (orchestrator, scheduler, coordinator) or to a pipeline's own
#: actors (router, resizer) outside a request that does no waiting of its own: register, admit, release, status,
#: ping, history, set-publisher. Also the margin added to a call that waits a bounded time itself (a sync, a
#: watchdog's join, a grant wait).
CONTROL_RPC_TIMEOUT_S: Final = 60.0
#: A call on the rollout path: a request's calls to its router (``try_acquire``, ``release``; the margin over
#: ``acquire``'s own wait) and the resizer's calls to the router and the weight-version publisher while it shrinks or
#: expands. Shorter than a control RPC: requests and resizes wait on it.
ROLLOUT_RPC_TIMEOUT_S: Final = 30.0
#: A progress query to a host actor polled every progress period (NeMo RL's replay buffer, TransferQueue's
#: controller): a stalled actor shows within seconds.
PROGRESS_RPC_TIMEOUT_S: Final = 10.0
