"""NeMo RL's patched ``setup()`` and the shared placement (runs inside a patched NeMo RL copy with NeMo RL's pytest).

What is real: NeMo RL's ``setup()`` (patch 0002's placement seam), the seam file (patch 0001) loading our hooks
through the installed entry point, NeMo RL's config loader on its stock ``grpo_math_1B_megatron.yaml`` and on our
recipe overlays, ``RayVirtualCluster`` (standalone), NeMo RL's ``RayWorkerGroup`` / ``RayWorkerBuilder`` creating
named worker actors in placement groups, our placement pool and control plane on Ray (4 GPUs declared). Replaced,
as in NeMo RL's own ``setup()`` tests: the logger, checkpointer, loss, data loader, and the Megatron / vLLM worker
classes (they cannot run here) - by ``PlacedWorker``, a tiny actor that reports where Ray put it, built by the real
worker group under NeMo RL's constructor surface (``name_prefix`` defaults ``lm_policy`` / ``vllm_policy``).

Heavy imports are inside the tests: NeMo RL's worker initializer imports this module in every worker process.
Driven by ``tests/nemo_rl/drives_nemo/test_nemo_rl_time_sharing.py`` of rlix-plugins (it copies the recipes to
``examples/configs/rlix/``); not part of NeMo RL.
"""

import os
import sys
import threading
import time
from pathlib import Path

import ray
from tests.unit.algorithms.rlix_ray_fixtures import (  # noqa: F401  (fixture import: overrides NeMo RL's)
    init_ray_cluster,
    ray_gpu_monitor,
)

WORKER_FQN = f"{__name__}.PlacedWorker"
REPO = Path(__file__).resolve().parents[3]
#: (worker name prefix, stand-in class, time) of every Policy / VllmGeneration setup() built, in order
CREATED = []


@ray.remote
class PlacedWorker:
    """Stands in for a Megatron / vLLM worker (Ray's default 1 CPU, like them); reports its placement."""

    def where(self):
        ctx = ray.get_runtime_context()
        return {"name": ctx.get_actor_name(), "gpus": [int(g) for g in ray.get_gpu_ids()],
                "pg": ctx.get_placement_group_id()}


class _Recording:
    def __init__(self, cluster, name_prefix, calls):
        from nemo_rl.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup

        self.cluster, self.calls = cluster, calls
        CREATED.append((name_prefix, type(self).__name__, time.time()))
        self.worker_group = RayWorkerGroup(cluster, RayWorkerBuilder(WORKER_FQN), name_prefix=name_prefix)

    def init_collective(self, ip, port, world_size, *, train_world_size):
        self.calls.append(("init_collective", type(self).__name__, world_size))
        return []

    def placements(self):
        return ray.get([w.where.remote() for w in self.worker_group.workers], timeout=120)

    def kill(self):
        for w in self.worker_group.workers:
            ray.kill(w)


class StandinPolicy(_Recording):
    """``Policy``'s constructor surface (its ``name_prefix`` default) over a real ``RayWorkerGroup``."""

    def __init__(self, cluster, config, tokenizer=None, processor=None, weights_path=None, optimizer_path=None,
                 init_optimizer=True, init_reference_model=True, name_prefix="lm_policy", calls=None):
        super().__init__(cluster, name_prefix, calls)

    def print_node_ip_and_gpu_id(self):
        pass

    def prepare_refit_info(self):
        return {}


class StandinVllmGeneration(_Recording):
    """``VllmGeneration``'s constructor surface: ``_init_placement_groups`` (PACK, non-colocated), then one worker per
    bundle (TP 1) under ``name_prefix`` (default ``vllm_policy``)."""

    weight_synchronizer = None

    def __init__(self, cluster, config, name_prefix="vllm_policy", workers_per_node=None, calls=None):
        cluster._init_placement_groups(strategy="PACK", use_unified_pg=False)
        super().__init__(cluster, name_prefix, calls)

    def finish_generation(self, *args, **kwargs):
        return True

    def prepare_refit_info(self, state_dict_info):
        pass


