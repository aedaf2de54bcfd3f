# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Two time-shared ``async_grpo_train`` runs on one control plane (runs INSIDE a patched NeMo RL copy, copied to
``tests/unit/algorithms/`` with :mod:`rlix_grpo_harness` and :mod:`rlix_worker_standins`; driven by rlix-plugins'
``tests/nemo_rl/drives_nemo/test_nemo_rl_two_pipelines.py``; not part of NeMo RL).

Each pipeline is its own driver PROCESS (``test_driver`` run by NeMo RL's pytest in a subprocess, so it can be
SIGKILLed): the patched ``async_grpo_train`` on NeMo RL's mocks (``mock_grpo_components``,
``mock_async_grpo_infrastructure``), our hooks loaded through the real entry point in FULL mode (the mocks carry
the stand-in worker groups of :mod:`rlix_worker_standins`: real runtime, router, resizer, weight cache,
transport and receiver), all joined to ONE Ray cluster (the outer test's private head, 4 GPUs declared) and ONE
real control plane that the conductor tests create. Topology = the 4-GPU recipe pair
(``recipes/nemo_rl/two_pipelines_4gpu_*``): A trains on GPUs 0-1, B on GPUs 2-3, both generate on GPUs 0-3 (4 DP
ranks each), so each one's training needs GPUs where the other's rollout ranks live. Each step's batch is ready
``rollout_s`` after the loop asks (the stub replay buffer's wait), training takes ``train_s``.

* :func:`test_two_pipelines_time_share` - both finish; the control plane's trace shows a training grant of one
  preempting (shrinking) the other's GENERATION ranks, and never two clusters on one GPU; each driver checks
  its versions (published in order, each once per step, no double bump, the engines hold the weights of the
  version they were synced to); nothing allocated at the end.
* :func:`test_killed_driver_leaves_the_other_finishing` - B is SIGKILLed mid-step while holding its training
  GPU: the scheduler frees B's GPUs, A's rollout takes GPU 1 again and A finishes; nothing allocated at the end.
"""

import json
import os
import subprocess
import sys
import time
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path
from unittest.mock import MagicMock

import pytest
import ray
from tests.unit.algorithms.rlix_grpo_harness import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    REAL_RAY_GET,
    HookCapture,
    configure,
    init_ray_cluster,
    ray_gpu_monitor,
    record_policy,
    run_async_grpo,
)
from tests.unit.algorithms.rlix_worker_standins import (
    CollectorHandle,
    RecordingCollectorActor,
    StandinMegatronWorker,
    StandinVllmLeader,
    StandinWorkerGroup,
    tiny_params,
)
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (fixture import)
    _mock_policy_generation,
    mock_grpo_components,
)

DRIVER_ENV = "RLIX_TWO_PIPELINES_DRIVER"
TRAIN, GEN = "actor_train", "actor_infer"
DRIVER_LIMIT_S = 300.0
STEP_EVENTS = ("train_granted", "weights_on_gpu", "offloaded", "published", "train_released")


# ---------------------------------------------------------------------------------------------- one driver
def test_driver(mock_grpo_components, tmp_path, monkeypatch):
    """One pipeline's driver process (spec in ``RLIX_TWO_PIPELINES_DRIVER``); skipped when run directly."""
    spec = json.loads(os.environ.get(DRIVER_ENV) or "null")
    if spec is None:
        pytest.skip(f"a driver process of the two-pipeline scenarios (needs {DRIVER_ENV})")
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    out, steps, seed = Path(spec["out"]), int(spec["steps"]), int(spec["seed"])
    rlix = {"pipeline_id": spec["pipeline_id"], "train_devices": spec["train"], "infer_devices": spec["infer"],
            "request_timeout_s": 120, "init_timeout_s": 120, "sync_timeout_s": 60, "drain_timeout_s": 30,
            "release_timeout_s": 60, "watchdog_interval_s": 0.5, "bucket_size_bytes": 1 << 20}
    configure(mock_grpo_components, tmp_path, steps=steps, rlix=rlix)
    mock_grpo_components["master_config"].policy["megatron_cfg"] = {"enabled": True}  # the trainer stand-in's backend
    # one node with the 4 GPUs the Ray head declares (NeMo RL's fixture says 2: the sync's place check then refuses
    # GPUs 2-3 as another node's, rightly, since every worker runs on this one)
    mock_grpo_components["master_config"].cluster["gpus_per_node"] = 4

    actor = {"num_cpus": 0}
    leaders = [ray.remote(StandinVllmLeader).options(**actor).remote(2) for _ in spec["infer"]]
    trainer = ray.remote(StandinMegatronWorker).options(**actor).remote(seed * 100)  # version v = seed*100 + v
    collector = ray.remote(RecordingCollectorActor).options(**actor).remote()
    policy = mock_grpo_components["policy"]
    policy.worker_group = StandinWorkerGroup([trainer])
    generation = _mock_policy_generation()
    generation.worker_group = StandinWorkerGroup(leaders)
    generation.attach_fleet_health = MagicMock()  # NeMo RL's seam on VllmGeneration (the mock's spec lacks it)

    def on_train(n):
        REAL_RAY_GET(trainer.train.remote(seed * 100 + n + 1), timeout=60)
        if spec.get("hang_at_train") == n:  # the kill scenario: stop mid-step, training GPUs held
            (out / f"{spec['pipeline_id']}.mid_step").write_text(str(time.time()))
            time.sleep(DRIVER_LIMIT_S * 2)
        time.sleep(float(spec["train_s"]))

    from rlix_plugins.control import client

    cp = client.connect()

    def holds_training_gpus():
        """Per the scheduler, right now (the probe of every recorded policy phase)."""
        allocs = cp.status()["allocations"]
        return any(a["pipeline_id"] == spec["pipeline_id"] and c.endswith(TRAIN) for c, a in allocs.items())

    events, refits = [], []
    record_policy(policy, events, holds_training_gpus, on_train=on_train)
    with HookCapture() as capture:
        run_async_grpo(mock_grpo_components, generation, CollectorHandle(collector), refits,
                       sample_delay_s=float(spec["rollout_s"]))
    t_end = time.time()

    hooks = capture.impl
    assert type(hooks).__name__ == "NemoRLHooks" and type(hooks.runtime).__name__ == "NemoRuntime", \
        "the entry point did not load our hooks in full mode (the stand-in worker groups were not seen)"
    selector = generation.attach_fleet_health.call_args.args[1]
    assert type(selector).__name__ == "RouterShardSelector"  # routing installed before the collector existed
    rt = hooks.runtime.rt
    history = rt.resize_history()
    versions = [v for v, _ in REAL_RAY_GET(collector.get_versions.remote(), timeout=30)]
    calls = REAL_RAY_GET(collector.get_calls.remote(), timeout=30)
    engines = REAL_RAY_GET([w.state.remote() for w in leaders], timeout=60)
    Path(spec["result"]).write_text(json.dumps({
        "t_end": t_end, "versions": versions, "history": history, "timings": rt.timings,
        "hooks": [(h.name, h.step, h.time) for h in hooks.history], "router": rt.router_stats,
    }, default=str))

    # The loop took the time-sharing path: no standalone refit / refit pause.
    assert refits == [] and not {"prepare_for_refit", "resume_after_refit"} & set(calls), calls
    # Versions reached the collector in order (the loop's publishes and every expand's), never -1, each new
    # version once per step (no double bump, no gap).
    assert versions == sorted(versions) and versions[0] == 0, versions
    assert sorted(set(versions)) == list(range(steps + 1)), versions
    for step in range(steps):  # the training GPUs went only after the version was published
        per = [h.name for h in hooks.history if h.step == step and h.name in STEP_EVENTS]
        assert per == list(STEP_EVENTS), (step, per)
    assert hooks.history[-1].name == "ended"
    # The scheduler held this pipeline's training GPUs through every phase that runs on them (the other pipeline
    # never got them in between), checkpoints included.
    for name in ("prepare_for_lp_inference", "train", "offload_after_refit", "save_checkpoint"):
        seen = [held for n, _, held in events if n == name]
        assert seen and all(seen), (name, events)
    # Every weight sync was verified by checksum, none failed; a rank serves only what it was synced.
    ops = {e["op"] for e in history}
    assert not {"expand_failed", "refresh_failed"} & ops, history
    syncs = [e for e in history if e["op"] in ("expand", "refresh")]
    assert syncs and all(e["verified"] for e in syncs), syncs
    assert all(e["asleep"] for e in engines), engines  # the planned shrink to zero left no rank awake
    # Each engine holds exactly the weights of the last version synced to it (real bytes through the transport):
    # the start-up prewarm syncs the start-up cache into every rank once, expands and refreshes the later versions.
    for rank, engine in enumerate(engines):
        loads = [e for e in history if e["op"] in ("prewarm", "expand", "refresh") and rank in e["ranks"]]
        expect = (tiny_params(seed * 100 + max(loads[-1]["version"], 0)) if loads
                  else {n: 0 * t for n, t in tiny_params(0).items()})
        assert set(engine["params"]) == set(expect), rank
        assert all(bool((engine["params"][n] == t).all()) for n, t in expect.items()), (rank, loads)
        assert engine["finalized"] == len(loads), (rank, engine["finalized"], loads)  # once per sync per target


# ---------------------------------------------------------------------------------------------- the conductor
def _spawn(name, spec, tmp_path):
    env = {**os.environ, DRIVER_ENV: json.dumps(spec)}
    log = open(tmp_path / f"{name}.log", "w")  # noqa: SIM115  (closed by _finish)
    cmd = [sys.executable, "-m", "pytest", f"{__file__}::test_driver", "-q", "-s", "-p", "no:cacheprovider",
           "-o", "addopts=", f"--timeout={int(DRIVER_LIMIT_S)}", f"--junitxml={tmp_path / f'{name}.xml'}"]
    proc = subprocess.Popen(cmd, cwd=os.getcwd(), env=env, stdout=log, stderr=subprocess.STDOUT)
    proc.rlix_log = log
    return proc


def _tail(tmp_path, name, n=4000):
    """The driver's failure (pytest's FAILURES section, before its warnings summary), else the log's end."""
    path = tmp_path / f"{name}.log"
    if not path.exists():
        return "(no log)"
    text = path.read_text(errors="replace")
    start = text.find("= FAILURES =")
    return text[start:start + n] if start >= 0 else text[-n:]


def _finish(proc, name, tmp_path, deadline):
    try:
        proc.wait(timeout=max(1.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)
        pytest.fail(f"driver {name} did not finish in time; log tail:\n{_tail(tmp_path, name)}")
    finally:
        proc.rlix_log.close()
    junit = tmp_path / f"{name}.xml"
    cases = list(ET.parse(junit).getroot().iter("testcase")) if junit.exists() else []
    passed = len(cases) == 1 and not [c for c in cases[0] if c.tag in ("failure", "error", "skipped")]
    assert proc.returncode == 0 and passed, f"driver {name} failed (rc={proc.returncode}):\n{_tail(tmp_path, name)}"
    return json.loads((tmp_path / f"{name}.json").read_text())  # the spec's "result"


def _specs(tmp_path, **overrides):
    tag = uuid.uuid4().hex[:6]
    base = {"infer": [0, 1, 2, 3], "out": str(tmp_path), "steps": 3, "train_s": 0.5, "rollout_s": 2.5}
    a = {**base, "pipeline_id": f"tp_a_{tag}", "train": [0, 1], "seed": 1, "result": str(tmp_path / "a.json"),
         **overrides.get("a", {})}
    b = {**base, "pipeline_id": f"tp_b_{tag}", "train": [2, 3], "seed": 2, "result": str(tmp_path / "b.json"),
         **overrides.get("b", {})}
    return a, b


def _gpu_owners_never_overlap(trace):
    """Replay the occupancy ops of the trace: one cluster per GPU at any time. Returns the GPU spans checked."""
    owner, checked = {}, 0
    for e in trace:
        if e.op in ("allocate", "expand"):
            checked += len(e.gpus)
            for g in e.gpus:
                assert owner.get(g) in (None, e.cluster_id), f"GPU {g}: {e.cluster_id} while {owner[g]} holds it ({e})"
                owner[g] = e.cluster_id
        elif e.op in ("release", "shrink"):
            for g in e.gpus:
                if owner.get(g) == e.cluster_id:
                    owner[g] = None
            if e.op == "release" and not e.gpus:  # planned release: every GPU of the cluster
                owner = {g: (None if c == e.cluster_id else c) for g, c in owner.items()}
        elif e.op in ("unregister", "fail"):
            owner = {g: (None if c is not None and c.startswith(e.pipeline_id) else c) for g, c in owner.items()}
    return checked


def _preemptions(trace, trainer_pid, donor_pid):
    """(time, GPUs) of each training grant of ``trainer_pid`` whose cycle shrank ``donor_pid``'s GENERATION ranks."""
    found = []
    for i, e in enumerate(trace):
        if e.op != "allocate" or e.pipeline_id != trainer_pid or not e.cluster_id.endswith(TRAIN):
            continue
        cycle = []  # the shrinks just before this grant, in the same scheduling cycle
        for prev in reversed(trace[:i]):
            if prev.op not in ("shrink", "expand", "allocate", "grant") or e.time - prev.time > 2.0:
                break
            cycle.append(prev)
        hit = [s for s in cycle if s.op == "shrink" and s.pipeline_id == donor_pid and s.cluster_id.endswith(GEN)
               and "preempt" in s.detail and set(s.gpus) & set(e.gpus)]
        if hit:
            found.append((e.time, tuple(e.gpus)))
    return found


def _dump(trace, path):
    """The trace next to the drivers' logs (for a failure's post-mortem); returns it."""
    path.write_text("\n".join(f"{e.time:.3f} {e.op:10s} {e.cluster_id:28s} {list(e.gpus)} {e.detail}" for e in trace))
    return trace


def _measured(line):
    """One summary line: printed, and appended to ``$RLIX_MEASURED`` when the outer test asks for it."""
    print(line, flush=True)
    if os.environ.get("RLIX_MEASURED"):
        with open(os.environ["RLIX_MEASURED"], "a") as f:
            f.write(line + "\n")


def _mine(status, pids):
    return {c: a for c, a in status["allocations"].items() if a["pipeline_id"] in pids}


def test_two_pipelines_time_share(tmp_path):
    from rlix_plugins.control import client

    cp = client.connect()  # the ONE control plane both drivers join
    t0 = time.time()
    a, b = _specs(tmp_path)
    procs = {"a": _spawn("a", a, tmp_path), "b": _spawn("b", b, tmp_path)}
    deadline = time.time() + DRIVER_LIMIT_S
    results = {name: _finish(p, name, tmp_path, deadline) for name, p in procs.items()}
    trace = _dump(cp.trace(t0), tmp_path / "trace.txt")
    pa, pb = a["pipeline_id"], b["pipeline_id"]

    # Training of one preempted the other's rollout ranks (the scheduler shrank them in the grant's cycle).
    a_over_b, b_over_a = _preemptions(trace, pa, pb), _preemptions(trace, pb, pa)
    assert a_over_b or b_over_a, [(e.op, e.pipeline_id, e.cluster_id, e.gpus, e.detail) for e in trace]
    assert _gpu_owners_never_overlap(trace) >= 20  # every step's grants and expands were replayed
    # Both finished and left; nothing allocated.
    status = cp.status()
    assert pa not in status["pipelines"] and pb not in status["pipelines"], status["pipelines"]
    assert status["allocations"] == {}, status["allocations"]
    _measured(f"time-share: {len(a_over_b)} training grants of A preempted B's rollout ranks, {len(b_over_a)} of B "
              f"preempted A's; both done {max(r['t_end'] for r in results.values()) - t0:.0f} s after the start")


def test_killed_driver_leaves_the_other_finishing(tmp_path):
    from rlix_plugins.control import client

    cp = client.connect()
    t0 = time.time()
    a, b = _specs(tmp_path, a={"steps": 5, "train_s": 1.5}, b={"steps": 4, "hang_at_train": 1})
    pa, pb = a["pipeline_id"], b["pipeline_id"]
    proc_a, proc_b = _spawn("a", a, tmp_path), _spawn("b", b, tmp_path)
    deadline = time.time() + DRIVER_LIMIT_S
    marker = tmp_path / f"{pb}.mid_step"
    try:
        while not marker.exists():
            assert proc_b.poll() is None, f"driver B ended before its step 1:\n{_tail(tmp_path, 'b')}"
            assert time.time() < deadline, f"driver B never reached its step 1:\n{_tail(tmp_path, 'b')}"
            time.sleep(0.2)
        held = _mine(cp.status(), {pb})
        assert any(c.endswith(TRAIN) for c in held), f"B is mid-step but holds no training GPU: {held}"
        t_kill = time.time()
        proc_b.kill()  # SIGKILL: no finally, no atexit, its actors go with it
        proc_b.wait(timeout=30)
    finally:
        if proc_b.poll() is None:
            proc_b.kill()
        proc_b.rlix_log.close()

    # The scheduler takes B's GPUs back (dead coordinator / owner) while A keeps running.
    freed_by = time.time() + 120
    while _mine(cp.status(), {pb}) or pb in cp.status()["pipelines"]:
        assert time.time() < freed_by, f"B's GPUs were not returned: {cp.status()}"
        time.sleep(0.5)
    t_freed = time.time()
    result_a = _finish(proc_a, "a", tmp_path, deadline)
    trace = _dump(cp.trace(t0), tmp_path / "trace.txt")
    assert result_a["t_end"] > t_freed, "A finished before B's GPUs came back: lengthen A's run"
    # A's rollout took B's training GPUs again after the kill.
    regained = [e for e in trace if e.time > t_kill and e.pipeline_id == pa and e.op == "expand"
                and set(e.gpus) & set(b["train"])]
    assert regained, [(e.op, e.pipeline_id, e.cluster_id, e.gpus, e.detail) for e in trace if e.time > t_kill]
    assert [e for e in trace if e.time > t_kill and e.pipeline_id == pb and e.op in ("fail", "unregister")]
    assert _gpu_owners_never_overlap(trace) >= 20  # every step's grants and expands were replayed
    status = cp.status()
    assert pa not in status["pipelines"] and status["allocations"] == {}, status
    _measured(f"kill: B's GPUs back {t_freed - t_kill:.1f} s after its SIGKILL, A finished {result_a['t_end'] - t_kill:.0f} s "
              "after it")
