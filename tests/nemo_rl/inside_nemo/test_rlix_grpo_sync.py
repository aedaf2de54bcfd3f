# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/``) with NeMo RL's own pytest and fixtures.
The TransferQueue loop ``grpo_train_sync`` runs for real on NeMo RL's mocks (``mock_grpo_components``, and
``mock_sync_grpo_infrastructure`` through ``rlix_grpo_harness.sync_loop_stubs``, which stands in for it where a
release's tests have none: stub rollout actor and data plane). With ``RLIX_CONTROL_PLANE=rlix`` the hooks are loaded
through the real entry point and the real rlix control plane runs on this session's Ray cluster (4 GPUs).
Driven by ``tests/nemo_rl/drives_nemo/test_nemo_rl_loops.py`` of rlix-plugins; not part of NeMo RL.
"""

import sys

from tests.unit.algorithms.rlix_grpo_harness import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    HookCapture,
    _initial_grpo_save_state,
    configure,
    init_ray_cluster,
    put,
    ray_gpu_monitor,
    real_or_stub_get,
    section,
    sync_loop_stubs,
)
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (fixture import)
    _mock_policy_generation,
    mock_grpo_components,
)

NUM_STEPS = 3
RLIX = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 60}


def _run(components, tmp_path, generation, events, probe):
    from contextlib import ExitStack
    from unittest.mock import patch

    from nemo_rl.algorithms import grpo_sync

    cfg = configure(components, tmp_path, steps=NUM_STEPS, rlix=RLIX)
    grpo = section(cfg, "grpo")
    put(section(grpo, "async_grpo"), enabled=False)  # the TransferQueue loop (data_plane.enabled) is on-policy
    put(grpo, val_at_start=False, val_period=0)
    cfg.checkpointing["enabled"] = False  # its save torch.saves the mock dataloader state
    cfg.data_plane = {"enabled": True}
    cfg.policy["generation"]["vllm_cfg"]["async_engine"] = True
    policy = components["policy"]
    with ExitStack() as stack:
        stack.enter_context(sync_loop_stubs(policy))
        # After NeMo RL's identity ray.get: control-plane ObjectRefs need the real one.
        stack.enter_context(patch("ray.get", side_effect=real_or_stub_get(lambda ref, **k: ref)))
        stack.enter_context(patch.object(grpo_sync, "refit_policy_generation",
                                         side_effect=lambda *a, **k: events.append(("refit", probe()))))
        for name in ("prepare_for_lp_inference", "train_from_meta", "offload_after_refit", "save_checkpoint"):
            mock, result = getattr(policy, name), getattr(policy, name).return_value
            mock.side_effect = lambda *a, _n=name, _r=result, **k: (events.append((_n, probe())), _r)[1]
        grpo_sync.grpo_train_sync(
            policy, generation, components["train_dataloader"], components["val_dataloader"],
            components["tokenizer"], components["loss_fn"], components["task_to_env"],
            components["val_task_to_env"], components["logger"], components["checkpointer"],
            _initial_grpo_save_state(), cfg,
        )


def test_standalone_loads_nothing_of_rlix(mock_grpo_components, tmp_path, monkeypatch):
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    events = []
    _run(mock_grpo_components, tmp_path, _mock_policy_generation(), events, lambda: None)
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")]
    assert [n for n, _ in events].count("refit") == NUM_STEPS  # the lazy refit before every rollout


def test_time_sharing_hook_order_with_real_control_plane(mock_grpo_components, tmp_path, monkeypatch):
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    from rlix_plugins.control import client

    cp = client.connect()
    capture = HookCapture()

    def probe():
        hooks = capture.impl
        if hooks is None or hooks.pipeline_id is None:
            return (None, None)
        allocs = cp.status()["allocations"]
        held = any(a["pipeline_id"] == hooks.pipeline_id and cid.endswith("actor_train") for cid, a in allocs.items())
        return (held, hooks.history[-1].name if hooks.history else None)

    events = []
    generation = _mock_policy_generation()
    with capture:
        _run(mock_grpo_components, tmp_path, generation, events, probe)
    hooks = capture.impl
    assert type(hooks).__module__ == "rlix_plugins.nemo_rl.hooks", "the entry point did not load our hooks"
    assert not [e for e in events if e[0] == "refit"]  # the expand replaces the lazy refit
    generation.finish_generation.assert_not_called()
    for name in ("prepare_for_lp_inference", "train_from_meta", "offload_after_refit"):
        seen = [p for n, p in events if n == name]
        assert len(seen) >= NUM_STEPS and all(p[0] is True for p in seen), (name, events)
    assert [p[1] for n, p in events if n == "offload_after_refit"] == ["weights_on_gpu"] * NUM_STEPS
    names = [e.name for e in hooks.history]
    step = ["train_granted", "weights_on_gpu", "offloaded", "published", "train_released"]
    body = [n for n in names if n not in ("checkpoint_granted", "checkpoint_released")]
    assert body == ["registered", "collector_created", *step * NUM_STEPS, "ended"], names
    assert [e.step for e in hooks.history if e.name == "published"] == list(range(NUM_STEPS))
    assert hooks.pipeline_id is None and not cp.status()["allocations"]  # ended, nothing held