TP_WORKER_FQN = f"{__name__}.PlacedVllmWorker"


@ray.remote
class PlacedTpWorker:
    """One vLLM TP worker as vLLM's Ray executor creates it: an actor on one bundle of its engine's placement group."""

    def where(self):
        ctx = ray.get_runtime_context()
        return {"gpus": [int(g) for g in ray.get_gpu_ids()], "pg": ctx.get_placement_group_id()}


@ray.remote
class PlacedVllmWorker:
    """Stands in for NeMo RL's vLLM worker (Ray's default 1 CPU, like it) with NeMo RL's REAL ``configure_worker`` (a
    TP group's workers ask no GPU, the leader gets the group's bundle indices). The leader places its engine's TP
    workers as vLLM's Ray executor does under NeMo RL: one per bundle of ``VLLM_RAY_BUNDLE_INDICES`` of its own
    placement group, each ``VLLM_RAY_PER_WORKER_GPUS`` = the worker's GPU fraction / TP of a GPU (vllm_worker.py)."""

    @staticmethod
    def configure_worker(num_gpus, bundle_indices=None, num_gpus_per_node=None):
        from nemo_rl.models.generation.vllm.vllm_worker import BaseVllmGenerationWorker

        return BaseVllmGenerationWorker.configure_worker(num_gpus, bundle_indices, num_gpus_per_node)

    def __init__(self, bundle_indices=None, fraction_of_gpus=1.0, **_kwargs):
        self.bundle_indices, self.fraction = bundle_indices, fraction_of_gpus
        self.tp = []

    def where(self):
        ctx = ray.get_runtime_context()
        env = {k: os.environ.get(k) for k in ("VLLM_PORT", "RANK", "RLIX_VLLM_PORT_SLOT")}
        return {"name": ctx.get_actor_name(), "gpus": [int(g) for g in ray.get_gpu_ids()],
                "pg": ctx.get_placement_group_id(), "bundles": self.bundle_indices, "env": env}

    def start_engine(self):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        per_worker = self.fraction / len(self.bundle_indices)
        self.tp = [PlacedTpWorker.options(num_cpus=0, num_gpus=per_worker, scheduling_strategy=(
            PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b))).remote()
            for b in self.bundle_indices]
        return ray.get([w.where.remote() for w in self.tp], timeout=120)


