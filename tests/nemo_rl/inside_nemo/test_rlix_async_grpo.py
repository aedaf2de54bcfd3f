# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/``) with NeMo RL's own pytest and fixtures.

``async_grpo_train`` runs for real on NeMo RL's mock policy / collector / replay buffer
(``mock_grpo_components``, ``mock_async_grpo_infrastructure``). In time-sharing mode the hooks are loaded through
the real entry point, and the real rlix control plane runs on this session's Ray cluster (4 GPUs declared).
Driven by ``tests/nemo_rl/drives_nemo/test_nemo_rl_time_sharing.py`` of rlix-plugins; not part of NeMo RL.
"""

import sys
import time
from unittest.mock import MagicMock

import ray
from tests.unit.algorithms.rlix_grpo_harness import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    REAL_RAY_GET,
    HookCapture,
    RecordingCollector,
    configure,
    init_ray_cluster,
    ray_gpu_monitor,
    record_policy,
    run_async_grpo,
    section,
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


def _full_mode(components, tmp_path, rlix: dict, *, steps: int, start: int):
    """FULL mode's parts (rlix_worker_standins): the control plane, and a namespace with the trainer stand-in (at the
    weights of step ``start``), one vLLM leader stand-in per inference GPU, the collector actor and its handle, a
    replay buffer actor, and NeMo RL's mock policy and generation wired to them."""
    from types import SimpleNamespace

    from tests.unit.algorithms.rlix_worker_standins import (  # imports rlix_plugins: not at module level
        CollectorHandle,
        RecordingCollectorActor,
        ReplayBufferActor,
        StandinMegatronWorker,
        StandinVllmLeader,
        StandinWorkerGroup,
    )

    from rlix_plugins.control import client

    cfg = configure(components, tmp_path, steps=steps, rlix=rlix)
    components["master_config"].policy["megatron_cfg"] = {"enabled": True}  # the trainer stand-in's backend
    prompts = section(section(cfg, "grpo"), "num_prompts_per_step")
    actor = {"num_cpus": 0}
    leaders = [ray.remote(StandinVllmLeader).options(**actor).remote(2) for _ in rlix["infer_devices"]]
    trainer = ray.remote(StandinMegatronWorker).options(**actor).remote(100 + start)  # the checkpoint's weights
    collector = ray.remote(RecordingCollectorActor).options(**actor).remote()
    batch = next(iter(components["train_dataloader"]))
    replay = ray.remote(ReplayBufferActor).options(**actor).remote(batch, prompts, start)
    policy = components["policy"]
    policy.worker_group = StandinWorkerGroup([trainer])
    generation = _mock_policy_generation()
    generation.worker_group = StandinWorkerGroup(leaders)
    generation.attach_fleet_health = MagicMock()  # NeMo RL's seam on VllmGeneration (the mock's spec lacks it)
    return client.connect(), SimpleNamespace(trainer=trainer, collector=collector,
                                             collector_handle=CollectorHandle(collector), replay=replay,
                                             policy=policy, generation=generation, prompts=prompts)


START, RESUMED_STEPS = 2, 2  # a run resumed at step 2 (its checkpoint), trained to step 4
FULL = {**RLIX, "init_timeout_s": 60, "sync_timeout_s": 60, "drain_timeout_s": 30, "release_timeout_s": 60,
        "watchdog_interval_s": 0.5, "bucket_size_bytes": 1 << 20}


