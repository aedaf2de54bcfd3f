"""Driver of ``test_nemo_rl_uv_venv.py``: run by ``uv run --locked python THIS`` in a NeMo RL checkout, as a user
runs ``uv run examples/run_grpo.py``. It joins Ray with NeMo RL's ``init_ray()`` (the test's private head, named
by ``RAY_ADDRESS``; the driver's environment becomes the job's ``runtime_env``), asks NeMo RL for the runtime_env of
the actor async GRPO starts (``make_actor_runtime_env("nemo_rl.algorithms.async_utils.ReplayBuffer")``: registry
-> ``PY_EXECUTABLES.VLLM`` -> ``create_local_venv_on_each_node`` -> ``uv venv`` + ``uv sync`` + ``uv run``), starts
an actor with it and prints, as one JSON line after ``RESULT ``, what that actor sees.

Only NeMo RL's venv machinery and Ray run here; the probe is ours (NeMo RL's ReplayBuffer module needs torch,
which the CPU copy leaves out).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import ray

FQN = "nemo_rl.algorithms.async_utils.ReplayBuffer"
GROUPS = ("nemo_rl.rlix_hooks", "vllm.general_plugins")


class Probe:
    def look(self) -> dict:
        import importlib.metadata as md
        import importlib.util

        out: dict = {
            "executable": sys.executable,
            "prefix": sys.prefix,
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "eps": {g: {e.name: e.value for e in md.entry_points(group=g)} for g in GROUPS},
        }
        spec = importlib.util.find_spec("rlix_plugins")
        out["rlix_plugins_origin"] = spec.origin if spec else None
        dist = None
        with contextlib.suppress(md.PackageNotFoundError):
            dist = md.distribution("rlix-plugins")
        out["dist_path"] = str(dist.locate_file("")) if dist else None
        if spec is None:
            return out
        hooks = md.entry_points(group="nemo_rl.rlix_hooks")["rlix"].load()
        register = md.entry_points(group="vllm.general_plugins")["rlix"].load()
        import rlix_plugins.nemo_rl.hooks as hooks_mod
        import rlix_plugins.nemo_rl.worker_ops as ops  # what NeMo RL's workers run through __ray_call__

        out["loaded"] = {
            "hooks": f"{hooks.__module__}:{hooks.__qualname__}",
            "hooks_file": hooks_mod.__file__,
            "register": f"{register.__module__}:{register.__qualname__}",
            "worker_ops_file": ops.__file__,
        }
        return out


def main() -> None:
    from nemo_rl.distributed.virtual_cluster import init_ray
    from nemo_rl.utils.venvs import make_actor_runtime_env

    assert os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS must name the test's private Ray head"
    init_ray()
    try:
        runtime_env = make_actor_runtime_env(FQN)
        actor = ray.remote(num_cpus=0)(Probe).options(runtime_env=runtime_env).remote()
        seen = ray.get(actor.look.remote(), timeout=300)
        seen["driver_executable"] = sys.executable
        seen["py_executable"] = runtime_env["py_executable"]
        print("RESULT " + json.dumps(seen), flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
