""":class:`CollectorPublisher`: the :class:`~rlix_plugins.pipeline.protocols.VersionPublisher` of every host.

Both hosts' trajectory collectors are Ray actors with ``set_weight_version(version)`` (NeMo RL's
``AsyncTrajectoryCollector``, the demo's ``DemoCollector``), so one picklable handle serves both; the runtime ships
it to the resize-handler actor, which publishes the current version after every expand. :class:`LoopPublishes`
serves the loops that publish themselves (:mod:`rlix_plugins.nemo_rl.loops`).
"""

from __future__ import annotations

from typing import Any

from rlix_plugins.control.rpc import ray_get
from rlix_plugins.errors import RlixError

__all__ = ["CollectorPublisher", "LoopPublishes"]


class CollectorPublisher:
    """Publishes weight versions to a collector actor (anything with a remote ``set_weight_version(int)``).

    ``set_weight_version`` blocks until the collector applied the version, bounded by ``timeout_s``
    (``RlixTimeoutError``); a dead collector raises ``SchedulerError``; an error the collector raises is re-raised.
    A negative version is refused before it is sent: the collector starts at 0 and -1 deadlocks it.
    """

    def __init__(self, collector: Any) -> None:
        self.collector = collector

    def set_weight_version(self, version: int, timeout_s: float) -> None:
        if version < 0:
            raise RlixError(
                f"weight version {version} must not be published to the collector (it starts at 0; -1 deadlocks it): "
                "publish pipeline.versions.published_version(cache_version)"
            )
        ray_get(self.collector.set_weight_version.remote(int(version)), f"collector.set_weight_version({version})",
                timeout_s, dead="the trajectory collector died")

    def wait_ready(self, timeout_s: float) -> None:
        ready = getattr(self.collector, "__ray_ready__", None)  # an actor handle; an in-process collector is ready
        if ready is not None:
            ray_get(ready.remote(), "the trajectory collector's start", timeout_s,
                    dead="the trajectory collector died while starting")


class LoopPublishes:
    """The publisher of a loop that publishes versions itself (NeMo RL's TransferQueue loop and SingleController):
    an expand delivers the cache's weights to the woken ranks, and there is no collector actor to tell."""

    def wait_ready(self, timeout_s: float) -> None:
        return None

    def set_weight_version(self, version: int, timeout_s: float) -> None:
        if version < 0:
            raise RlixError(f"weight version {version} must be >= 0 (the loop's versions start at 0)")