def test_full_mode_resumed_run_progress_versions_and_logged_metrics(mock_grpo_components, tmp_path, monkeypatch):
    """FULL mode (the stand-in worker groups of rlix_worker_standins: real runtime, router, resizer, weight cache,
    transport and receiver) on a run RESUMED at step 2, with the replay buffer a real Ray actor:

    * progress: the replay buffer's count reaches the scheduler for the version each step trains on (the progress
      thread starts only if pluggy hands the hook the replay buffer: issue 11 finding 1);
    * resume: every version the collector receives before the first training step is 2 - the loop's own
      ``weight_version = step`` - including the first expand's publish (finding 4), then 3 and 4;
    * metrics: what the loop hands NeMo RL's logger as the step's training metrics carries the ``rlix/`` figures
      (finding 5): the published version, the wait for the training grant, ranks expanded / shrunk, preemptions.
    """
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    cp, full = _full_mode(mock_grpo_components, tmp_path, FULL, steps=START + RESUMED_STEPS, start=START)
    trainer, collector, replay, policy, generation, prompts = (full.trainer, full.collector, full.replay,
                                                              full.policy, full.generation, full.prompts)
    capture = HookCapture()
    at_train = []  # (versions the collector had, the scheduler's progress of this pipeline) inside each train

    def on_train(n):
        REAL_RAY_GET(trainer.train.remote(100 + START + n + 1), timeout=60)
        pid, prog = capture.impl.pipeline_id, None
        deadline = time.monotonic() + 20  # the progress thread polls once a second
        while time.monotonic() < deadline:
            prog = cp.status()["pipelines"][pid]["progress"]
            # (before the trainer first asked, the first step's count waited for the lookahead batch too)
            if prog is not None and prog["step"] == START + n and prog["completed"] == prompts:
                break
            time.sleep(0.2)
        at_train.append(([v for v, _ in REAL_RAY_GET(collector.get_versions.remote(), timeout=30)], prog))

    events, refits = [], []
    record_policy(policy, events, lambda: None, on_train=on_train)
    with capture:
        run_async_grpo(mock_grpo_components, generation, full.collector_handle, refits, start_step=START,
                       replay_buffer=replay)

    hooks = capture.impl
    assert type(hooks.runtime).__name__ == "NemoRuntime", "not in full mode: the stand-in worker groups were not seen"
    history = hooks.runtime.rt.resize_history()
    assert refits == [] and len(at_train) == RESUMED_STEPS

    # Resume: before the first training step only version START was published (expands and the loop alike).
    before_first, _ = at_train[0]
    assert before_first and set(before_first) == {START}, before_first
    versions = [v for v, _ in REAL_RAY_GET(collector.get_versions.remote(), timeout=30)]
    assert versions == sorted(versions) and sorted(set(versions)) == [START, START + 1, START + 2], versions
    syncs = [e for e in history if e["op"] in ("expand", "refresh")]
    assert syncs and all(e["verified"] for e in syncs), syncs
    assert next(e["published"] for e in history if e["op"] == "expand") == START, history
    assert REAL_RAY_GET(replay.get_sampled.remote(), timeout=30) == [START, START + 1]

    # Progress: the scheduler had this pipeline's count for the version each step trained on.
    for n, (_, prog) in enumerate(at_train):
        assert prog is not None and prog["step"] == START + n, (n, prog)
        assert prog["step_target"] == prompts and prog["completed"] == prompts, prog
    assert {(START, prompts), (START + 1, prompts)} <= set(hooks.runtime.progress_reports)

    # Metrics: NeMo RL's logger got the rlix/ figures with each step's training metrics.
    logged = [c.args[0] for c in mock_grpo_components["logger"].log_metrics.call_args_list
              if c.kwargs.get("prefix") == "train"]
    assert len(logged) == RESUMED_STEPS, logged
    for n, metrics in enumerate(logged):
        assert metrics["rlix/published_version"] == START + n + 1, metrics
        assert metrics["rlix/wait_train_grant_s"] >= 0.0
        assert {"rlix/expand_s", "rlix/ranks_expanded", "rlix/ranks_shrunk", "rlix/preemptions"} <= set(metrics)
        assert metrics["rlix/asleep_gib_max"] == 0.0, metrics  # vLLM-CPU: a slept rank's memory is not measurable
        # each step's hand-over inside its grant: the cache it built, the offload, the refresh of the awake ranks
        assert metrics["rlix/build_cache_s"] > 0 and metrics["rlix/offload_s"] > 0, metrics
        assert metrics["rlix/refresh_active_s"] >= 0, metrics
    assert logged[0]["rlix/ranks_expanded"] >= 1 and logged[0]["rlix/expand_s"] > 0  # the first expand(s)
    # Step 2's training grant on GPU 0 preempted the pipeline's own rollout rank there (woken by the first expand).
    assert logged[0]["rlix/preemptions"] >= 1 and logged[0]["rlix/ranks_shrunk"] >= 1, logged[0]
    # Every vLLM worker that received weights verified them (its checksums), and no sync went unverified.
    assert sum(m["rlix/workers_verified"] for m in logged) >= 1 and all(m["rlix/syncs_unverified"] == 0 for m in logged)
    assert all(isinstance(v, float) and v >= 0 for m in logged for k, v in m.items() if k.startswith("rlix/"))


#: one GPU whose memory figures let the pipeline's rollout stay awake beside its own step (60 + 35 of 100 GiB)
OWN_BESIDE = {**FULL, "infer_devices": [0],
              "memory": {"actor_infer": {"gpu_gib": 100, "awake_gib": 60, "asleep_gib": 1},
                         "actor_train": {"gpu_gib": 100, "awake_gib": 35, "asleep_gib": 3}}}


