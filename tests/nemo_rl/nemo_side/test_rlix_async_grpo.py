# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/``) with NeMo RL's own pytest and fixtures.

``async_grpo_train`` runs for real on NeMo RL's mock policy / collector / replay buffer
(``mock_grpo_components``, ``mock_async_grpo_infrastructure``). In time-sharing mode the hooks are loaded through
the real entry point, and the real rlix control plane runs on this session's Ray cluster (4 GPUs declared).
Driven by ``tests/nemo_rl/test_nemo_rl_time_sharing.py`` of rlix-plugins; not part of NeMo RL.
"""

import os
import sys
import time
from unittest.mock import MagicMock, patch

import pytest
import ray
from nemo_rl.algorithms import rlix_hooks as seam
from nemo_rl.algorithms.grpo import async_grpo_train
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (fixture import)
    StubAsyncTrajectoryCollector,
    _initial_grpo_save_state,
    _mock_policy_generation,
    _patched_logprob_phase,
    mock_async_grpo_infrastructure,
    mock_grpo_components,
)

_REAL_RAY_GET = ray.get
NUM_STEPS = 3


@pytest.fixture(scope="session", autouse=True)
def init_ray_cluster():
    """Overrides NeMo RL's: the control plane needs a GPU pool (the driver's private head declares 4 GPUs)."""
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], namespace="rlix_conformance")
    else:
        ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, namespace="rlix_conformance")
    yield
    ray.shutdown()


@pytest.fixture(scope="session", autouse=True)
def ray_gpu_monitor(init_ray_cluster):
    """Overrides NeMo RL's GPU monitor (no GPUs here)."""
    yield None


def _real_or_stub_get(stub_get):
    """NeMo RL's fixture patches ray.get for its stubs; control-plane ObjectRefs still need the real one."""

    def get(ref, **kwargs):
        refs = ref if isinstance(ref, list) else [ref]
        if refs and all(isinstance(r, ray.ObjectRef) for r in refs):
            return _REAL_RAY_GET(ref, **kwargs)
        return stub_get(ref, **kwargs)

    return get


class _RecordingCollector(StubAsyncTrajectoryCollector):
    """NeMo RL's collector stub, plus the published weight versions (and whether training GPUs were held)."""

    def __init__(self, events, probe):
        super().__init__(events=None)
        self._log, self._probe = events, probe

    def _recording(self, name):
        mock = MagicMock()
        mock.remote = MagicMock(side_effect=lambda *a, **k: self._log.append((name, a[0] if a else None, self._probe())))
        return mock

    @property
    def set_weight_version(self):
        return self._recording("set_weight_version")

    @property
    def start_collection(self):
        return self._recording("start_collection")

    @property
    def prepare_for_refit(self):
        return self._recording("prepare_for_refit")

    @property
    def resume_after_refit(self):
        return self._recording("resume_after_refit")


def _configure(components, tmp_path):
    cfg = components["master_config"]
    cfg.policy["generation"]["backend"] = "vllm"
    cfg.policy["generation"]["colocated"]["enabled"] = False
    cfg.grpo.max_num_steps = NUM_STEPS
    cfg.grpo.val_period = 2
    cfg.grpo.val_at_start = True
    cfg.grpo.val_at_end = False
    cfg.checkpointing["enabled"] = True
    cfg.checkpointing["save_period"] = 2  # step index 1 saves by period, step 2 as the last step
    cfg.checkpointing["metric_name"] = None
    cfg.grpo.async_grpo.enabled = True  # the topology check requires async GRPO (the mock left it off)
    cfg.rlix = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 60}
    components["checkpointer"].init_tmp_checkpoint.return_value = str(tmp_path)
    components["checkpointer"].checkpoint_dir = tmp_path
    return cfg


def _run(components, policy_generation, events, probe, refits):
    policy = components["policy"]
    collector = _RecordingCollector(events, probe)
    collector_cls = MagicMock()
    collector_cls.options.return_value.remote.return_value = collector
    batch = next(iter(components["train_dataloader"]))
    stack = mock_async_grpo_infrastructure(
        batch, {"mean_gen_tokens_per_sample": 2.0}, refit_side_effect=lambda *a, **k: refits.append(a)
    )
    with stack, _patched_logprob_phase(policy):
        stub_get = ray.get  # NeMo RL's patched ray.get
        with (
            patch("ray.get", side_effect=_real_or_stub_get(stub_get)),
            patch("nemo_rl.algorithms.async_utils.AsyncTrajectoryCollector", collector_cls),
            patch("nemo_rl.algorithms.grpo.validate", return_value=({"accuracy": 0.5}, {})),
            patch("nemo_rl.algorithms.grpo.torch.save"),
        ):
            async_grpo_train(
                policy,
                policy_generation,
                components["train_dataloader"],
                components["val_dataloader"],
                components["tokenizer"],
                components["loss_fn"],
                components["task_to_env"],
                components["val_task_to_env"],
                components["logger"],
                components["checkpointer"],
                _initial_grpo_save_state(),
                components["master_config"],
            )


