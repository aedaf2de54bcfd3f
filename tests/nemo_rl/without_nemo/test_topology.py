"""Start-up validation of the NeMo RL config (``rlix:`` keys + topology), and that the hooks call it. CI, no NeMo RL."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import load_run_config
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from rlix_plugins.nemo_rl.topology import (
    ASYNC_GRPO,
    DATA_PLANE,
    SINGLE_CONTROLLER,
    grpo_loop,
    is_one_gpu_topology,
    is_one_rank_topology,
    topology_problems,
    validate_topology,
)


def _valid(**rlix: Any) -> dict[str, Any]:
    return {
        "rlix": {"train_devices": [0], "infer_devices": [0, 1], **rlix},
        "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 8},
        "loss_fn": {"use_importance_sampling_correction": True},
        "cluster": {"gpus_per_node": 2},
        "policy": {"megatron_cfg": {"enabled": True, "tensor_model_parallel_size": 1},
                   "generation": {"backend": "vllm", "colocated": {"enabled": False},
                                  "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
    }


def _problems(cfg: dict[str, Any]) -> list[str]:
    return topology_problems(cfg, load_run_config(cfg))


def test_valid_config_and_runtime_knobs() -> None:
    cfg = _valid(sleep_level=1, bucket_size_bytes=1 << 20, sync_timeout_s=30, watchdog_interval_s=0.5)
    assert _problems(cfg) == []
    run = load_run_config(cfg)
    rc = run.runtime
    assert (rc.sleep_level, rc.sync_timeout_s, rc.watchdog_interval_s) == (1, 30.0, 0.5)
    assert run.bucket_size_bytes == 1 << 20
    assert rc.step_target_estimate == 8  # default: grpo.num_prompts_per_step


@pytest.mark.parametrize(
    ("edit", "fix"),
    [
        (lambda c: c["rlix"].update(train_devices=[2]), "must be a subset of rlix.infer_devices"),
        (lambda c: c["rlix"].update(infer_devices=[0, 1], infer_tp=2), "needs >= 2"),  # 1 rank, not one GPU
        (lambda c: c["rlix"].update(train_devices=[0, 1]), "at least one full DP rank"),
        (lambda c: c["rlix"].update(infer_devices=[0, 1, 2], infer_tp=2), "not a multiple of the vLLM tensor"),
        (lambda c: c["policy"]["megatron_cfg"].update(tensor_model_parallel_size=2), "Megatron TP·PP·CP·EP"),
        (lambda c: c["grpo"]["async_grpo"].update(enabled=False), "no time-shared GRPO loop"),
        (lambda c: c["policy"]["generation"]["colocated"].update(enabled=True), "colocated.enabled=false"),
        (lambda c: c["policy"]["generation"]["vllm_cfg"].update(async_engine=False), "async_engine=true"),
        (lambda c: c["loss_fn"].update(use_importance_sampling_correction=False), "importance_sampling_correction"),
        (lambda c: c["policy"]["generation"]["vllm_cfg"].update(sleep_level=1), "set both to the same value"),
        (lambda c: c["policy"]["generation"].update(backend="sglang"), "vLLM only"),
        (lambda c: c["policy"]["generation"]["vllm_cfg"].update(pipeline_parallel_size=2),
         "set policy.generation.vllm_cfg.pipeline_parallel_size=1"),
        (lambda c: c["policy"]["generation"]["vllm_cfg"].update(expert_parallel_size=4),
         "expert_parallel_size=4 > tensor_parallel_size=1"),
        (lambda c: (c["rlix"].update(infer_devices=[0, 1, 2, 3], infer_tp=4),
                    c["policy"]["generation"]["vllm_cfg"].update(tensor_parallel_size=4, expert_parallel_size=2)),
         "expert_parallel_size=2 < tensor_parallel_size=4"),
    ],
)
def test_each_rule_names_its_fix(edit: Any, fix: str) -> None:
    cfg = copy.deepcopy(_valid())
    edit(cfg)
    problems = _problems(cfg)
    assert any(fix in p for p in problems), problems


def _data_plane(single_controller: bool = False) -> dict[str, Any]:
    """The TransferQueue loop (``run_grpo.py`` with ``data_plane.enabled``), or the SingleController's config (an
    ``async_rl`` section): async GRPO off, no importance-sampling correction required."""
    cfg = copy.deepcopy(_valid())
    cfg["grpo"]["async_grpo"]["enabled"] = False
    cfg["loss_fn"]["use_importance_sampling_correction"] = False
    cfg["data_plane"] = {"enabled": True}
    if single_controller:
        cfg["async_rl"] = {"max_buffered_rollouts": 8}
    return cfg


def test_the_other_grpo_loops_are_accepted() -> None:
    """The loops the second patch part drives pass the check; each keeps the vLLM rules; nothing at all is refused."""
    assert grpo_loop(_valid()) == ASYNC_GRPO
    for single_controller, loop in ((False, DATA_PLANE), (True, SINGLE_CONTROLLER)):
        cfg = _data_plane(single_controller)
        assert grpo_loop(cfg) == loop and _problems(cfg) == []
        cfg["policy"]["generation"]["vllm_cfg"]["async_engine"] = False
        assert any("async_engine=true" in p for p in _problems(cfg))
    sync = _data_plane()
    sync["data_plane"]["enabled"] = False
    assert grpo_loop(sync) is None
    assert any("no time-shared GRPO loop" in p and "data_plane.enabled=true" in p for p in _problems(sync))
    with_async = _valid()  # run_grpo.py checks async GRPO first, as grpo_loop does
    with_async["data_plane"] = {"enabled": True}
    assert grpo_loop(with_async) == ASYNC_GRPO


def _dtensor(**dtensor_cfg: Any) -> dict[str, Any]:
    """The stock grpo_math_1B policy: DTensor (FSDP2) v2, Megatron off."""
    cfg = copy.deepcopy(_valid(train_devices=[0, 1], infer_devices=[0, 1, 2, 3]))
    cfg["policy"]["megatron_cfg"]["enabled"] = False
    cfg["policy"]["dtensor_cfg"] = {"enabled": True, "_v2": True, "tensor_parallel_size": 1,
                                    "context_parallel_size": 1, **dtensor_cfg}
    return cfg


def test_dtensor_policy_is_accepted_and_its_tp_cp_divide_the_training_gpus() -> None:
    assert _problems(_dtensor()) == []
    assert _problems(_dtensor(tensor_parallel_size=2)) == []  # 2 training GPUs = one TP·CP = 2 replica
    problems = _problems(_dtensor(tensor_parallel_size=2, context_parallel_size=2))
    assert any("DTensor TP·CP = 2·2" in p for p in problems), problems


def test_two_training_backends_are_refused() -> None:
    cfg = _dtensor()
    cfg["policy"]["megatron_cfg"]["enabled"] = True
    assert any("both true" in p for p in _problems(cfg))


def test_all_problems_in_one_error() -> None:
    cfg = _valid(train_devices=[0, 1])
    cfg["grpo"]["async_grpo"]["enabled"] = False
    with pytest.raises(RlixConfigError) as err:
        validate_topology(cfg, load_run_config(cfg))
    assert "at least one full DP rank" in str(err.value) and "no time-shared GRPO loop" in str(err.value)


@pytest.mark.parametrize(("key", "value"), [("sleep_level", 3), ("bucket_size_bytes", 0), ("sync_timeout_s", -1),
                                            ("verify", "yes"), ("infer_devices", [0, 0])])
def test_bad_rlix_keys(key: str, value: Any) -> None:
    with pytest.raises(RlixConfigError, match=key if key != "infer_devices" else "twice"):
        load_run_config(_valid(**{key: value}))


def test_hooks_validate_before_registering() -> None:
    """The reference defined its topology check but never called it: ours runs in rlix_pipeline_start, before any
    Ray or control-plane call (no cluster needed for this test to fail fast)."""
    cfg = _valid(train_devices=[0, 1])
    hooks = NemoRLHooks()
    with pytest.raises(RlixConfigError, match="full DP rank"):
        hooks.rlix_pipeline_start(master_config=cfg, policy=None, policy_generation=None, start_step=0)
    assert hooks.pipeline_id is None


def test_one_gpu_topology_is_an_explicit_case() -> None:
    """train = infer = [g], one vLLM DP rank: accepted (is_one_gpu_topology says why it is safe), on any GPU id,
    with the DTensor trainer too; every other rule still applies to it."""
    for g in (0, 3):
        cfg = _valid(train_devices=[g], infer_devices=[g])
        assert is_one_gpu_topology(load_run_config(cfg)) and _problems(cfg) == []
    dtensor = _valid(train_devices=[0], infer_devices=[0])
    dtensor["policy"]["megatron_cfg"]["enabled"] = False
    dtensor["policy"]["dtensor_cfg"] = {"enabled": True, "tensor_parallel_size": 1}
    assert _problems(dtensor) == []
    colocated = _valid(train_devices=[0], infer_devices=[0])
    colocated["policy"]["generation"]["colocated"]["enabled"] = True
    assert any("colocated.enabled=false" in p for p in _problems(colocated))


@pytest.mark.parametrize(
    ("rlix", "fix"),
    [
        ({"train_devices": [1], "infer_devices": [0]}, "must be a subset of rlix.infer_devices"),  # trains elsewhere
        ({"train_devices": [0, 1], "infer_devices": [0, 1]}, "at least one full DP rank"),  # 2 GPUs, none outside
        ({"train_devices": [0], "infer_devices": [0], "infer_tp": 2}, "not a multiple of the vLLM tensor"),
        ({"train_devices": [0], "infer_devices": [0, 1], "infer_tp": 2}, "splits a vLLM tensor-parallel rank"),
    ],
)
def test_unsafe_one_gpu_variants_are_refused_with_the_fix(rlix: dict[str, Any], fix: str) -> None:
    cfg = _valid(**rlix)
    cfg["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = rlix.get("infer_tp", 1)
    run = load_run_config(cfg)
    assert not is_one_gpu_topology(run)
    problems = _problems(cfg)
    assert any(fix in p for p in problems), problems


def test_one_tensor_parallel_rank_is_the_one_rank_topology_and_training_takes_whole_ranks() -> None:
    """vLLM TP 2: train = infer = one rank's two GPUs is the one-rank topology (like one GPU, TP 1); on four GPUs
    training must list whole ranks (each a placement group NeMo RL fills with training workers)."""
    def tp2(**rlix: Any) -> dict[str, Any]:
        cfg = _valid(**rlix, infer_tp=2)
        cfg["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = 2
        return cfg

    one_rank = tp2(train_devices=[2, 3], infer_devices=[2, 3])
    run = load_run_config(one_rank)
    assert is_one_rank_topology(run) and not is_one_gpu_topology(run) and _problems(one_rank) == []
    assert _problems(tp2(train_devices=[2, 3], infer_devices=[0, 1, 2, 3])) == []
    split = _problems(tp2(train_devices=[1, 2], infer_devices=[0, 1, 2, 3]))
    assert any("splits a vLLM tensor-parallel rank" in p and "[[0, 1], [2, 3]]" in p for p in split), split
    reordered = _problems(tp2(train_devices=[3, 2], infer_devices=[0, 1, 2, 3]))
    assert any("each in that order" in p for p in reordered), reordered


def test_rank_rule_messages_point_at_the_one_gpu_topology() -> None:
    problems = _problems(_valid(train_devices=[0, 1], infer_devices=[0, 1]))
    assert any("rlix.train_devices = rlix.infer_devices = [g] with vLLM TP 1" in p for p in problems), problems


def test_megatron_tp2_on_one_gpu_is_refused() -> None:
    cfg = _valid(train_devices=[0], infer_devices=[0])
    cfg["policy"]["megatron_cfg"]["tensor_model_parallel_size"] = 2
    assert any("Megatron TP·PP·CP·EP" in p for p in _problems(cfg))


def test_the_rlix_keys_are_the_records_fields_parsed_once() -> None:
    """One declaration per knob: the section's keys are RlixRunConfig's and RuntimeConfig's fields (every runtime
    knob settable, each default declared once), values validated by the records, errors naming ``rlix.<key>``."""
    from dataclasses import fields

    from rlix_plugins.pipeline.config import RuntimeConfig

    run = load_run_config(_valid(resize_lock_timeout_s=7, max_route_attempts=3, post_sleep_max_bytes=None))
    assert (run.runtime.resize_lock_timeout_s, run.runtime.max_route_attempts) == (7, 3)
    assert run.runtime.post_sleep_max_bytes is None
    assert load_run_config(_valid()).runtime == RuntimeConfig(step_target_estimate=8)  # the declared defaults
    with pytest.raises(RlixConfigError, match=r"^rlix\.drain_timeout_s=True must be a positive number of seconds"):
        load_run_config(_valid(drain_timeout_s=True))
    with pytest.raises(RlixConfigError) as err:
        load_run_config(_valid(nope=1))
    assert all(f.name in str(err.value) for f in fields(RuntimeConfig))


def test_data_plane_gets_a_per_pipeline_transfer_queue_namespace() -> None:
    """Patch 0007 reads ``data_plane.rlix_namespace``: one per pipeline, written only when the data plane is on."""
    from rlix_plugins.nemo_rl.config import scope_data_plane

    a, b, plain = _data_plane(), _data_plane(True), _valid()
    assert scope_data_plane(a, "ft_a") == a["data_plane"]["rlix_namespace"] == "rlix_tq_ft_a"
    assert scope_data_plane(b, "ft_b") == "rlix_tq_ft_b"
    assert scope_data_plane(plain, "ft_c") is None and "data_plane" not in plain


def test_single_controller_streaming_on_one_gpu_is_refused_with_the_fix() -> None:
    """On one GPU the SingleController's only rollout rank sleeps while it holds the training grant, which spans
    every chunk of a step: a streamed step (fewer groups per chunk than per step) would wait forever."""
    cfg = _data_plane(single_controller=True)
    cfg["rlix"].update(train_devices=[0], infer_devices=[0])
    cfg["async_rl"] = {"min_groups_for_streaming_train": 2}
    [problem] = _problems(cfg)
    assert "min_groups_for_streaming_train=${grpo.num_prompts_per_step}" in problem
    cfg["async_rl"]["min_groups_for_streaming_train"] = 8
    assert _problems(cfg) == []
    cfg["async_rl"]["min_groups_for_streaming_train"] = "${grpo.num_prompts_per_step}"  # unresolved: not judged
    assert _problems(cfg) == []
    cfg["async_rl"]["min_groups_for_streaming_train"] = 2
    cfg["rlix"].update(infer_devices=[0, 1])  # a rank outside the training GPU keeps generating: streaming is fine
    assert _problems(cfg) == []
