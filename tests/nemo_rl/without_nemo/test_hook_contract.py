"""The hook contract through pluggy, as NeMo RL runs it: the REAL seam (patch 0001's ``rlix_hooks.py``,
materialised from the patch text) builds its ``PluginManager`` from its hook spec and loads our ``NemoRLHooks``
through the installed ``nemo_rl.rlix_hooks`` entry point (its own ``load_rlix_hooks``); every hook is then fired
through the seam's caller with every argument of its spec. Runs in CI: no NeMo RL checkout needed.

Why: pluggy hands an implementation only the arguments it names WITHOUT a default (a defaulted one silently gets
its default), so a hook can look right when called directly and still lose an argument under NeMo RL (issue 11
finding 1: ``replay_buffer`` never reached the runtime, the progress thread never started).
"""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import ray

from tests.nemo_rl._nemo_checkout import seam_from_patch


def _load_seam(tmp_path: Path) -> ModuleType:
    path = seam_from_patch(tmp_path)
    spec = importlib.util.spec_from_file_location("rlix_hooks_seam_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclass / typing look-ups resolve the module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def seam(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    return _load_seam(tmp_path)


def _defaulted(fn: Any) -> set[str]:
    return {n for n, p in inspect.signature(fn).parameters.items() if p.default is not inspect.Parameter.empty}


def test_every_implementation_receives_every_spec_argument(seam: ModuleType) -> None:
    """Static half: for every hook of the spec, what pluggy will pass each registered implementation (its
    ``argnames``) is exactly the spec's arguments, and no implementation parameter has a default the spec lacks."""
    pm = seam.load_rlix_hooks().plugin_manager
    ours = pm.get_plugin("rlix")
    assert type(ours).__module__ == "rlix_plugins.nemo_rl.hooks", "the entry point did not load our hooks"
    implemented = set()
    for name in seam.HOOK_NAMES:
        caller = getattr(pm.hook, name)
        spec_args = tuple(caller.spec.argnames)
        spec_defaults = _defaulted(getattr(seam.RLixHookSpec, name))
        for impl in caller.get_hookimpls():
            if impl.plugin is ours:
                implemented.add(name)
            assert tuple(impl.argnames) == spec_args, (
                f"{impl.plugin_name}.{name} receives {impl.argnames}, the spec passes {spec_args}")
            extra = _defaulted(impl.function) - spec_defaults
            assert not extra, f"{impl.plugin_name}.{name}: parameters {sorted(extra)} have defaults (pluggy never " \
                              "passes them)"
    assert implemented == set(seam.HOOK_NAMES), set(seam.HOOK_NAMES) - implemented


def _recording_pipeline_runtime(pipe: Any, calls: list[tuple[Any, ...]]) -> Any:
    """The real grant-only pipeline runtime (the training grant's one record), recording what the hooks call on it."""
    from rlix_plugins.pipeline.runtime import GrantOnlyRuntime

    class Recording(GrantOnlyRuntime):
        def before_weight_sync(self, step: int) -> int:
            calls.append(("build_cache", step))
            return super().before_weight_sync(step)

        def on_published(self, step: int, version: int) -> None:
            calls.append(("on_published", step, version))
            super().on_published(step, version)

    return Recording(pipe)


class RecordingRuntime:
    """A ``HookRuntime`` (hooks.py Protocol) that records every argument the hooks hand it (and its pipeline runtime
    ``rt``) and does the control-plane part of each call (the grants), so the hooks run on the real control plane."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.pipe: Any = None
        self.rt: Any = None

    def register(self, cp: Any, held: Any) -> Any:
        self.calls.append(("register", held is not None))
        self.pipe = held
        self.rt = _recording_pipeline_runtime(held, self.calls)
        return held

    def start(self, master_config: Any, policy: Any, policy_generation: Any, start_step: int) -> None:
        from rlix_plugins.control.types import GENERATION_CLUSTER

        self.calls.append(("start", master_config, policy, policy_generation, start_step))
        self.pipe.release_gpus(GENERATION_CLUSTER, step=-1, timeout_s=60)  # the setup grant, as the runtime does

    def attach_collector(self, collector: Any, replay_buffer: Any) -> None:
        self.calls.append(("attach_collector", collector, replay_buffer))

    def before_training(self, step: int) -> list[int]:
        self.calls.append(("before_training", step))
        return list(self.rt.before_training(step))

    def after_training(self, step: int) -> int:
        self.calls.append(("after_training", step))
        return step + 1

    def step_metrics(self, step: int) -> dict[str, float]:
        self.calls.append(("step_metrics", step))
        return {"rlix/ranks_expanded": 2.0}

    def before_checkpoint(self, step: int) -> None:
        self.calls.append(("before_checkpoint", step))

    def after_checkpoint(self, step: int) -> None:
        self.calls.append(("after_checkpoint", step))

    def stop(self, error: str | None = None) -> None:
        self.calls.append(("stop",))
        self.pipe.unregister("test over")


def _config() -> dict[str, Any]:
    return {
        "rlix": {"train_devices": [2], "infer_devices": [2, 3], "request_timeout_s": 60, "init_timeout_s": 60},
        "cluster": {"gpus_per_node": 4},
        "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {"megatron_cfg": {"enabled": True}, "generation": {
            "backend": "vllm", "colocated": {"enabled": False},
            "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
    }


def test_every_hook_fired_through_the_seam_delivers_every_argument(seam: ModuleType,
                                                                   ray_cluster: dict[str, float]) -> None:
    """Dynamic half: setup()'s hook instance answers the placement; the loop's instance (a second
    ``load_rlix_hooks()``, as in NeMo RL) takes over setup()'s registration and grant; each hook's arguments reach
    the runtime unchanged (the replay buffer included), and the publish returns the step's ``rlix/`` metrics."""
    from rlix_plugins.control import client
    from rlix_plugins.nemo_rl.placement import placement_pool

    cp = client.connect()
    pool = placement_pool(worker_groups_per_gpu=1)
    cfg = _config()
    try:
        before = set(cp.status()["pipelines"])
        placement = seam.load_rlix_hooks().rlix_placement(master_config=cfg)  # setup()'s own instance
        assert placement is not None and type(placement[0]).__name__ == "VirtualClusterAdapter"
        [pid] = set(cp.status()["pipelines"]) - before  # handed to the loop's hooks with setup()'s grant
        assert "pipeline_id" not in cfg["rlix"], "NeMo RL's config must not be written"
        assert pid in cp.status()["pipelines"], "setup() did not register the pipeline before its workers existed"

        hooks = seam.load_rlix_hooks()  # the loop's instance
        ours = hooks.plugin_manager.get_plugin("rlix")
        runtime = ours.runtime = RecordingRuntime()
        policy, generation, collector, replay_buffer = object(), object(), object(), object()
        hooks.rlix_pipeline_start(master_config=cfg, policy=policy, policy_generation=generation, start_step=3)
        hooks.on_trajectory_collector_created(collector=collector, replay_buffer=replay_buffer)
        hooks.before_training(step=3)
        hooks.before_weight_sync(step=3)
        version = hooks.after_training(step=3)
        metrics = hooks.on_weight_version_published(step=3, weight_version=version)
        hooks.before_checkpoint(step=3)
        hooks.after_checkpoint(step=3)
        hooks.on_pipeline_end()
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
    assert runtime.calls == [
        ("register", True), ("start", cfg, policy, generation, 3), ("attach_collector", collector, replay_buffer),
        ("before_training", 3), ("build_cache", 3), ("after_training", 3), ("on_published", 3, 4),
        ("step_metrics", 3), ("before_checkpoint", 3), ("after_checkpoint", 3), ("stop",),
    ]
    assert version == 4
    assert metrics["rlix/published_version"] == 4.0 and metrics["rlix/ranks_expanded"] == 2.0
    assert metrics["rlix/wait_train_grant_s"] >= 0.0
    assert pid not in cp.status()["pipelines"]
