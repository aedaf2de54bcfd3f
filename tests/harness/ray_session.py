"""The test session's Ray cluster: one local node (GPUs declared on CPU machines). Started by the ``ray_cluster``
fixture (``tests/conftest.py``), and again by a module that ran a cluster of its own (``test_cross_node``)."""

from __future__ import annotations

import os

#: GPUs declared to the session's Ray cluster when no real GPU is present.
DECLARED_GPUS = 4


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def start_session_ray() -> None:
    import ray

    ray.init(
        num_cpus=max(8, os.cpu_count() or 2),
        num_gpus=None if has_cuda() else DECLARED_GPUS,
        include_dashboard=False,
        log_to_driver=True,
        namespace="rlix_tests",
    )
