"""The test session's Ray cluster: one local node (GPUs declared on CPU machines). Started by the ``ray_cluster``
fixture (``tests/conftest.py``), and again by a module that ran a cluster of its own (``test_cross_node``)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: GPUs declared to the session's Ray cluster when no real GPU is present.
DECLARED_GPUS = 4


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


@contextlib.contextmanager
def no_auto_connect() -> Iterator[None]:
    """Ray's auto-connect off while a module runs a cluster of its own: a thread an earlier module left running (a
    pipeline's lease heartbeat) would otherwise start a fresh local Ray the moment the session's is shut down, and the
    module's ``ray.init`` would then fail ("called ray.init twice"). Ray reads its switch only at import, so it is
    flipped here, under Ray's own lock."""
    from ray._private import auto_init_hook

    with auto_init_hook.auto_init_lock:
        before, auto_init_hook.enable_auto_connect = auto_init_hook.enable_auto_connect, False
    try:
        yield
    finally:
        auto_init_hook.enable_auto_connect = before


def start_session_ray() -> None:
    import ray

    # address="local": always a new cluster of the session's own, never one a plain ray.init() would join (another
    # test run's, a developer's, or one a cluster of several raylets on this machine left recorded)
    ray.init(
        address="local",
        num_cpus=max(8, os.cpu_count() or 2),
        num_gpus=None if has_cuda() else DECLARED_GPUS,
        include_dashboard=False,
        log_to_driver=True,
        namespace="rlix_tests",
    )
