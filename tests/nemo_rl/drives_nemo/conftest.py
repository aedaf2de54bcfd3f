"""Fixtures of the tests that drive NeMo RL in its own venv (marker ``nemo_rl``; skipped when NEMO_RL_SRC is unset)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.nemo_rl._nemo_checkout import apply_series, clone, nemo_src


@pytest.fixture(scope="session")
def nemo_copies(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """Two clones of NEMO_RL_SRC's HEAD: ``pristine`` and ``patched`` (the series applied by `rlix patch`)."""
    src = nemo_src()
    root = tmp_path_factory.mktemp("nemo_rl")
    pristine = clone(src, root / "pristine")
    patched = clone(src, root / "patched")
    apply_series(patched)
    yield {"pristine": pristine, "patched": patched}
