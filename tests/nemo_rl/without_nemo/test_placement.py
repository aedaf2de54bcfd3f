"""Shared placement on Ray with declared GPUs: one placement group per GPU shared by two pipelines,
fractional workers of both pipelines in one bundle on the same GPU, unique worker names, the adapter's surface."""

from __future__ import annotations

import pytest
import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlix_plugins.control.nodes import current_node_table
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.placement import VirtualClusterAdapter, placement_pool, worker_name_prefix


@ray.remote(num_cpus=0)
class _Worker:
    def gpu(self) -> list[int]:
        return [int(g) for g in ray.get_gpu_ids()]


def test_two_pipelines_share_per_gpu_groups(ray_cluster: dict[str, float]) -> None:
    pool, table = placement_pool(), current_node_table()
    try:
        first = ray.get(pool.groups.remote([0, 1], table), timeout=180)
        again = ray.get(placement_pool().groups.remote([1, 0], table), timeout=60)  # another driver: same actor, same groups
        assert {g: pg.id for g, pg in first.items()} == {g: pg.id for g, pg in again.items()}

        workers, names = [], set()
        for pid in ("ft_aaaaaaaaaaaa", "ft_bbbbbbbbbbbb"):
            adapter = VirtualClusterAdapter([first[0], first[1]], max_colocated_worker_groups=4, name=pid)
            assert adapter.world_size() == 2 and adapter._init_placement_groups() == adapter.get_placement_groups()
            for rank, pg in enumerate(adapter.get_placement_groups()):
                name = f"{worker_name_prefix(pid, 'policy')}-{rank}"
                names.add(name)
                workers.append(_Worker.options(
                    name=name, num_gpus=1 / adapter.max_colocated_worker_groups,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=pg,
                                                                         placement_group_bundle_index=0)).remote())
        gpus = ray.get([w.gpu.remote() for w in workers], timeout=120)
        assert gpus == [[0], [1], [0], [1]]  # both pipelines' rank r on GPU r, inside the shared group
        assert len(names) == 4
        addrs = adapter.get_available_addresses_and_ports_batch([(0, 0), (1, 0)])
        assert len({port for _, port in addrs}) == 2 and adapter.shutdown() is True
        with pytest.raises(RlixConfigError, match="cross-node"):
            adapter._init_placement_groups(use_unified_pg=True)
        for w in workers:
            ray.kill(w)
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def _run_config(train: list[int], **rlix: object) -> dict[str, object]:
    """A NeMo RL config that passes the topology check (async GRPO, non-colocated async vLLM TP 1, IS correction)."""
    return {
        "rlix": {"train_devices": train, "infer_devices": [0, 1], "init_timeout_s": 120, **rlix},
        "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
        "loss_fn": {"use_importance_sampling_correction": True},
        "policy": {"megatron_cfg": {"enabled": True}, "generation": {
            "backend": "vllm", "colocated": {"enabled": False},
            "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
    }


def test_setup_placement_answers_two_pipelines_the_same_groups(ray_cluster: dict[str, float]) -> None:
    """What the ``rlix_placement`` hook answers NeMo RL's setup(): the same per-GPU groups for both pipelines
    (train GPU ⊂ infer GPUs), fractional workers, per-pipeline name prefixes, the pipeline id fixed in the config
    (the later registration uses it). Bad topologies fail before anything is placed. Neither answer waits for a
    GPU: the start-up grant is taken by the vLLM ranks' device set-up (tests/nemo_rl/without_nemo/test_start_gate.py)."""
    from rlix_plugins.control import client
    from rlix_plugins.nemo_rl.placement import POOL_NAME, nemo_rl_placement, take_setup

    bad = _run_config([0, 1])  # no inference rank left outside training
    with pytest.raises(RlixConfigError, match="at least one full DP rank"):
        nemo_rl_placement(bad)
    tp2 = _run_config([0], infer_devices=[0, 1, 2, 3])
    tp2["policy"]["generation"]["vllm_cfg"]["tensor_parallel_size"] = 2  # type: ignore[index]
    with pytest.raises(RlixConfigError, match="splits a vLLM tensor-parallel rank"):  # training must take whole ranks
        nemo_rl_placement(tp2)
    with pytest.raises(ValueError):  # nothing placed: no pool was created
        ray.get_actor(POOL_NAME, namespace="rlix")

    pool = placement_pool(worker_groups_per_gpu=3)  # first creator fixes the fraction (3 CPUs per GPU bundle here)
    try:
        figures = {"actor_infer": {"gpu_gib": 133.3, "awake_gib": 71.2, "asleep_gib": 1.0},
                   "actor_train": {"gpu_gib": 133.3, "awake_gib": 43.2, "asleep_gib": 3.0}}  # `rlix recipe`'s rlix.memory
        a_cfg, b_cfg = _run_config([0]), _run_config([1], pipeline_id="ft_0123456789ab", memory=figures)
        a_train, a_infer, a_policy, a_gen = nemo_rl_placement(a_cfg)
        b_train, b_infer, b_policy, b_gen = nemo_rl_placement(b_cfg)
        a_setup = take_setup(a_cfg)
        assert a_setup is not None
        a_pid, a_pipe = a_setup.config.pipeline_id, a_setup.pipe
        b_setup = take_setup(b_cfg)
        assert b_setup is not None and b_setup.config.pipeline_id == "ft_0123456789ab" and take_setup(a_cfg) is None
        b_pipe = b_setup.pipe
        held = {c: a["priority"] for c, a in client.connect().status()["allocations"].items()
                if c.startswith(("ft_0123456789ab", str(a_pid)))}
        assert held == {}, held  # registered, nothing held: the vLLM ranks ask when they touch the GPU
        # the driver's lease runs from setup() on, before any grant (a start that hangs must not keep GPUs)
        ages = [ray.get(p.coordinator.lease_age_s.remote(), timeout=30) for p in (a_pipe, b_pipe)]
        assert all(age is not None and age < 60 for age in ages), ages
        registered = client.connect().status()["pipelines"]
        assert {n: c["memory"] for n, c in registered["ft_0123456789ab"]["clusters"].items()} == figures
        assert {c["memory"] for c in registered[str(a_pid)]["clusters"].values()} == {None}
        assert isinstance(a_pid, str) and a_pid.startswith("ft_") and b_cfg["rlix"]["pipeline_id"] == "ft_0123456789ab"  # type: ignore[index]
        ids = [[pg.id for pg in c.get_placement_groups()] for c in (a_train, a_infer, b_train, b_infer)]
        assert ids[1] == ids[3] and len(set(ids[1])) == 2  # one group per GPU, the same for both pipelines
        assert ids[0] == [ids[1][0]] and ids[2] == [ids[1][1]]  # A trains on GPU 0's group, B on GPU 1's
        assert {c.max_colocated_worker_groups for c in (a_train, a_infer, b_train, b_infer)} == {3}
        assert (a_policy, a_gen) == ({"name_prefix": f"{a_pid}-policy"}, {"name_prefix": f"{a_pid}-vllm"})
        assert (b_policy, b_gen) == ({"name_prefix": "ft_0123456789ab-policy"}, {"name_prefix": "ft_0123456789ab-vllm"})
        # Three workers (A's trainer and both pipelines' vLLM rank 0) fit GPU 0's bundle, each on GPU 0.
        workers = [_Worker.options(num_gpus=1 / 3, num_cpus=1, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=c.get_placement_groups()[0], placement_group_bundle_index=0)).remote()
            for c in (a_train, a_infer, b_infer)]
        assert ray.get([w.gpu.remote() for w in workers], timeout=120) == [[0], [0], [0]]
        for w in workers:
            ray.kill(w)
        for p in (a_pipe, b_pipe):
            p.stop_keep_alive()
            p.unregister("test over")
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def test_setup_grant_is_handed_over_by_the_config_object_never_written_into_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """setup() and the loop share NeMo RL's master config object: the grant (parsed config with the pipeline id,
    registration) is found by it, or by a fixed ``rlix.pipeline_id``; another object while one is pending is an
    error that names the fix (registering a second pipeline would wait for GPUs the first holds)."""
    from rlix_plugins.errors import RlixError
    from rlix_plugins.nemo_rl import placement
    from rlix_plugins.nemo_rl.config import load_run_config

    monkeypatch.setattr(placement, "_SETUP_GRANTS", {})
    master = _run_config([0])
    cfg = load_run_config(master)
    placement._SETUP_GRANTS["ft_000000000001"] = placement.SetupGrant(master, cfg, pipe="handle")
    with pytest.raises(RlixError, match=r"\['ft_000000000001'\] for another master config object.*pipeline_id"):
        placement.take_setup(_run_config([0]))
    fixed = _run_config([0], pipeline_id="ft_000000000001")  # a copy naming the id
    grant = placement.take_setup(fixed)
    assert grant is not None and grant.pipe == "handle" and placement.take_setup(master) is None
    assert "pipeline_id" not in master["rlix"]  # type: ignore[operator]


@ray.remote(num_cpus=0)
class _ControllerProcess:
    """The SingleController's actor: its hooks run here, in another process than the driver's setup()."""

    def start_and_end(self, master_config: dict[str, object]) -> list[str]:
        from rlix_plugins.nemo_rl.hooks import NemoRLHooks

        hooks = NemoRLHooks()  # control-only: the policy and generation below have no worker groups
        hooks.rlix_pipeline_start(master_config=master_config, policy=object(), policy_generation=object(),
                                  start_step=0)
        pid = hooks.pipeline_id
        hooks.on_pipeline_end()
        return [str(pid), *(e.name for e in hooks.history)]


def test_setup_grant_adopted_by_the_single_controller_actor(ray_cluster: dict[str, float],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """setup() (the driver) registers the pipeline and holds its setup grant; the SingleController actor's
    ``rlix_pipeline_start`` (another process, so not in the driver's table) adopts that registration by the
    pipeline id its data-plane namespace names, through the control plane instead of registering the id again, and
    releases the grant. The rlix section is not written."""
    from rlix_plugins.control import client
    from rlix_plugins.nemo_rl import placement
    from rlix_plugins.nemo_rl.placement import nemo_rl_placement

    monkeypatch.setattr(placement, "_SETUP_GRANTS", {})  # the driver's untaken grant stays out of other tests

    cfg = _run_config([0])
    cfg.update(async_rl={}, data_plane={"enabled": True})  # the SingleController (topology.grpo_loop)
    pool = placement_pool()
    try:
        nemo_rl_placement(cfg)
        namespace = cfg["data_plane"]["rlix_namespace"]  # type: ignore[index]
        assert namespace.startswith("rlix_tq_ft_") and "pipeline_id" not in cfg["rlix"]  # type: ignore[operator]
        pid = namespace.removeprefix("rlix_tq_")
        cp = client.connect()
        assert pid in cp.status()["pipelines"]
        got = ray.get(_ControllerProcess.remote().start_and_end.remote(cfg), timeout=120)
        assert got == [pid, "registered", "ended"], got
        status = cp.status()
        assert pid not in status["pipelines"] and not [c for c in status["allocations"] if c.startswith(pid)]
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)


def test_tensor_parallel_blocks_are_one_group_per_rank_and_shared_whole(ray_cluster: dict[str, float]) -> None:
    """vLLM TP 2 ranks on GPUs 0-3: one two-bundle group per rank, each bundle probed onto its GPU (bundle order);
    a TP-1 pipeline on the same GPUs shares the blocks whole (one worker per bundle); a TP-1 rank on part of a block,
    a TP-2 rank across blocks and training that splits a block are refused, naming the layout. The adapter describes
    a block as NeMo RL reads a cluster (world size = bundles, bundles per group)."""
    from rlix_plugins.nemo_rl.placement import cover

    pool, table = placement_pool(worker_groups_per_gpu=1), current_node_table()  # 1 CPU per bundle: 4 GPUs fit here
    try:
        blocks = ray.get(pool.place.remote([0, 1, 2, 3], 2, table), timeout=180)
        assert [b.gpus for b in blocks] == [(0, 1), (2, 3)] and [b.group.bundle_count for b in blocks] == [2, 2]
        one_gpu = ray.get(placement_pool().place.remote([0, 1, 2, 3], 1, table), timeout=60)  # a TP-1 pipeline
        assert [(b.gpus, b.group.id) for b in one_gpu] == [(b.gpus, b.group.id) for b in blocks]
        assert len(ray.get(pool.locations.remote(), timeout=30)) == 4  # still two groups over four GPUs
        slots = [ray.get(pool.port_slot.remote(p), timeout=30) for p in ("ft_a", "ft_b", "ft_a")]
        assert slots == [0, 1, 0]  # each pipeline's vLLM engines search ports in windows of their own
        with pytest.raises(RlixConfigError, match=r"do not list whole placement blocks: GPUs \[2, 3\]"):
            ray.get(pool.place.remote([2], 1, table), timeout=60)
        with pytest.raises(RlixConfigError, match=r"needs GPUs \[1, 2\] in one placement group.*\[\[0, 1\], \[2, 3\]\]"):
            ray.get(pool.place.remote([1, 2], 2, table), timeout=60)
        with pytest.raises(RlixConfigError, match=r"rlix\.train_devices \[1, 0\] do not list whole"):
            cover([1, 0], blocks, "rlix.train_devices")

        infer = VirtualClusterAdapter(cover([0, 1, 2, 3], blocks), max_colocated_worker_groups=1)
        train = VirtualClusterAdapter(cover([2, 3], blocks), max_colocated_worker_groups=1)
        assert (infer.world_size(), infer.num_gpus_per_node, train.world_size()) == (4, 2, 2)
        workers = [_Worker.options(num_gpus=0.5, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=b)).remote()
            for pg in train.get_placement_groups() for b in range(pg.bundle_count)]
        assert ray.get([w.gpu.remote() for w in workers], timeout=120) == [[2], [3]]  # bundle i on the block's GPU i
        for w in workers:
            ray.kill(w)
    finally:
        ray.get(pool.release_all.remote(), timeout=60)
        ray.kill(pool)
