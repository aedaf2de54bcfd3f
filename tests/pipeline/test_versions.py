"""Weight-version rules (pure): regression tests named after the reference failures they guard."""

from __future__ import annotations

import pytest

from rlix_plugins.errors import RlixError
from rlix_plugins.pipeline.config import RuntimeConfig
from rlix_plugins.pipeline.versions import (
    BOOTSTRAP_VERSION,
    VersionLedger,
    cache_version_after_step,
    check_no_double_bump,
    initial_cache_version,
    published_version,
    version_after_step,
)


def test_version_minus_one_deadlock_bootstrap_cache_is_published_as_zero() -> None:
    """The bootstrap cache is -1 but the collector starts at 0; -1 must never be published."""
    assert BOOTSTRAP_VERSION == -1
    assert published_version(BOOTSTRAP_VERSION) == 0
    with pytest.raises(RlixError, match="bootstrap"):
        published_version(None)


def test_n_vs_n_plus_one_deadlock_step_n_publishes_n_plus_one() -> None:
    """After step N the published version is N + 1; N is rejected with the reason."""
    for step in range(5):
        assert published_version(cache_version_after_step(step)) == step + 1
        check_no_double_bump(step, step + 1, step)
    with pytest.raises(RlixError, match="deadlocks the collector"):
        check_no_double_bump(2, 3, 3)  # publishing N=3 after step 3
    with pytest.raises(RlixError):
        cache_version_after_step(-1)


def test_no_double_bump() -> None:
    """One cache, one number: a jump by two (refresh + expand each bumping) is rejected."""
    with pytest.raises(RlixError):
        check_no_double_bump(1, 3, 2)  # expected 3 after step 2, previous 1 -> fine by value, but a jump
    check_no_double_bump(None, 1, 0)
    check_no_double_bump(0, 1, 0)  # first step after the bootstrap publish of 0


def test_runtime_config_validates() -> None:
    assert RuntimeConfig().sleep_level == 2
    assert RuntimeConfig(sleep_level=1).sleep_level == 1
    with pytest.raises(RlixError, match="sleep_level"):
        RuntimeConfig(sleep_level=3)
    with pytest.raises(RlixError, match="must be an int >= 1"):
        RuntimeConfig(step_target_estimate=0)
    with pytest.raises(RlixError, match="sync_timeout_s"):
        RuntimeConfig(sync_timeout_s=0)


def test_ledger_is_the_one_place_of_the_rules() -> None:
    """The runtime's ledger: bootstrap -1 published as 0, a step publishes N + 1 only from the cache that step
    built (a cache being rebuilt or left from before the offload is refused), never bumped twice."""
    ledger = VersionLedger().cache_built(BOOTSTRAP_VERSION).collector_attached()
    assert (ledger.cache, ledger.published) == (-1, 0)
    with pytest.raises(RlixError, match="reads empty storage"):
        ledger.after_step(0)  # no cache built for step 0
    with pytest.raises(RlixError, match="reads empty storage"):
        ledger.cache_built(1).cache_rebuilding().after_step(0)
    ledger = ledger.cache_built(cache_version_after_step(0)).after_step(0)
    assert (ledger.cache, ledger.published) == (1, 1) == (version_after_step(0),) * 2
    with pytest.raises(RlixError, match="bumped twice"):
        VersionLedger(cache=3, published=1).after_step(2)  # 1 -> 3: bumped twice
    resumed = VersionLedger().cache_built(initial_cache_version(5)).collector_attached()
    assert resumed.published == 5 and resumed.cache_built(6).after_step(5).published == 6