def _record_policy(policy, events, probe):
    for name in ("prepare_for_lp_inference", "offload_after_refit", "save_checkpoint"):
        getattr(policy, name).side_effect = lambda *a, _n=name, **k: events.append((_n, None, probe()))
    result = policy.train.return_value
    policy.train.side_effect = lambda *a, **k: (events.append(("train", None, probe())), result)[1]


def test_standalone_loads_nothing_of_rlix(mock_grpo_components, tmp_path, monkeypatch):
    """Variable unset: the standalone refit path runs and no module of rlix_plugins is imported."""
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")], "imported before the run"
    _configure(mock_grpo_components, tmp_path)
    events, refits = [], []
    generation = _mock_policy_generation()
    _record_policy(mock_grpo_components["policy"], events, lambda: None)
    _run(mock_grpo_components, generation, events, lambda: None, refits)
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")]
    assert len(refits) == 1 + NUM_STEPS  # initial refit + one per step
    assert [v for n, v, _ in events if n == "set_weight_version"] == [0, 1, 2, 3]


def test_time_sharing_hook_order_with_real_control_plane(mock_grpo_components, tmp_path, monkeypatch):
    """RLIX_CONTROL_PLANE=rlix: real entry point, real hooks, real control plane; the order of every step."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    from rlix_plugins.control import client

    cp = client.connect()
    loaded = {}
    real_load = seam.load_rlix_hooks

    def load_and_keep():
        loaded["hooks"] = real_load()
        return loaded["hooks"]

    def impl():
        return loaded["hooks"].plugin_manager.get_plugin("rlix") if "hooks" in loaded else None

    def probe():
        """(training GPUs allocated to this pipeline right now per the scheduler, the last hook event)."""
        hooks = impl()
        if hooks is None or hooks.pipeline_id is None:
            return (None, None)
        loaded["pid"] = pid = hooks.pipeline_id
        allocs = cp.status()["allocations"]
        held = any(a["pipeline_id"] == pid and cid.endswith("actor_train") for cid, a in allocs.items())
        return (held, hooks.history[-1].name if hooks.history else None)

    _configure(mock_grpo_components, tmp_path)
    events, refits = [], []
    generation = _mock_policy_generation()
    _record_policy(mock_grpo_components["policy"], events, probe)
    t0 = time.time()
    with patch.object(seam, "load_rlix_hooks", side_effect=load_and_keep):
        _run(mock_grpo_components, generation, events, probe, refits)

    hooks = impl()
    assert type(hooks).__module__ == "rlix_plugins.nemo_rl.hooks", "the entry point did not load our hooks"
    pid = loaded["pid"]

    # No standalone refit / prepare / finish / refit pause in time-sharing mode.
    assert refits == []
    generation.prepare_for_generation.assert_not_called()
    generation.finish_generation.assert_not_called()
    assert not [e for e in events if e[0] in ("prepare_for_refit", "resume_after_refit")]

    # Versions published: the initial one, then step + 1 per step; never -1, never bumped twice.
    versions = [v for n, v, _ in events if n == "set_weight_version"]
    assert versions == list(range(NUM_STEPS + 1)), versions

    # The scheduler says the training GPUs are held from log-prob inference through the publish.
    for name in ("prepare_for_lp_inference", "train", "offload_after_refit", "save_checkpoint"):
        seen = [p for n, _, p in events if n == name]
        assert seen and all(p[0] is True for p in seen), (name, events)
    assert all(p[0] is True for n, v, p in events if n == "set_weight_version" and v > 0), events
    # Cache-build hook (before_weight_sync) ran right before every offload.
    assert [p[1] for n, _, p in events if n == "offload_after_refit"] == ["weights_on_gpu"] * NUM_STEPS
    # Checkpoints ran inside their own grant.
    assert [p[1] for n, _, p in events if n == "save_checkpoint"] == ["checkpoint_granted"] * 2

    step_events = ("train_granted", "weights_on_gpu", "offloaded", "published", "train_released")
    for step in range(NUM_STEPS):
        per = [h.name for h in hooks.history if h.step == step and h.name in step_events]
        assert per == list(step_events), (step, per)  # released only after the version was published
    names = [h.name for h in hooks.history]
    assert names.count("checkpoint_granted") == names.count("checkpoint_released") == 2
    assert names[0] == "registered" and names[-1] == "ended"

    # The control plane agrees: grants and releases alternate, pipeline unregistered, nothing allocated.
    trace = [e for e in cp.trace(t0) if e.pipeline_id == pid and e.cluster_id.endswith("actor_train")]
    ops = [e.op for e in trace if e.op in ("allocate", "release")]
    assert ops == ["allocate", "release"] * (NUM_STEPS + 2), ops  # one grant per step + two checkpoints
    status = cp.status()
    assert pid not in status["pipelines"], status["pipelines"]
    assert not [c for c, a in status["allocations"].items() if a["pipeline_id"] == pid]
