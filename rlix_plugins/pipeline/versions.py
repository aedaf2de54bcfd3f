"""Weight-version rules of a time-shared pipeline (pure functions; DESIGN §3).

* The cache built after training step ``N`` (``before_weight_sync(N)``) has version ``N + 1``
  (:func:`cache_version_after_step`); the bootstrap cache holds the base weights at :data:`BOOTSTRAP_VERSION` -1.
* The version published to the trajectory collector is the cache's version clamped to ``>= 0``
  (:func:`published_version`): the collector starts at 0, and -1 would deadlock it.
  Publishing ``N`` after step ``N`` makes the collector believe targets ``[N .. N + max_age]`` are already buffered
  and pause forever, hence ``N + 1``.
* One number per cache: the in-flight refresh of active ranks and every later expand publish the SAME version;
  an expand never bumps it (:func:`check_no_double_bump`).

:class:`VersionLedger` holds a pipeline's versions: one per pipeline, replaced (never mutated) by
:class:`~rlix_plugins.pipeline.runtime.PipelineRuntime`, its only writer. Readers: the resize handler (an actor:
it holds the ledger the runtime last sent it, inside the resize lock) and the NeMo RL adapter (``rt.versions``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final

from rlix_plugins.errors import RlixError

#: Version of the bootstrap cache (base weights, built at start-up before any training step).
BOOTSTRAP_VERSION: Final = -1


def version_after_step(step: int) -> int:
    """The weight version published after training step ``step``: N + 1, that of the weights the step trained
    (N would stall the collector). Defined in rlix_plugins.pipeline.versions; the seam holds a generated copy."""
    return step + 1


def cache_version_after_step(step: int) -> int:
    """Version of the cache built after training step ``step`` (``before_weight_sync(step)``)."""
    if step < 0:
        raise RlixError(f"training step must be >= 0, got {step}")
    return version_after_step(step)


def initial_cache_version(start_step: int) -> int:
    """Version of the cache built at start-up: the base weights (-1) on a fresh run; on a run resumed at step
    ``k`` > 0 the checkpoint holds the weights step ``k - 1`` trained, version ``k`` - what NeMo RL's loop
    publishes before its first step (``weight_version = step``)."""
    if start_step < 0:
        raise RlixError(f"start step must be >= 0, got {start_step}")
    return BOOTSTRAP_VERSION if start_step == 0 else cache_version_after_step(start_step - 1)


def published_version(cache_version: int | None) -> int:
    """What the collector receives for a cache of ``cache_version``: never -1 (the collector starts at 0)."""
    if cache_version is None:
        raise RlixError("no weight cache version exists yet: bootstrap the cache (version -1) before publishing")
    return max(cache_version, 0)


def check_no_double_bump(previous: int | None, new: int, step: int) -> None:
    """After step ``step`` the published version must be exactly ``step + 1`` and move forward by at most one.

    Raises ``RlixError`` naming the rule; used by the runtime before it returns the version to the loop.
    """
    expected = cache_version_after_step(step)
    if new != expected:
        raise RlixError(
            f"after step {step} the published weight version must be {expected} (the cache step {step} built), "
            f"got {new}: publishing N after step N deadlocks the collector (it takes the step's targets as already "
            "buffered)"
        )
    if previous is not None and new > previous + 1 and previous >= 0:
        raise RlixError(f"weight version jumped from {previous} to {new} after step {step}: bumped twice "
                        "(one number per cache)")


@dataclass(frozen=True)
class VersionLedger:
    """The weight versions of one pipeline (see the module docstring). Picklable; every change is a new ledger."""

    #: Version of the CPU weight cache; None before the bootstrap build and while a build is under way.
    cache: int | None = None
    #: The version the collector is given, by the loop and by every expand; None until the collector is attached.
    published: int | None = None

    def cache_built(self, version: int) -> VersionLedger:
        return replace(self, cache=version)

    def cache_rebuilding(self) -> VersionLedger:
        """A build started: until it returns, the old number would label half-overwritten buckets."""
        return replace(self, cache=None)

    def collector_attached(self) -> VersionLedger:
        """The first publish: the start cache's version, never -1 (it deadlocks the collector)."""
        return replace(self, published=published_version(self.cache))

    def after_step(self, step: int) -> VersionLedger:
        """Publish the cache step ``step`` built: refused unless it holds :func:`cache_version_after_step`, or if
        the version would move by more than one (:func:`check_no_double_bump`)."""
        expected = cache_version_after_step(step)
        if self.cache != expected:
            raise RlixError(
                f"after_training(step={step}): the cache holds version {self.cache}, not {expected}; "
                "before_weight_sync must build it while the parameters are on the device (a cache built after "
                "the offload reads empty storage)"
            )
        version = published_version(self.cache)
        check_no_double_bump(self.published, version, step)
        return replace(self, published=version)
