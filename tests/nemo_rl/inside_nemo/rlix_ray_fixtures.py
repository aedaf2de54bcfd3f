"""The Ray fixtures every inside_nemo scenario uses to override NeMo RL's (runs INSIDE a patched NeMo RL copy, copied
next to the scenarios into ``tests/unit/algorithms/``; imported as ``tests.unit.algorithms.rlix_ray_fixtures``).
Light on purpose: the setup() placement scenario is imported by every worker process NeMo RL starts.

* ``init_ray_cluster``: join ``RAY_ADDRESS`` (the outer test's private head, 4 GPUs declared) or start a private
  4-GPU head - the control plane needs a GPU pool;
* ``ray_gpu_monitor``: NeMo RL's GPU monitor, off (no GPUs here).
"""

import os

import pytest
import ray


@pytest.fixture(scope="session", autouse=True)
def init_ray_cluster():
    """Overrides NeMo RL's: the control plane needs a GPU pool (the driver's private head declares 4 GPUs)."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="rlix_conformance")
    else:
        ray.init(address="local", num_cpus=8, num_gpus=4, include_dashboard=False, namespace="rlix_conformance")
    yield
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def ray_gpu_monitor(init_ray_cluster):
    """Overrides NeMo RL's GPU monitor (no GPUs here)."""
    yield None
