"""The ``initialize_model_parallel`` recorder reaches NeMo RL's Megatron workers through Ray's worker-process setup
hook that :func:`nemo_rl_placement` names in ``policy.megatron_cfg.env_vars`` (``megatron_nccl``'s docstring says
why that route).

What is real: our placement (control plane, pool, registration), Ray (2.60, the version NeMo RL pins) starting the
worker process and running the hook from its environment, megatron-core's ``initialize_model_parallel`` on a
1-process gloo world, called from the actor's constructor as Megatron-Bridge's setup calls it (through the module
attribute). The actor is started as NeMo RL's ``RayWorkerGroup._create_workers_from_bundle_indices`` starts a
policy worker (nemo-rl 7ea279a, ``nemo_rl/distributed/worker_groups.py``): ``runtime_env`` = ``{"env_vars":
policy.megatron_cfg.env_vars + every other variable of the driver's environment, minus Ray's own, "py_executable":
...}`` (``Policy`` passes ``megatron_cfg.env_vars`` as the group's ``env_vars``, ``lm_policy.py``), in the
placement group of its GPU, ``1 / max_colocated_worker_groups`` GPU. NeMo RL itself is not imported here (its
worker group needs NeMo RL's venv; the stand-in is those few lines).

This module imports nothing of rlix_plugins at its top: the worker process imports it to load the actor class,
and the standalone case checks that nothing of ours is loaded there.
"""

from __future__ import annotations

import os
import socket
import sys
from copy import deepcopy
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

#: What a user's own setup hook leaves behind (chained before ours).
USER_HOOK_MARK = "RLIX_TEST_USER_HOOK_RAN"
#: A setup hook the job already had, in a module of its own on the workers' PYTHONPATH.
USER_HOOK_SOURCE = f"import os\n\n\ndef hook():\n    os.environ[{USER_HOOK_MARK!r}] = '1'\n"


@ray.remote
class _MegatronWorker:
    """A policy worker's constructor as far as Megatron's setup: torch.distributed, then model parallel."""

    def __init__(self) -> None:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        self.wrapped_at_start = bool(getattr(ps.initialize_model_parallel, "_rlix_records_calls", False))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        ps.initialize_model_parallel(tensor_model_parallel_size=1, order="tp-cp-ep-pp-dp")

    def report(self) -> dict[str, Any]:
        ours = sorted(m for m in sys.modules if m.startswith("rlix_plugins"))
        call = None
        if "rlix_plugins.nemo_rl.megatron_nccl" in sys.modules:
            recorded = sys.modules["rlix_plugins.nemo_rl.megatron_nccl"].recorded_initialize_call()
            call = None if recorded is None else (recorded.args, recorded.kwargs, recorded.recorded)
        return {"wrapped_at_start": self.wrapped_at_start, "call": call, "rlix_modules": ours,
                "user_hook": os.environ.get(USER_HOOK_MARK), "nvte": os.environ.get("NVTE_CPU_OFFLOAD_V1")}


def _start_like_nemo_rl(megatron_env_vars: dict[str, str] | None, placement_group: Any = None,
                        num_gpus: float = 0) -> Any:
    """One policy worker, with the runtime_env NeMo RL's worker group builds (see the module docstring)."""
    env_vars = dict(megatron_env_vars or {})
    for k, v in os.environ.items():
        if k not in env_vars:
            env_vars[k] = v
    worker_env = deepcopy(env_vars)
    worker_env.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "NODE_RANK": "0"})
    for k in ("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "RAY_CLIENT_MODE", "RAY_JOB_ID", "RAY_LD_PRELOAD",
              "RAY_RAYLET_PID", "RAY_USAGE_STATS_ENABLED"):
        worker_env.pop(k, None)
    options: dict[str, Any] = {"runtime_env": {"env_vars": worker_env, "py_executable": sys.executable},
                               "num_gpus": num_gpus}
    if placement_group is not None:
        options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            placement_group=placement_group, placement_group_bundle_index=0, placement_group_capture_child_tasks=True)
    return _MegatronWorker.options(**options).remote()


