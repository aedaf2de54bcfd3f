# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/``) with NeMo RL's own pytest and fixtures.

``async_grpo_train`` runs for real on NeMo RL's mock policy / collector / replay buffer
(``mock_grpo_components``, ``mock_async_grpo_infrastructure``). In time-sharing mode the hooks are loaded through
the real entry point, and the real rlix control plane runs on this session's Ray cluster (4 GPUs declared).
Driven by ``tests/nemo_rl/test_nemo_rl_time_sharing.py`` of rlix-plugins; not part of NeMo RL.
"""

import sys
import time

from tests.unit.algorithms.rlix_grpo_harness import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    HookCapture,
    RecordingCollector,
    configure,
    init_ray_cluster,
    ray_gpu_monitor,
    record_policy,
    run_async_grpo,
)
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (fixture import)
    _mock_policy_generation,
    mock_grpo_components,
)

NUM_STEPS = 3
RLIX = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 60}


def _configure(components, tmp_path):
    return configure(components, tmp_path, steps=NUM_STEPS, rlix=RLIX)


def _run(components, policy_generation, events, probe, refits):
    run_async_grpo(components, policy_generation, RecordingCollector(events, probe), refits)


def test_standalone_loads_nothing_of_rlix(mock_grpo_components, tmp_path, monkeypatch):
    """Variable unset: the standalone refit path runs and no module of rlix_plugins is imported."""
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")], "imported before the run"
    _configure(mock_grpo_components, tmp_path)
    events, refits = [], []
    generation = _mock_policy_generation()
    record_policy(mock_grpo_components["policy"], events, lambda: None)
    _run(mock_grpo_components, generation, events, lambda: None, refits)
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")]
    assert len(refits) == 1 + NUM_STEPS  # initial refit + one per step
    assert [v for n, v, _ in events if n == "set_weight_version"] == [0, 1, 2, 3]


def test_time_sharing_hook_order_with_real_control_plane(mock_grpo_components, tmp_path, monkeypatch):
    """RLIX_CONTROL_PLANE=rlix: real entry point, real hooks, real control plane; the order of every step."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    from rlix_plugins.control import client

    cp = client.connect()
    capture = HookCapture()
    loaded = {}

    def impl():
        return capture.impl

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
    record_policy(mock_grpo_components["policy"], events, probe)
    t0 = time.time()
    with capture:
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
