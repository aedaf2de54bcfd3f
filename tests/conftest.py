"""Shared fixtures: one Ray cluster per test session (GPUs declared on CPU machines), hardware markers."""

from __future__ import annotations

import atexit
import os
import secrets
import shutil
import tempfile
from collections.abc import Iterator

import pytest

from tests.harness.ray_session import has_cuda as _has_cuda

# Quiet, offline, bounded: the same settings the CLI and demo use.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")


def _private_ray_token() -> None:
    """Ray's token authentication stays on (its default), as for users; the token of this session's clusters is
    a private file (``RAY_AUTH_TOKEN_PATH``, inherited by every subprocess) instead of the user's
    ``~/.ray/auth_token``, and a ``RAY_AUTH_MODE`` of the caller's shell cannot switch it off."""
    os.environ.pop("RAY_AUTH_MODE", None)
    os.environ.pop("RAY_AUTH_TOKEN", None)
    tmp = tempfile.mkdtemp(prefix="rlix-test-token-")
    atexit.register(shutil.rmtree, tmp, ignore_errors=True)
    path = os.path.join(tmp, "auth_token")
    with open(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
        f.write(secrets.token_hex(32))
    os.environ["RAY_AUTH_TOKEN_PATH"] = path


_private_ray_token()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "ray: uses the session's Ray cluster (set automatically; `-m 'not ray'` skips)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    cuda = _has_cuda()
    nemo_src = os.environ.get("NEMO_RL_SRC")
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (run on the device machine: pytest -m gpu)")
    skip_nemo = pytest.mark.skip(
        reason="needs a NeMo RL checkout at a supported version (main at 7ea279a, or v0.7.0): set NEMO_RL_SRC=/path/to/RL (see README)"
    )
    for item in items:
        if "ray_cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        if item.get_closest_marker("gpu") is not None and not cuda:
            item.add_marker(skip_gpu)
        if item.get_closest_marker("nemo_rl") is not None and not nemo_src:
            item.add_marker(skip_nemo)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[dict[str, float]]:
    """A local Ray cluster, started once per session. On CPU machines it declares GPUs (``ray_session``)."""
    import ray

    from tests.harness.ray_session import start_session_ray

    if not ray.is_initialized():
        start_session_ray()
    yield ray.cluster_resources()
    ray.shutdown()