def test_placement_installs_the_recorder_before_megatrons_setup(ray_cluster: dict[str, float], tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIX_CONTROL_PLANE=rlix: the placement hook writes Ray's setup-hook variable into megatron_cfg.env_vars
    (keeping the user's variables and chaining the user's own setup hook); a worker started with them has the
    recorder before its constructor runs, and the constructor's initialize_model_parallel call is recorded with its
    arguments."""
    from ray._private import ray_constants

    from rlix_plugins.nemo_rl import placement
    from rlix_plugins.nemo_rl.config import cfg_path
    from rlix_plugins.nemo_rl.megatron_nccl import CHAINED_SETUP_HOOK_ENV, SETUP_HOOK

    from .test_placement import _run_config

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setattr(placement, "_SETUP_GRANTS", {})  # the untaken grant stays out of other tests
    cfg = _run_config([0])
    (tmp_path / "rlix_test_user_hook.py").write_text(USER_HOOK_SOURCE)
    user_hook, hook_env = "rlix_test_user_hook.hook", ray_constants.WORKER_PROCESS_SETUP_HOOK_ENV_VAR
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    user_env = {"NVTE_CPU_OFFLOAD_V1": "1", "PYTHONPATH": path, hook_env: user_hook}
    cfg["policy"]["megatron_cfg"]["env_vars"] = dict(user_env)  # type: ignore[index]
    pool = placement.placement_pool()
    worker = None
    try:
        train, _infer, _policy_kw, _gen_kw = placement.nemo_rl_placement(cfg)
        env = cfg_path(cfg, "policy.megatron_cfg.env_vars")
        assert env == {**user_env, hook_env: SETUP_HOOK, CHAINED_SETUP_HOOK_ENV: user_hook}, env
        worker = _start_like_nemo_rl(env, train.get_placement_groups()[0], 1 / train.max_colocated_worker_groups)
        got = ray.get(worker.report.remote(), timeout=180)
        assert got["wrapped_at_start"] is True, got
        assert got["call"] == ((), {"tensor_model_parallel_size": 1, "order": "tp-cp-ep-pp-dp"}, True), got
        assert got["user_hook"] == "1" and got["nvte"] == "1", got
        grant = placement.take_setup(cfg)
        assert grant is not None
        grant.pipe.stop_keep_alive()
        grant.pipe.unregister("test over")
    finally:
        if worker is not None:
            ray.kill(worker)
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def test_standalone_worker_gets_no_recorder_and_imports_nothing_of_ours(ray_cluster: dict[str, float],
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """RLIX_CONTROL_PLANE unset: our placement never runs (patch 0002 calls it only through the loaded hooks), so
    NeMo RL starts the worker with its own megatron_cfg.env_vars: no recorder, nothing of rlix_plugins imported in
    the worker."""
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    worker = _start_like_nemo_rl({"NVTE_CPU_OFFLOAD_V1": "1"})
    try:
        got = ray.get(worker.report.remote(), timeout=180)
        assert got["wrapped_at_start"] is False and got["call"] is None and got["rlix_modules"] == [], got
    finally:
        ray.kill(worker)


def test_the_hook_installs_nothing_unless_time_sharing_is_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process the variable reaches without RLIX_CONTROL_PLANE=rlix (a worker started by hand with a copied
    environment) is left alone; megatron_worker_env never names our hook twice."""
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import (
        CHAINED_SETUP_HOOK_ENV,
        SETUP_HOOK,
        megatron_worker_env,
        worker_process_setup_hook,
    )

    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    monkeypatch.delenv(CHAINED_SETUP_HOOK_ENV, raising=False)
    before = ps.initialize_model_parallel
    worker_process_setup_hook()
    assert ps.initialize_model_parallel is before
    once = megatron_worker_env({"A": "1"}, inherited={})
    assert megatron_worker_env(once, inherited={}) == once and CHAINED_SETUP_HOOK_ENV not in once
    assert SETUP_HOOK in once.values()
