"""Shared by the inside_nemo scenarios: runs INSIDE a patched NeMo RL copy (copied next to them into
``tests/unit/algorithms/``), imported as ``tests.unit.algorithms.rlix_grpo_harness``. Not a test module.

* fixtures ``init_ray_cluster`` / ``ray_gpu_monitor`` from ``rlix_ray_fixtures`` (import them into a test module
  to override NeMo RL's);
* :func:`configure` - NeMo RL's ``mock_grpo_components`` config switched to the time-sharing topology;
* :func:`record_policy` - the mock policy's phases recorded with a probe of the control plane;
* :class:`HookCapture` - keeps the hook implementation the seam loaded through the entry point;
* :func:`run_async_grpo` - ``async_grpo_train`` for real on NeMo RL's mocks (``mock_async_grpo_infrastructure``),
  with a given collector object (NeMo RL's stub or a real Ray actor), optionally a replay buffer actor and a start
  step (a resumed run), and the real ``ray.get`` for ObjectRefs.

Driven by rlix-plugins' ``tests/nemo_rl/drives_nemo/test_nemo_rl_time_sharing.py`` and ``test_nemo_rl_two_pipelines.py``.
"""

import contextlib
import inspect
import time
from typing import Any
from unittest.mock import MagicMock, patch

import ray
from nemo_rl.algorithms import rlix_hooks as seam
from nemo_rl.algorithms.grpo import async_grpo_train
from tests.unit.algorithms.rlix_ray_fixtures import (  # noqa: F401  (re-exported for the scenarios)
    init_ray_cluster,
    ray_gpu_monitor,
)
from tests.unit.algorithms.test_grpo import (
    StubAsyncTrajectoryCollector,
    StubReplayBuffer,
    _patched_logprob_phase,
    mock_async_grpo_infrastructure,
)

try:  # NeMo RL main
    from nemo_rl.algorithms.grpo import _initial_grpo_save_state
except ImportError:  # v0.7.0 names it _default_grpo_save_state
    from nemo_rl.algorithms.grpo import _default_grpo_save_state as _initial_grpo_save_state

REAL_RAY_GET = ray.get


def real_or_stub_get(stub_get):
    """NeMo RL's fixture patches ray.get for its stubs; control-plane ObjectRefs still need the real one."""

    def get(ref, **kwargs):
        refs = ref if isinstance(ref, list) else [ref]
        if refs and all(isinstance(r, ray.ObjectRef) for r in refs):
            return REAL_RAY_GET(ref, **kwargs)
        return stub_get(ref, **kwargs)

    return get


class RecordingCollector(StubAsyncTrajectoryCollector):
    """NeMo RL's (in-process) collector stub, plus the published weight versions (and a probe's value)."""

    def __init__(self, events, probe):
        if "events" in inspect.signature(StubAsyncTrajectoryCollector.__init__).parameters:  # NeMo RL main
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

    @property
    def get_dataloader_state(self):  # v0.7.0's stub has none; its loop asks at every checkpoint
        mock = MagicMock()
        mock.remote = MagicMock(return_value={})
        return mock


class HookCapture:
    """``with HookCapture() as cap:`` - the seam's ``load_rlix_hooks`` runs for real; ``cap.impl`` is then the
    implementation registered as "rlix" (our ``NemoRLHooks`` when the entry point resolved), else None."""

    def __init__(self):
        self.manager = None
        self._patch = None

    def __enter__(self):
        real_load = seam.load_rlix_hooks

        def load_and_keep():
            self.manager = real_load()
            return self.manager

        self._patch = patch.object(seam, "load_rlix_hooks", side_effect=load_and_keep)
        self._patch.__enter__()
        return self

    def __exit__(self, *exc):
        return self._patch.__exit__(*exc)

    @property
    def impl(self):
        return None if self.manager is None else self.manager.plugin_manager.get_plugin("rlix")


def section(obj, name):
    """A config section or field: an attribute on NeMo RL main's typed configs, a key on v0.7.0's plain dicts."""
    return obj[name] if isinstance(obj, dict) else getattr(obj, name)


