# ruff: noqa: F811  (pytest fixtures imported from NeMo RL's test_grpo.py are used as arguments)
"""Runs INSIDE a patched NeMo RL copy (copied to ``tests/unit/algorithms/`` with the grpo_sync scenario and the shared
helpers) with NeMo RL's own pytest. The SingleController's patched ``run()`` and streaming ``_train_pump`` run for
real on NeMo RL's own SC test harness (``_train_pump_controller``: the actor object without Ray, one-group chunks
from ``_ChunkedSampler``); with ``RLIX_CONTROL_PLANE=rlix`` the hooks are loaded through the real entry point as the
actor's ``__init__`` does, and the real rlix control plane runs on this session's Ray cluster (4 GPUs).
Driven by ``tests/nemo_rl/drives_nemo/test_nemo_rl_loops.py`` of rlix-plugins; not part of NeMo RL.

* standalone: nothing of rlix is imported, NeMo RL's weight synchronizer runs before the pumps and after each step;
* time-sharing: hook order per step, the training grant held from the step's first chunk (log-prob inference and
  the lazy ``begin_train_step``) through ``finish_train_step`` and the cache build, released only after the
  version reached the rollout manager; no weight synchronizer; nothing allocated at the end;
* two pipelines on one control plane: this SingleController and the TransferQueue loop ``grpo_train_sync`` (the
  grpo_sync scenario's ``_run``) both train on GPU 0 at the same time: their training windows never overlap.
"""

import asyncio
import sys
import threading
import time
import types
from collections import Counter, deque
from unittest.mock import AsyncMock, MagicMock

import nemo_rl.algorithms.single_controller as single_controller
import ray
from nemo_rl.algorithms import rlix_hooks as seam
from nemo_rl.data_plane import KVBatchMeta
from nemo_rl.distributed.batched_data_dict import BatchedDataDict
from tests.unit.algorithms.rlix_grpo_harness import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    REAL_RAY_GET,
    HookCapture,
    init_ray_cluster,
    ray_gpu_monitor,
)
from tests.unit.algorithms.test_grpo import (  # noqa: F401  (fixture import)
    _mock_policy_generation,
    mock_grpo_components,
    mock_sync_grpo_infrastructure,
)
from tests.unit.algorithms.test_rlix_grpo_sync import _run as run_grpo_sync
from tests.unit.single_controller.test_single_controller import (
    _ChunkedSampler,
    _LpRecordingTrainer,
    _train_pump_controller,
)

STEPS = 2
RLIX = {"train_devices": [0], "infer_devices": [0, 1], "request_timeout_s": 120}
STEP_EVENTS = ["train_granted", "weights_on_gpu", "offloaded", "published", "train_released"]


class _Trainer(_LpRecordingTrainer):
    """NeMo RL's recording trainer stub; every phase also records ``probe()`` (training GPUs held?, last hook)."""

    def __init__(self, events, probe, train_s=0.0):
        super().__init__()
        self.events, self.probe, self.train_s = events, probe, train_s

    def _log(self, name):
        self.events.append((name, self.probe()))

    def prepare_for_lp_inference(self, keep_train_buffers=False):
        self._log("prepare_for_lp_inference")
        super().prepare_for_lp_inference(keep_train_buffers)

    def begin_train_step(self, loss_fn):
        self._log("begin_train_step")

    def finish_train_step(self):
        time.sleep(self.train_s)
        self._log("finish_train_step")
        return {}

    def offload_after_refit(self):
        self._log("offload_after_refit")


class _RolloutManager:
    def __init__(self, events, probe):
        self.events, self.probe = events, probe

    def set_weight_version(self, version):
        self.events.append(("set_weight_version", version, self.probe()))


async def _forever():
    await asyncio.Event().wait()