def test_full_mode_own_rollout_keeps_generating_beside_its_step(mock_grpo_components, tmp_path, monkeypatch):
    """FULL mode on one GPU with memory figures that fit the rollout beside the step (DESIGN §9: one 1.5 B pipeline
    alone made 30 steps/h with its rollout slept for every step, 53 with it awake): through the patched loop, the
    real hooks, runtime, scheduler, router, resizer, cache, transport and receiver, the rank wakes once and is never
    shrunk while the run trains, and every step's weights reach it by the in-flight refresh after the step,
    verified."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    cp, full = _full_mode(mock_grpo_components, tmp_path, OWN_BESIDE, steps=NUM_STEPS, start=0)
    trainer, collector = full.trainer, full.collector
    capture = HookCapture()
    awake_in_step = []  # whether the scheduler had the pipeline's rollout rank allocated inside each train

    def on_train(n):
        REAL_RAY_GET(trainer.train.remote(100 + n + 1), timeout=60)
        allocs = cp.status()["allocations"]
        pid = capture.impl.pipeline_id
        awake_in_step.append(sorted(cid[len(pid) + 1:] for cid, a in allocs.items() if a["pipeline_id"] == pid))

    events, refits = [], []
    record_policy(full.policy, events, lambda: None, on_train=on_train)
    with capture:
        run_async_grpo(mock_grpo_components, full.generation, full.collector_handle, refits, replay_buffer=full.replay)

    hooks = capture.impl
    assert type(hooks.runtime).__name__ == "NemoRuntime", "not in full mode: the stand-in worker groups were not seen"
    assert awake_in_step == [["actor_infer", "actor_train"]] * NUM_STEPS, awake_in_step
    history = hooks.runtime.rt.resize_history()
    ops = [e["op"] for e in history]
    last_refresh = max(i for i, op in enumerate(ops) if op == "refresh")
    assert ops.count("expand") == 1 and "shrink" not in ops[:last_refresh], ops  # the end's planned shrink follows
    refreshes = [e for e in history if e["op"] == "refresh"]
    assert len(refreshes) == NUM_STEPS and all(e["ranks"] == [0] and e["verified"] for e in refreshes), refreshes
    versions = sorted({v for v, _ in REAL_RAY_GET(collector.get_versions.remote(), timeout=30)})
    assert versions == list(range(NUM_STEPS + 1)), versions


#: the same GPU with the trainer's states kept there between steps (``rlix recipe --no-trainer-offload``)
RESIDENT = {**OWN_BESIDE, "offload_trainer": False,
            "memory": {**OWN_BESIDE["memory"],
                       "actor_train": {"gpu_gib": 100, "awake_gib": 35, "asleep_gib": 20}}}


def test_full_mode_trainer_kept_on_the_gpu_is_never_offloaded(mock_grpo_components, tmp_path, monkeypatch):
    """``rlix.offload_trainer: false`` through the patched loop and the real hooks: NeMo RL's ``offload_after_refit``
    never runs (no offload, no onload in any training grant), and each step still builds the cache, publishes and
    refreshes the awake rank with verified weights, its hook events in the same order."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    _, full = _full_mode(mock_grpo_components, tmp_path, RESIDENT, steps=NUM_STEPS, start=0)
    trainer, collector = full.trainer, full.collector
    capture = HookCapture()
    events, refits = [], []
    record_policy(full.policy, events, lambda: None,
                  on_train=lambda n: REAL_RAY_GET(trainer.train.remote(100 + n + 1), timeout=60))
    with capture:
        run_async_grpo(mock_grpo_components, full.generation, full.collector_handle, refits, replay_buffer=full.replay)

    hooks = capture.impl
    assert type(hooks.runtime).__name__ == "NemoRuntime", "not in full mode: the stand-in worker groups were not seen"
    assert not [e for e in events if e[0] == "offload_after_refit"], events
    assert [e[0] for e in events].count("train") == NUM_STEPS
    step_events = ("train_granted", "weights_on_gpu", "offloaded", "published", "train_released")
    for step in range(NUM_STEPS):
        assert [h.name for h in hooks.history if h.step == step and h.name in step_events] == list(step_events)
    refreshes = [e for e in hooks.runtime.rt.resize_history() if e["op"] == "refresh"]
    assert len(refreshes) == NUM_STEPS and all(e["verified"] for e in refreshes), refreshes
    versions = sorted({v for v, _ in REAL_RAY_GET(collector.get_versions.remote(), timeout=30)})
    assert versions == list(range(NUM_STEPS + 1)), versions