class StandinTpVllmGeneration(_Recording):
    """``VllmGeneration``'s TP > 1 path with NeMo RL's own code where it places: ``_init_placement_groups``, its
    ``NamedSharding``, ``_get_tied_worker_bundle_indices`` (called as NeMo RL's function) and ``RayWorkerGroup``
    with those tied bundles and the ``vllm_cfg.env_vars`` it hands every worker."""

    weight_synchronizer = None

    def __init__(self, cluster, config, name_prefix="vllm_policy", workers_per_node=None, calls=None):
        import numpy as np
        from nemo_rl.distributed.named_sharding import NamedSharding
        from nemo_rl.distributed.worker_groups import RayWorkerBuilder, RayWorkerGroup
        from nemo_rl.models.generation.vllm.vllm_generation import VllmGeneration

        tp = config["vllm_cfg"]["tensor_parallel_size"]
        cluster._init_placement_groups(strategy="PACK", use_unified_pg=tp > cluster.num_gpus_per_node)
        self.cluster, self.calls = cluster, calls
        self.sharding_annotations = NamedSharding(layout=np.arange(cluster.world_size()).reshape(
            cluster.world_size() // tp, 1, tp), names=["data_parallel", "pipeline_parallel", "tensor_parallel"])
        tied = VllmGeneration._get_tied_worker_bundle_indices(self, cluster)
        env = {str(k): str(v) for k, v in config["vllm_cfg"].get("env_vars", {}).items()}
        CREATED.append((name_prefix, type(self).__name__, time.time()))
        self.worker_group = RayWorkerGroup(cluster, RayWorkerBuilder(TP_WORKER_FQN), name_prefix=name_prefix,
                                           bundle_indices_list=tied, sharding_annotations=self.sharding_annotations,
                                           env_vars=env)

    def finish_generation(self, *args, **kwargs):
        return True

    def prepare_refit_info(self, state_dict_info):
        pass


def _master_config(path: Path, **cluster):
    from unittest.mock import MagicMock

    from nemo_rl.algorithms.grpo import MasterConfig
    from nemo_rl.models.generation import configure_generation_config
    from nemo_rl.utils.config import load_config, register_omegaconf_resolvers
    from omegaconf import OmegaConf

    register_omegaconf_resolvers()
    config = OmegaConf.to_container(load_config(path), resolve=True)
    config["cluster"].update(cluster)
    config["checkpointing"]["enabled"] = False
    tokenizer = MagicMock(pad_token_id=0, eos_token_id=1)
    config["policy"]["generation"] = configure_generation_config(config["policy"]["generation"], tokenizer)
    return MasterConfig.model_validate(config), tokenizer


def _setup(monkeypatch, master_config, tokenizer, calls, generation=None):
    from unittest.mock import MagicMock

    from nemo_rl.algorithms import grpo as grpo_mod
    from nemo_rl.distributed.ray_actor_environment_registry import ACTOR_ENVIRONMENT_REGISTRY
    from nemo_rl.distributed.virtual_cluster import PY_EXECUTABLES

    class Checkpointer:
        def get_latest_checkpoint_path(self):
            return None

        def load_training_info(self, _path):
            return None

        def get_resume_paths(self, _path):
            return None, None

    class Loader:
        def __init__(self, *_args, **_kwargs):
            pass

        def __len__(self):
            return 1

    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, WORKER_FQN, PY_EXECUTABLES.SYSTEM)
    monkeypatch.setitem(ACTOR_ENVIRONMENT_REGISTRY, TP_WORKER_FQN, PY_EXECUTABLES.SYSTEM)
    monkeypatch.setattr(grpo_mod, "Logger", lambda *_a, **_k: MagicMock())
    monkeypatch.setattr(grpo_mod, "CheckpointManager", lambda *_a, **_k: Checkpointer())
    monkeypatch.setattr(grpo_mod, "ClippedPGLossFn", lambda *_a, **_k: MagicMock())
    monkeypatch.setattr(grpo_mod, "StatefulDataLoader", Loader)
    monkeypatch.setattr(grpo_mod, "Policy", lambda **kw: StandinPolicy(**kw, calls=calls))
    monkeypatch.setattr(grpo_mod, "VllmGeneration", lambda **kw: (generation or StandinVllmGeneration)(**kw, calls=calls))
    dataset = MagicMock()
    dataset.__len__.return_value = 2
    result = grpo_mod.setup(master_config, tokenizer, dataset, dataset)  # train and validation data
    policy, generation, _gym, (train_cluster, inference_cluster) = result[:4]
    return policy, generation, train_cluster, inference_cluster


def test_standalone_setup_builds_its_own_clusters_and_static_world(monkeypatch):
    """Variable unset: NeMo RL's own RayVirtualClusters (1 GPU train + 1 GPU inference), default actor names, the
    static refit NCCL world over both, and nothing of rlix_plugins imported (this test runs first in the module)."""
    from nemo_rl.distributed.virtual_cluster import RayVirtualCluster

    monkeypatch.delenv("RLIX_CONTROL_PLANE", raising=False)
    master_config, tokenizer = _master_config(REPO / "examples/configs/grpo_math_1B_megatron.yaml", gpus_per_node=2)
    master_config.policy["generation"]["colocated"] = {"enabled": False,
                                                       "resources": {"gpus_per_node": 1, "num_nodes": 1}}
    calls = []
    policy, generation, train_cluster, inference_cluster = _setup(monkeypatch, master_config, tokenizer, calls)
    try:
        assert type(train_cluster) is RayVirtualCluster and type(inference_cluster) is RayVirtualCluster
        assert [p["name"] for p in policy.placements()] == ["lm_policy-0-0"]
        assert [p["name"] for p in generation.placements()] == ["vllm_policy-0-0"]
        assert sorted(calls) == [("init_collective", "StandinPolicy", 2), ("init_collective", "StandinVllmGeneration", 2)]
        assert "rlix" not in master_config.model_extra
        assert not [m for m in sys.modules if m.startswith("rlix_plugins")]
    finally:
        policy.kill()
        generation.kill()
        train_cluster.shutdown()
        inference_cluster.shutdown()


def test_two_pipelines_share_per_gpu_groups_under_unique_names(monkeypatch):
    """RLIX_CONTROL_PLANE=rlix, our recipes A (trains on GPU 0) and B (GPU 1), both rolling out on GPUs 0-1: two
    setup() calls in ONE process (one Ray namespace: equal actor names would collide) place every worker in the
    pool's group of its GPU, fractionally, under per-pipeline names; no static refit world is built. No setup()
    waits for a GPU: B's, started while A trains on GPU 0, creates its workers at once (only its vLLM ranks' device
    set-up waits, from their init_device: control.start_gate) and tells its vLLM ranks their pipeline through
    vllm_cfg.env_vars."""
    from rlix_plugins.control import client
    from rlix_plugins.control.start_gate import PIPELINE_ENV
    from rlix_plugins.control.types import TRAIN_CLUSTER, Priority
    from rlix_plugins.nemo_rl.config import cfg_path
    from rlix_plugins.nemo_rl.placement import placement_pool, take_setup

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    pool = placement_pool(worker_groups_per_gpu=3)  # 3 workers per GPU here (CPU budget of the private head)
    cp = client.connect()
    made, grants = [], {}
    try:
        pipelines = {}
        configs = {n: _master_config(REPO / f"examples/configs/rlix/two_pipelines_2gpu_{n}.yaml") for n in "ab"}

        def run_setup(name):
            cfg, tokenizer = configs[name]
            calls = []
            made.append(_setup(monkeypatch, cfg, tokenizer, calls))
            pid = made[-1][2].name.removesuffix("-train")  # the train cluster is named after the pipeline
            pipelines[name] = (pid, *made[-1], calls)

        run_setup("a")
        a_pid = pipelines["a"][0]
        assert [c for c, a in cp.status()["allocations"].items() if a["pipeline_id"] == a_pid] == []
        grants["a"] = take_setup(configs["a"][0]).pipe
        assert grants["a"].request_gpus(TRAIN_CLUSTER, Priority.ACTOR_TRAINING, step=0, timeout_s=60) == [0]
        t0 = time.time()
        b_thread = threading.Thread(target=run_setup, args=("b",), daemon=True)
        b_thread.start()
        b_thread.join(timeout=120)
        assert "b" in pipelines, "B's setup() waited for the GPU A trains on"
        b_pid = pipelines["b"][0]
        b_created = [t for prefix, _, t in CREATED if prefix.startswith(b_pid)]
        assert len(b_created) == 2 and min(b_created) >= t0, (CREATED, t0)
        assert cfg_path(configs["b"][0], "policy.generation.vllm_cfg.env_vars")[PIPELINE_ENV] == b_pid
        grants["a"].release_gpus(TRAIN_CLUSTER, step=0, timeout_s=60)
        grants["b"] = take_setup(configs["b"][0]).pipe
        groups = ray.get(pool.groups.remote([0, 1], cp.node_table()), timeout=60)
        shared = {gpu: pg.id.hex() for gpu, pg in groups.items()}
        names = []
        for pid, policy, generation, train_cluster, inference_cluster, calls in pipelines.values():
            assert type(train_cluster).__name__ == "VirtualClusterAdapter" == type(inference_cluster).__name__
            assert calls == []  # no static NCCL world (train and rollout ranks share GPUs)
            trained = [p for p in policy.placements()]
            rolled = [p for p in generation.placements()]
            for p in trained + rolled:
                assert p["pg"] == shared[p["gpus"][0]], p  # inside the shared group of its GPU
            assert [p["name"] for p in trained] == [f"{pid}-policy-0-0"]
            assert [(p["name"], p["gpus"]) for p in rolled] == [(f"{pid}-vllm-0-0", [0]), (f"{pid}-vllm-1-0", [1])]
            names += [p["name"] for p in trained + rolled]
        (a_pid, a_policy, *_), (b_pid, b_policy, *_) = pipelines["a"], pipelines["b"]
        assert a_pid != b_pid and len(set(names)) == 6
        assert a_policy.placements()[0]["gpus"] == [0] and b_policy.placements()[0]["gpus"] == [1]
    finally:
        for policy, generation, *_ in made:
            policy.kill()
            generation.kill()
        for pipe in grants.values():
            pipe.unregister("test over")
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def test_tensor_parallel_ranks_share_one_block_through_nemo_rls_worker_group(monkeypatch):
    """vLLM TP 2 under RLIX_CONTROL_PLANE=rlix: two pipelines from our recipes, each training and rolling out on GPUs
    0-1 (the one-rank topology) with one TP-2 rank. NeMo RL's setup(), tied-bundle code and worker group place both
    pipelines' trainers and TP groups in ONE shared two-bundle placement group: the trainers one worker per bundle
    (GPU 0, GPU 1), each TP group's leader given both bundles, its engine's TP workers one per bundle on GPUs 0 and 1.
    NeMo RL gives both engines the port window of bundle 0 (VLLM_PORT 7000); the pipelines' port slots, delivered
    through vllm_cfg.env_vars, differ, so their engines search different windows (rlix_plugins.vllm.ports)."""
    from rlix_plugins.nemo_rl.placement import placement_pool, take_setup
    from rlix_plugins.vllm.ports import window_port

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    pool = placement_pool(worker_groups_per_gpu=4)  # a bundle holds both trainers' and both TP groups' workers
    made, pipes = [], []
    try:
        for name in "ab":
            cfg, tokenizer = _master_config(REPO / f"examples/configs/rlix/two_pipelines_2gpu_{name}.yaml")
            cfg.policy["generation"]["vllm_cfg"]["tensor_parallel_size"] = 2
            cfg.model_extra["rlix"].update(train_devices=[0, 1], infer_devices=[0, 1])
            made.append(_setup(monkeypatch, cfg, tokenizer, [], generation=StandinTpVllmGeneration))
            pipes.append(take_setup(cfg).pipe)
        blocks, slots = set(), set()
        for pipe, (policy, generation, train_cluster, inference_cluster) in zip(pipes, made, strict=True):
            pid = pipe.pipeline_id
            assert train_cluster.num_gpus_per_node == inference_cluster.num_gpus_per_node == 2
            trained = policy.placements()
            assert [p["gpus"] for p in trained] == [[0], [1]] and len({p["pg"] for p in trained}) == 1
            assert generation.worker_group.dp_size == 1
            leader, secondary = generation.placements()
            assert (leader["name"], secondary["name"]) == (f"{pid}-vllm-grp0-0", f"{pid}-vllm-grp0-1")
            assert leader["gpus"] == secondary["gpus"] == [] and leader["bundles"] == [0, 1]  # NeMo RL: TP asks none
            assert leader["pg"] == secondary["pg"] == trained[0]["pg"]
            tp_workers = ray.get(generation.worker_group.workers[0].start_engine.remote(), timeout=120)
            assert [w["gpus"] for w in tp_workers] == [[0], [1]] and {w["pg"] for w in tp_workers} == {leader["pg"]}
            env = leader["env"]
            assert env["VLLM_PORT"] == "7000" and env["RANK"] == "0", env  # NeMo RL's window of bundle 0, both
            blocks.add(leader["pg"])
            slots.add(window_port(int(env["RLIX_VLLM_PORT_SLOT"]), int(env["RANK"])))
        assert len(blocks) == 1 and len(slots) == 2  # one shared block; two port windows
    finally:
        for policy, generation, *_ in made:
            policy.kill()
            generation.kill()
        for pipe in pipes:
            pipe.unregister("test over")
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)