def _controller(events, probe, *, steps=STEPS, rlix=RLIX, train_s=0.0):
    """NeMo RL's train-pump harness, completed with what ``run()`` and ``_sync_weights`` read, as a time-shared
    SingleController config (data plane + ``async_rl``, non-colocated async vLLM)."""
    meta = KVBatchMeta(partition_id="rollout_data", task_name="train", sample_ids=["sample-0"], fields=[],
                       sequence_lengths=[1], tags=[{"weight_version": 0}])
    ctrl = _train_pump_controller(sampler=_ChunkedSampler(meta, chunks=2 * steps))  # 2 one-group chunks per step
    cfg = ctrl._master_config
    cfg.grpo.max_num_steps = steps
    cfg.rlix = dict(rlix)
    cfg.data_plane = {"enabled": True}
    cfg.async_rl = {}
    cfg.policy = {"megatron_cfg": {"enabled": True}, "generation": {
        "backend": "vllm", "colocated": {"enabled": False},
        "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}}
    ctrl._async_cfg.recompute_kv_cache_after_weight_updates = False
    ctrl._policy_logprobs_required = True
    ctrl._trainer = _Trainer(events, probe, train_s)
    ctrl._rollout_manager = _RolloutManager(events, probe)
    ctrl._rollout_permitted = asyncio.Event()
    ctrl._abort_stale_inflight = AsyncMock(return_value=0)
    ctrl._maybe_restore_replay_buffer = AsyncMock()
    ctrl._maybe_restore_replacement_reserve = AsyncMock()
    ctrl._rollout_pump = AsyncMock(return_value=None)  # exhausted: the train pump drains the sampler
    ctrl._stall_watchdog_pump = _forever
    ctrl._gen_fleet = None
    ctrl._weight_synchronizer = MagicMock()
    ctrl._logger = MagicMock()
    ctrl._checkpointer = MagicMock()
    ctrl._rlix_hooks = seam.load_rlix_hooks()  # what SingleControllerActor.__init__ does (patch 0006)
    return ctrl


def _no_gym(monkeypatch):
    monkeypatch.setattr(single_controller, "should_use_nemo_gym", lambda cfg: False)


def test_standalone_loads_nothing_of_rlix(monkeypatch):
    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    _no_gym(monkeypatch)
    events = []
    ctrl = _controller(events, lambda: None)
    assert ctrl._rlix_hooks is None
    assert asyncio.run(asyncio.wait_for(ctrl.run(), timeout=60)) == {"train_steps": STEPS, "trainer_version": STEPS}
    assert not [m for m in sys.modules if m.startswith("rlix_plugins")]
    assert ctrl._weight_synchronizer.sync_weights.call_count == STEPS + 1  # before the pumps + after each step
    ctrl._weight_synchronizer.shutdown.assert_called_once()
    assert [e[1] for e in events if e[0] == "set_weight_version"] == list(range(STEPS + 1))


def _probe_for(cp, capture):
    def probe():
        hooks = capture.impl
        if hooks is None or hooks.pipeline_id is None:
            return (None, None)
        allocs = cp.status()["allocations"]
        held = any(a["pipeline_id"] == hooks.pipeline_id and cid.endswith("actor_train") for cid, a in allocs.items())
        return (held, hooks.history[-1].name if hooks.history else None)

    return probe


def test_time_sharing_hook_order_with_real_control_plane(monkeypatch):
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    _no_gym(monkeypatch)
    from rlix_plugins.control import client

    cp = client.connect()
    capture = HookCapture()
    events = []
    with capture:
        ctrl = _controller(events, _probe_for(cp, capture))
    hooks = capture.impl
    assert type(hooks).__module__ == "rlix_plugins.nemo_rl.hooks", "the entry point did not load our hooks"
    assert asyncio.run(asyncio.wait_for(ctrl.run(), timeout=300)) == {"train_steps": STEPS, "trainer_version": STEPS}

    ctrl._weight_synchronizer.sync_weights.assert_not_called()  # the expand replaces the refit
    ctrl._weight_synchronizer.shutdown.assert_not_called()
    for name in ("prepare_for_lp_inference", "begin_train_step", "finish_train_step", "offload_after_refit"):
        seen = [e[-1] for e in events if e[0] == name]
        assert len(seen) >= STEPS and all(p[0] is True for p in seen), (name, events)
    assert [e[-1][1] for e in events if e[0] == "offload_after_refit"] == ["weights_on_gpu"] * STEPS
    published = [(e[1], e[2]) for e in events if e[0] == "set_weight_version"]
    # The initial publish (after the pipeline started), then each step's version while the grant is still held.
    assert [v for v, _ in published] == list(range(STEPS + 1)), published
    assert all(p[0] is True and p[1] == "offloaded" for _, p in published[1:]), published
    names = [e.name for e in hooks.history]
    assert names == ["registered", "collector_created", *STEP_EVENTS * STEPS, "ended"], names
    assert [e.step for e in hooks.history if e.name == "published"] == list(range(STEPS))
    assert hooks.pipeline_id is None and not cp.status()["allocations"]  # ended, nothing held


class _RealGetRay:
    def __getattr__(self, name):
        return REAL_RAY_GET if name == "get" else getattr(ray, name)


def test_single_controller_and_grpo_sync_time_share_one_control_plane(mock_grpo_components, tmp_path, monkeypatch):
    """Both pipelines train on GPU 0: in every training phase of either loop exactly that pipeline holds GPU 0's
    training grant (the control plane's allocations, read there); the runs interleave; both finish."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    _no_gym(monkeypatch)
    from rlix_plugins.control import client
    from rlix_plugins.control import rpc as _rpc

    # The sync loop's mocks replace the process-wide ray.get while it runs (identity for their stubs); the
    # SingleController's thread must reach the control plane with the real one meanwhile.
    monkeypatch.setattr(_rpc, "ray", _RealGetRay())
    cp = client.connect()
    sc_capture, sync_capture = HookCapture(), HookCapture()

    def holders():  # (time, pipelines holding a training grant)
        allocs = cp.status()["allocations"]
        return time.time(), sorted(a["pipeline_id"] for cid, a in allocs.items() if cid.endswith("actor_train"))

    sc_events, sync_phases = [], []
    with sc_capture:
        ctrl = _controller(sc_events, holders, steps=3, train_s=0.3)
    result, errors = {}, []

    def run_sc():
        try:
            result.update(asyncio.run(asyncio.wait_for(ctrl.run(), timeout=300)))
        except BaseException as exc:
            errors.append(exc)

    sc = threading.Thread(target=run_sc, daemon=True)
    sc.start()
    with sync_capture:
        run_grpo_sync(mock_grpo_components, tmp_path, _mock_policy_generation(), [],
                      lambda: (time.sleep(0.3), sync_phases.append(holders()))[1])
    sc.join(timeout=300)
    assert not sc.is_alive() and not errors, errors
    assert result == {"train_steps": 3, "trainer_version": 3}
    sc_hooks, sync_hooks = sc_capture.impl, sync_capture.impl
    assert sc_hooks is not sync_hooks and sc_hooks.history[0].gpus == sync_hooks.history[0].gpus == (0,)
    sc_phases = [e[-1] for e in sc_events if e[0] in ("begin_train_step", "finish_train_step")]
    assert len(sc_phases) == 6 and len(sync_phases) >= 9
    sc_ids = {tuple(h) for _, h in sc_phases}
    sync_ids = {tuple(h) for _, h in sync_phases}
    assert len(sc_ids) == len(sync_ids) == 1 and sc_ids != sync_ids, (sc_ids, sync_ids)  # one holder, never both
    sc_times, sync_times = [t for t, _ in sc_phases], [t for t, _ in sync_phases]
    assert min(sc_times) < max(sync_times) and min(sync_times) < max(sc_times)  # the two runs interleaved
    assert not cp.status()["allocations"]


class _Buffer:
    """What the pumps and our progress thread read of the replay buffer (committed groups, none left unselected)."""

    def __init__(self):
        self.start_weight_list, self.ready_list = [], []

    def __len__(self):
        return 0


class _StreamSampler:
    """The SingleController's sampler for both pumps over the groups the rollout manager committed: ``admit``
    stamps nothing, ``select`` hands out ``min_prompt_groups`` committed groups at once; ``_buffer`` and
    ``_eviction_window`` are what our progress thread reads."""

    def __init__(self, meta):
        self.meta, self.taken = meta, 0
        self._buffer = _Buffer()

    async def admit(self, *, trainer_version_fn):
        return None

    async def evict(self, *, current_train_weight):
        return 0

    async def select(self, *, current_train_weight, min_prompt_groups, max_prompt_groups):
        if len(self._buffer.ready_list) - self.taken < min_prompt_groups:
            return None, 0
        self.taken += min_prompt_groups
        return self.meta, min_prompt_groups

    def should_abort_inflight(self, **kwargs):
        return False

    def _eviction_window(self):
        return 1


class _GeneratingRolloutManager:
    """NeMo RL's rollout manager shape: a prompt group is ``generations`` requests through the REAL (patched)
    ``VllmGeneration.generate_async``, gathered as NeMo RL gathers them (a failure cancels the siblings), then
    committed to the sampler's buffer."""

    def __init__(self, gen, sampler, generations):
        self.gen, self.sampler, self.generations = gen, sampler, generations
        self.versions = []

    def set_weight_version(self, version):
        self.versions.append(version)

    async def _one(self, index):
        return [out async for _, out in self.gen.generate_async(_sample(index))]

    async def generate_and_push(self, prompt, *, target_step=None, inflight_registry=None):
        index = int(prompt["message_log"][0]["content"])
        tasks = [asyncio.ensure_future(self._one(index)) for _ in range(self.generations)]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            raise
        self.sampler._buffer.start_weight_list.append(self.versions[-1])
        self.sampler._buffer.ready_list.append(True)
        return single_controller.RolloutOutcome.COMMITTED


def _sample(index):
    import torch

    return BatchedDataDict({"input_ids": torch.tensor([[index, 1]]),
                            "input_lengths": torch.tensor([2], dtype=torch.int32)})


def test_one_gpu_shrink_while_rollouts_run_drains_on_a_full_thread_pool(monkeypatch):
    """The SingleController's first GPU run, on CPU: ONE GPU (training and its one rollout rank share GPU 0), the
    REAL rollout pump and train pump, requests through NeMo RL's patched ``VllmGeneration`` to a threaded leader
    actor, our hooks in full mode (router, resizer, weight cache, receiver) on the real control plane. The step's
    training grant shrinks the SC's own rollout rank while later groups' requests are still in the engine, and the
    loop's default thread pool has two threads (the grant wait holds one): the drain must finish (the H100 run's
    drain timed out with 11 requests in flight), the aborted requests run again after the re-expand, both steps
    train and publish, and the run ends with nothing held."""
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    _no_gym(monkeypatch)
    from concurrent.futures import ThreadPoolExecutor

    from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration
    from tests.unit.algorithms.rlix_worker_standins import (
        ServingVllmLeader,
        StandinMegatronWorker,
        StandinWorkerGroup,
    )

    from rlix_plugins.control import client

    class _DispatchingGroup(StandinWorkerGroup):  # RayWorkerGroup.run_single_worker_single_data's call shape
        def run_single_worker_single_data(self, *, method_name, worker_idx, data, greedy):
            return getattr(self.workers[worker_idx], method_name).remote(data, greedy)

    cp = client.connect()
    actor = {"num_cpus": 0}
    leader = ray.remote(ServingVllmLeader).options(max_concurrency=32, **actor).remote(2, 2)  # prompts 0, 1 at once
    megatron = ray.remote(StandinMegatronWorker).options(**actor).remote(7)
    gen = object.__new__(VllmGeneration)
    gen.worker_group = _DispatchingGroup([leader])
    gen.current_generate_dp_shard_idx = 0
    gen.fleet_monitor = gen.fleet_selector = None
    gen.cfg = {"vllm_cfg": {"async_engine": True}}

    events = []
    capture = HookCapture()
    with capture:
        ctrl = _controller(events, lambda: None, rlix={"train_devices": [0], "infer_devices": [0],
                                                        "request_timeout_s": 120, "drain_timeout_s": 30})
    cfg = ctrl._master_config
    cfg.grpo.num_prompts_per_step = 2
    cfg.grpo.max_num_epochs = 1
    cfg.async_rl = {"min_groups_for_streaming_train": 2}  # one GPU: one chunk per step (topology check)
    ctrl._async_cfg.min_groups_for_streaming_train = 2
    ctrl._async_cfg.max_inflight_prompts = 3
    ctrl._async_cfg.diagnostics = False
    ctrl._async_cfg.rollout_failure = types.SimpleNamespace(
        on_dropped_prompt="shrink", max_replacement_attempts=0, replacement_reserve_prompts=0,
        min_step_batch_fraction=0.9)
    meta = KVBatchMeta(partition_id="rollout_data", task_name="train", sample_ids=["sample-0"], fields=[],
                       sequence_lengths=[1], tags=[{"weight_version": 0}])
    ctrl._sampler = _StreamSampler(meta)
    ctrl._buffer = ctrl._sampler._buffer
    ctrl._gen = gen
    ctrl._rollout_manager = _GeneratingRolloutManager(gen, ctrl._sampler, generations=2)
    ctrl._trainer.worker_group = StandinWorkerGroup([megatron])
    ctrl._dataloader = [BatchedDataDict({"message_log": [[{"role": "user", "content": str(2 * b + i)}]
                                                         for i in range(2)]}) for b in range(4)]
    ctrl._buffer_capacity = asyncio.Semaphore(8)
    ctrl._rollout_permitted.set()
    ctrl._inflight_rollouts = 0
    ctrl._inflight_by_group_id = {}
    ctrl._dispatched_rollouts = set()
    ctrl._current_epoch = 0
    ctrl._replacement_reserve = deque()
    ctrl._sampler_stamps_target_steps = False
    del ctrl._rollout_pump  # the real one (the harness mocks it)

    async def main():
        asyncio.get_running_loop().set_default_executor(ThreadPoolExecutor(max_workers=2))
        return await asyncio.wait_for(ctrl.run(), timeout=240)

    assert asyncio.run(main()) == {"train_steps": STEPS, "trainer_version": STEPS}
    hooks = capture.impl
    assert type(hooks.runtime).__name__ == "NemoRuntime", "not in full mode: the stand-in worker groups were not seen"
    history = hooks.runtime.rt.resize_history()
    shrinks = [e for e in history if e["op"] == "shrink"]
    # Step 0's grant shrank rank 0 with prompt 2's two requests (at least) still in the engine.
    assert shrinks and shrinks[0]["aborted"][0] >= 2, shrinks
    served = [d for what, d, _ in REAL_RAY_GET(leader.state.remote(), timeout=30)["log"] if what == "served"]
    stops = Counter(p for p, how in served if how == "stop")
    assert served.count((2, "abort")) == 2, served  # prompt 2's requests were in the engine at the shrink
    assert stops[0] == stops[1] == 2, served  # step 0's groups
    assert sum(1 for p, n in stops.items() if p >= 2 and n == 2) >= 2, served  # step 1's, served after the re-expand
    assert ctrl._rollout_manager.versions[0] == 0 and max(ctrl._rollout_manager.versions) == STEPS
    assert hooks.history[-1].name == "ended" and hooks.pipeline_id is None and not cp.status()["allocations"]