def put(obj, **values):
    """Set config (or save-state) fields the way the object takes them (attributes on main, keys on v0.7.0)."""
    for key, value in values.items():
        if isinstance(obj, dict):
            obj[key] = value
        else:
            setattr(obj, key, value)


def configure(components, tmp_path, *, steps: int, rlix: dict[str, Any]):
    """The mock config as a time-shared async GRPO run of ``steps`` steps: non-colocated vLLM, validation at start
    and every 2 steps, checkpoints at step index 1 (period) and at the last step, the given ``rlix`` section."""
    cfg = components["master_config"]
    cfg.policy["generation"]["backend"] = "vllm"
    cfg.policy["generation"]["colocated"]["enabled"] = False
    grpo = section(cfg, "grpo")
    put(grpo, max_num_steps=steps, val_period=2, val_at_start=True, val_at_end=False)
    cfg.checkpointing["enabled"] = True
    cfg.checkpointing["save_period"] = 2  # step index 1 saves by period, the last step as the last step
    cfg.checkpointing["metric_name"] = None
    put(section(grpo, "async_grpo"), enabled=True)  # the topology check requires async GRPO (the mock left it off)
    cfg.rlix = dict(rlix)
    components["checkpointer"].init_tmp_checkpoint.return_value = str(tmp_path)
    components["checkpointer"].checkpoint_dir = tmp_path
    return cfg


def record_policy(policy, events, probe, on_train=None):
    """Record the mock policy's phases as ``(name, None, probe())``; ``on_train(n)`` runs inside the n-th train."""
    for name in ("prepare_for_lp_inference", "offload_after_refit", "save_checkpoint"):
        getattr(policy, name).side_effect = lambda *a, _n=name, **k: events.append((_n, None, probe()))
    result = policy.train.return_value
    trains = [0]

    def train(*a, **k):
        events.append(("train", None, probe()))
        if on_train is not None:
            on_train(trains[0])
        trains[0] += 1
        return result

    policy.train.side_effect = train


def _slow_sample(delay_s):
    """NeMo RL's stub replay buffer whose ``sample`` takes ``delay_s`` (the wait for a step's rollouts)."""
    stub_sample = StubReplayBuffer.sample

    def sample(self):
        mock = stub_sample.fget(self)
        inner = mock.remote.side_effect
        mock.remote.side_effect = lambda *a, **k: (time.sleep(delay_s), inner(*a, **k))[1]
        return mock

    return patch.object(StubReplayBuffer, "sample", property(sample))


def _actor_class(handle):
    cls = MagicMock()
    cls.options.return_value.remote.return_value = handle
    return cls


def run_async_grpo(components, policy_generation, collector, refits, *, sample_delay_s: float = 0.0,
                   start_step: int = 0, replay_buffer=None):
    """``async_grpo_train`` on NeMo RL's mocks; the loop's ``AsyncTrajectoryCollector(...)`` returns ``collector``;
    ``sample_delay_s``: each step's batch is ready that long after the loop asks (outside the training grant);
    ``start_step``: the saved state's ``current_step`` (a resumed run); ``replay_buffer``: what the loop's
    ``ReplayBuffer(...)`` returns instead of NeMo RL's in-process stub (e.g. a :class:`ReplayBufferActor`)."""
    policy = components["policy"]
    batch = next(iter(components["train_dataloader"]))
    record_refit = lambda *a, **k: refits.append(a)  # noqa: E731
    if "refit_side_effect" in inspect.signature(mock_async_grpo_infrastructure).parameters:  # NeMo RL main
        stack = mock_async_grpo_infrastructure(batch, {"mean_gen_tokens_per_sample": 2.0},
                                               refit_side_effect=record_refit)
    else:  # v0.7.0's fixture patches no refit: record it here
        stack = mock_async_grpo_infrastructure(batch, {"mean_gen_tokens_per_sample": 2.0})
        stack.enter_context(patch("nemo_rl.algorithms.grpo.refit_policy_generation", side_effect=record_refit))
    save_state = _initial_grpo_save_state()
    put(save_state, current_step=start_step)
    with stack, _patched_logprob_phase(policy):
        stub_get = ray.get  # NeMo RL's patched ray.get
        with (
            patch("ray.get", side_effect=real_or_stub_get(stub_get)),
            patch("nemo_rl.algorithms.async_utils.AsyncTrajectoryCollector", _actor_class(collector)),
            patch("nemo_rl.algorithms.async_utils.ReplayBuffer", _actor_class(replay_buffer))
            if replay_buffer is not None else contextlib.nullcontext(),
            patch("nemo_rl.algorithms.grpo.validate", return_value=({"accuracy": 0.5}, {})),
            patch("nemo_rl.algorithms.grpo.torch.save"),
            _slow_sample(sample_delay_s) if sample_delay_s > 0 else contextlib.nullcontext(),
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
                save_state,
                components["master_config"],
            )


def sync_loop_stubs(policy):
    """Stubs that let ``grpo_train_sync`` run for real on NeMo RL's mock components where NeMo RL's tests have no
    ``mock_sync_grpo_infrastructure`` (v0.7.0): the Ray rollout actor returns one small slice and metadata instead
    of writing to TransferQueue, the driver's only ``ray.get`` gets that plain tuple, the refit, the advantage
    estimator, the logprob-error metrics and the performance printout are stubbed, and the TQ-mediated policy reads
    fixed per-token tensors. The loop's control flow - the part the time-sharing hooks sit in - runs unchanged.
    Uses NeMo RL's own when it has them."""
    import torch
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    try:
        from tests.unit.algorithms.test_grpo import mock_sync_grpo_infrastructure
    except ImportError:
        pass
    else:
        return mock_sync_grpo_infrastructure(policy)
    stack = contextlib.ExitStack()
    carry = BatchedDataDict({"total_reward": torch.tensor([1.0]), "prompt_ids_for_adv": torch.tensor([[1, 2, 3]]),
                             "input_lengths": torch.tensor([4]), "loss_multiplier": torch.tensor([1.0]),
                             "truncated": torch.tensor([False]), "length": torch.tensor([3])})
    meta = MagicMock()
    meta.fields = ["input_ids"]
    actor = MagicMock()
    actor.rollout_to_tq.remote.return_value = (
        meta, carry, {"mean_gen_tokens_per_sample": 10.0, "max_gen_tokens": 20, "min_gen_tokens": 5}, {})
    actor_cls = MagicMock()
    actor_cls.options.return_value.remote.return_value = actor
    errors = dict.fromkeys(("max_seq_mult_prob_error", "mean_seq_mult_prob_error", "min_seq_mult_prob_error",
                            "max_seq_mult_prob_error_after_mask", "mean_seq_mult_prob_error_after_mask",
                            "min_seq_mult_prob_error_after_mask", "masked_correct_pct"), 0.0)
    estimator = MagicMock()
    estimator.compute_advantage.return_value = torch.zeros(1, 4)
    target = "nemo_rl.algorithms.grpo_sync."
    for name, kwargs in (("SyncRolloutActor", {"new": actor_cls}),
                         ("make_actor_runtime_env", {"return_value": {}}),
                         ("refit_policy_generation", {"return_value": None}),
                         ("_compute_seq_logprob_error_metrics",
                          {"return_value": (torch.ones(1), {**errors, "num_masked_seqs": 0})}),
                         ("_create_advantage_estimator", {"return_value": estimator}),
                         ("print_performance_metrics", {"return_value": {}})):
        stack.enter_context(patch(target + name, **kwargs))
    stack.enter_context(patch("ray.get", side_effect=lambda ref, **k: ref))
    bank = {"generation_logprobs": torch.zeros(1, 4), "token_mask": torch.ones(1, 4),
            "prev_logprobs": torch.zeros(1, 4), "reference_policy_logprobs": torch.zeros(1, 4),
            "input_ids": torch.ones(1, 4, dtype=torch.long)}
    policy.read_from_dataplane.side_effect = lambda meta, select_fields, **kw: BatchedDataDict(
        {k: bank[k].clone() for k in select_fields})
    policy.train_from_meta.return_value = policy.train.return_value
    policy.tq_partition_id = 0
    return stack
