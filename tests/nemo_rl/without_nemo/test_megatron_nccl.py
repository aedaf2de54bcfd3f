"""Destroy/rebuild of Megatron's process groups with real megatron-core, 2 processes on gloo (CPU).

On CPU every Megatron group is a gloo group, so the tests destroy ``backends=("gloo",)``; on GPU the default
(``("nccl",)``) leaves the gloo groups alone. What is proven here: the walk over ``parallel_state`` finds and
destroys each distinct group once, model parallel is reset, ``initialize_model_parallel`` rebuilds it, collectives
on the rebuilt groups are correct, for 3 cycles; and on a real Megatron ``GPTModel`` (TP 2) every holder of a group
handle the worker can reach - the model's ``pg_collection`` (what NeMo RL's worker reads through
``get_pg_collection(self.model)``), each module's ``tp_group``, Megatron-Bridge-style
``partial(finalize_model_grads, pg_collection=...)`` in the model config and NeMo RL's saved copy of it - points at
the rebuilt (live) groups afterwards. Device-memory release needs a GPU.

With 4 processes (marked slow: the start of 4 processes that import torch and Megatron takes 25-60 s on 2 cores):
the rebuild replays the recorded ``initialize_model_parallel`` call (Megatron-Bridge's ``use_tp_pp_dp_mapping``
order with PP 2 x DP 2, a positional virtual pipeline size, the NCCL config path and embedding-rank callbacks); a
rebuild that fails (before or half-way through the group creation, or on one rank only) is undone on every rank
and can be retried; without a recording, a layout the fall-back cannot reproduce fails instead of training on
other groups.
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_tp2(rank: int, port: int, **init: object) -> None:
    """A spawned worker's start: Megatron's fallback warnings off, the 2-process gloo world, model parallel TP 2."""
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2, **init)


def _worker(rank: int, port: int, out: dict) -> None:  # runs in a spawned process
    _start_tp2(rank, port)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    results = []
    for _cycle in range(3):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
        snap = destroy_groups(backends=("gloo",))
        again = destroy_groups(backends=("gloo",))  # idempotent: nothing left
        results.append((float(t.item()), snap.groups_destroyed, ps.model_parallel_is_initialized(),
                        again.initialized_before, snap.sizes["tensor_model_parallel_size"]))
        assert rebuild_groups(snap)
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    results.append((float(t.item()), 0, ps.model_parallel_is_initialized(), True, 2))
    out[rank] = results
    dist.destroy_process_group()


def _spawn(fn: object, *args: object, nprocs: int = 2) -> dict:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(_port(), out, *args), nprocs=nprocs, start_method="spawn", join=True)
        return dict(out)


def test_destroy_rebuild_cycles_on_gloo() -> None:
    results = _spawn(_worker)
    for rank in (0, 1):
        cycles = results[rank]
        assert len(cycles) == 4
        for total, destroyed, still_init, again_init, tp in cycles[:3]:
            assert total == 3.0  # the TP all-reduce is correct before every destroy (and after rebuilds)
            assert destroyed >= 3 and not still_init and not again_init and tp == 2
        assert cycles[3][0] == 3.0 and cycles[3][2]


def _worker_without_gloo_groups(rank: int, port: int, out: dict) -> None:  # runs in a spawned process
    # NeMo RL's recipes: megatron_cfg.use_gloo_process_groups=false (Megatron-Bridge passes it on as this switch)
    _start_tp2(rank, port, create_gloo_process_groups=False)
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    registered = len(ps._global_process_group_list)
    snap = destroy_groups(backends=("gloo",))
    try:
        rebuilt = rebuild_groups(snap)
    except RuntimeError as e:
        out[rank] = repr(e)
        return
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=ps.get_tensor_model_parallel_group())
    out[rank] = (rebuilt, registered, len(ps._global_process_group_list), ps._DATA_PARALLEL_GROUP_GLOO is None,
                 float(t.item()))
    dist.destroy_process_group()


def test_rebuild_reproduces_a_layout_made_without_megatrons_gloo_groups() -> None:
    """Seen on the H200: a Megatron worker set up without gloo groups got them at the rebuild (Megatron's default),
    20 groups became 23 and the rebuild failed. The rebuild now asks for the layout it found."""
    results = _spawn(_worker_without_gloo_groups)
    for rank in (0, 1):
        assert not isinstance(results[rank], str), results[rank]
        rebuilt, before, after, no_gloo, total = results[rank]
        assert rebuilt and after == before and no_gloo and total == 3.0


class _PolicyWorker:
    """The members of NeMo RL's ``MegatronPolicyWorker`` that hold group handles: ``model`` (a Megatron module; its
    config carries Megatron-Bridge's bound ``finalize_model_grads_func``) and the saved copy of that callable in
    the train-step state (``state["saved_finalize_model_grads_func"]``)."""

    def __init__(self, model: object, saved: object) -> None:
        self.model = model
        self.state = {"saved_finalize_model_grads_func": saved}


def _model_worker(rank: int, port: int, out: dict) -> None:  # runs in a spawned process
    _start_tp2(rank, port)
    import functools

    import torch
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.utils import get_attr_wrapped_model

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    cfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                            tensor_model_parallel_size=2, params_dtype=torch.float32)
    model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=32, max_sequence_length=8,
                     pg_collection=ProcessGroupCollection.use_mpu_process_groups())
    model.eval()

    def finalize_model_grads(models: object, num_tokens: object, pg_collection: object = None) -> object:
        return pg_collection

    model.config.finalize_model_grads_func = functools.partial(finalize_model_grads,
                                                               pg_collection=model.pg_collection)
    worker = _PolicyWorker(model, model.config.finalize_model_grads_func)
    live = dist.distributed_c10d._world.pg_map

    def holders() -> dict[str, object]:
        """Every group handle NeMo RL's worker would use, read the way it reads them."""
        pgc = get_attr_wrapped_model(worker.model, "pg_collection", allow_none=False)  # = get_pg_collection
        found = {"pg_collection.tp": pgc.tp, "pg_collection.mp": pgc.mp, "pg_collection.dp": pgc.dp,
                 "config.finalize(pg_collection).tp": model.config.finalize_model_grads_func([], None).tp,
                 "state.saved_finalize(pg_collection).tp": worker.state["saved_finalize_model_grads_func"]([], None).tp}
        for name, module in model.named_modules():
            if isinstance(getattr(module, "tp_group", None), dist.ProcessGroup):
                found[f"{name}.tp_group"] = module.tp_group
        return found

    def check() -> tuple[int, list[str], float, float]:
        found = holders()
        stale = sorted(k for k, g in found.items() if g not in live)
        t = torch.tensor([float(rank + 1)])
        pgc = get_attr_wrapped_model(worker.model, "pg_collection", allow_none=False)
        if not stale:
            dist.all_reduce(t, group=pgc.mp)  # NeMo RL's reduce_max_stat_across_model_parallel_group path
        with torch.no_grad():  # the TP embedding (all-reduce over the module's own tp_group) and output layer
            ids, pos = torch.arange(8).view(1, 8), torch.arange(8).view(1, 8)
            logits, _ = model.output_layer(model.embedding(ids, pos))
        return len(found), stale, float(t.item()), float(logits.float().abs().sum())

    results = [check()]
    for _cycle in range(2):
        snap = destroy_groups(backends=("gloo",))
        assert rebuild_groups(snap, worker)
        results.append(check())
    snap = destroy_groups(backends=("gloo",))
    assert rebuild_groups(snap)  # without the worker: what the rebuild did before the refresh existed
    results.append(check())
    out[rank] = results
    dist.destroy_process_group()


def test_rebuild_refreshes_the_group_handles_a_real_megatron_model_holds() -> None:
    results = _spawn(_model_worker)
    for rank in (0, 1):
        (n0, stale0, sum0, logits0), *refreshed, (_, stale_last, _, _) = results[rank]
        assert n0 >= 5 and not stale0 and sum0 == 3.0
        for n, stale, total, logits in refreshed:
            assert n == n0 and stale == [], stale  # every holder points at a live (rebuilt) group
            assert total == 3.0 and logits == pytest.approx(logits0)  # collectives and the TP forward still right
        # Negative control: a rebuild that does not refresh the worker leaves the model on destroyed groups.
        assert "pg_collection.tp" in stale_last and "pg_collection.mp" in stale_last, stale_last


# ------------------------------------------------------------------------------ replaying the original call (world 4)
# One 4-process spawn runs the scenarios in order (each process imports torch and Megatron once); each scenario
# returns its observations or the error it raised, and each test below checks one scenario.
_WORLD = 4


def _layout() -> dict[str, list[list[int]]]:
    """The global ranks of every group each ``parallel_state`` global holds on this rank."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    found = {}
    for name in sorted(vars(ps)):
        value = getattr(ps, name)
        items = value if isinstance(value, list | tuple) else [value]
        groups = [g for g in items if isinstance(g, dist.ProcessGroup)]
        if groups:
            found[name] = [dist.get_process_group_ranks(g) for g in groups]
    return found


def _dp_sum(rank: int) -> float:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=ps.get_data_parallel_group())
    return float(t.item())


def _fallback_scenario(rank: int) -> dict:
    """No recorder in this process: Megatron-Bridge's ``use_tp_pp_dp_mapping`` layout, rebuilt from derived sizes."""
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import MegatronRebuildError, destroy_groups, rebuild_groups

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp")
    before = _layout()
    snap = destroy_groups(backends=("gloo",))
    try:
        rebuild_groups(snap)
    except MegatronRebuildError as e:
        return {"error": str(e), "initialized": ps.model_parallel_is_initialized(), "kept": bool(snap.globals_before)}
    return {"error": None, "same": _layout() == before}


def _order_scenario(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp")  # use_tp_pp_dp_mapping
    before, sum_before = _layout(), _dp_sum(rank)
    snap = destroy_groups(backends=("gloo",))
    rebuilt = rebuild_groups(snap)
    return {"rebuilt": rebuilt, "recorded": snap.call is not None and snap.call.recorded, "before": before,
            "after": _layout(), "sums": (sum_before, _dp_sum(rank))}


def _vpp_scenario(rank: int) -> dict:
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    ps.initialize_model_parallel(1, 2, 2)  # positional: TP 1, PP 2, virtual pipeline size 2
    before, vpp_before = _layout(), ps.get_virtual_pipeline_model_parallel_world_size()
    rebuilt = rebuild_groups(destroy_groups(backends=("gloo",)))
    return {"rebuilt": rebuilt, "vpp": (vpp_before, ps.get_virtual_pipeline_model_parallel_world_size()),
            "same": _layout() == before}


def _retry_scenario(rank: int, tmp: str) -> dict:
    """Through the worker-level calls. Attempt 1 fails before creating any group (the recorded NCCL config file is
    gone), attempt 2 half-way (the recorded embedding-rank callback raises after the DP/CP/MP/TP/PP groups exist),
    attempt 3 succeeds. On CPU ``megatron_destroy_nccl`` destroys no (gloo) group but resets parallel_state."""
    import pathlib
    import types

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import MegatronRebuildError
    from rlix_plugins.nemo_rl.worker_ops import megatron_destroy_nccl, megatron_rebuild_nccl

    cfg = pathlib.Path(tmp) / f"nccl-{rank}.yaml"
    cfg.write_text("{}\n")
    failures = {"left": 0}

    def first_stage_only(pp_ranks: list[int], *_: object) -> list[int]:
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("embedding ranks unavailable")
        return [pp_ranks[0]]

    ps.initialize_model_parallel(pipeline_model_parallel_size=2, order="tp-cp-ep-pp-dp",
                                 nccl_communicator_config_path=str(cfg), get_embedding_ranks=first_stage_only)
    before = _layout()
    worker = types.SimpleNamespace()
    megatron_destroy_nccl(worker)
    snap, live = worker._rlix_nccl, len(dist.distributed_c10d._world.pg_map)
    attempts = []
    for attempt in range(3):
        if attempt == 0:
            cfg.rename(cfg.with_suffix(".away"))
        elif attempt == 1:
            cfg.with_suffix(".away").rename(cfg)
            failures["left"] = 1
        try:
            rebuilt = megatron_rebuild_nccl(worker)
        except MegatronRebuildError as e:
            attempts.append({"error": str(e), "cause": type(e.__cause__).__name__,
                             "initialized": ps.model_parallel_is_initialized(), "kept": worker._rlix_nccl is snap,
                             "live_groups": len(dist.distributed_c10d._world.pg_map) - live})
        else:
            attempts.append({"error": None, "rebuilt": rebuilt})
    return {"attempts": attempts, "before": before, "after": _layout(), "sum": _dp_sum(rank),
            "cleared": getattr(worker, "_rlix_nccl", "missing") is None}


def _one_rank_fails_scenario(rank: int) -> dict:
    """PP 4: the recorded embedding-rank callback answers differently at the replay, which changes the groups of
    ranks 0 and 3 only; ranks 1 and 2 must still undo theirs, or the retry would run on two ranks only."""
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import MegatronRebuildError, destroy_groups, rebuild_groups

    answer = {"ends": False}

    def embedding_ranks(pp_ranks: list[int], *_: object) -> list[int]:
        return [pp_ranks[0], pp_ranks[-1]] if answer["ends"] else [pp_ranks[0]]

    ps.initialize_model_parallel(pipeline_model_parallel_size=4, get_embedding_ranks=embedding_ranks)
    before = _layout()
    snap = destroy_groups(backends=("gloo",))
    answer["ends"] = True
    try:
        rebuild_groups(snap)
        first: dict = {"error": None}
    except MegatronRebuildError as e:
        first = {"error": str(e), "initialized": ps.model_parallel_is_initialized()}
    answer["ends"] = False
    return {"first": first, "retry": rebuild_groups(snap), "same": _layout() == before}


def _replay_worker(rank: int, port: int, out: dict, tmp: str) -> None:  # runs in a spawned process
    import warnings

    warnings.filterwarnings("ignore")
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=_WORLD)
    results: dict[str, object] = {}

    def run(name: str, scenario: object, *args: object) -> None:
        from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups

        try:
            results[name] = scenario(rank, *args)  # type: ignore[operator]
        except Exception as e:  # a failing scenario is reported by its test; the next starts from scratch
            results[name] = f"{type(e).__name__}: {e}"
        destroy_groups(backends=("gloo",))
        ps.destroy_model_parallel()

    run("fallback", _fallback_scenario)  # before the recorder is installed
    from rlix_plugins.nemo_rl.megatron_nccl import record_initialize_calls

    record_initialize_calls()  # what the worker must do before Megatron's setup
    run("order", _order_scenario)
    run("vpp", _vpp_scenario)
    run("retry", _retry_scenario, tmp)
    run("one rank fails", _one_rank_fails_scenario)
    out[rank] = results
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return _spawn(_replay_worker, str(tmp_path_factory.mktemp("nccl-cfg")), nprocs=_WORLD)


def _scenario(replays: dict, name: str) -> list[dict]:
    results = [replays[rank][name] for rank in range(_WORLD)]
    for rank, result in enumerate(results):
        assert isinstance(result, dict), f"rank {rank}: {result}"
    return results


@pytest.mark.slow
def test_rebuild_replays_the_recorded_tp_pp_dp_order(replays: dict) -> None:
    """Megatron-Bridge's ``use_tp_pp_dp_mapping`` (order ``tp-cp-ep-pp-dp``), PP 2 x DP 2: the default order would
    swap the pipeline and data-parallel groups (PP [0, 2], DP [0, 1])."""
    for rank, r in enumerate(_scenario(replays, "order")):
        assert r["rebuilt"] and r["recorded"]
        first = rank // 2 * 2
        assert r["before"]["_PIPELINE_MODEL_PARALLEL_GROUP"] == [[first, first + 1]]
        for name in ("_PIPELINE_MODEL_PARALLEL_GROUP", "_DATA_PARALLEL_GROUP"):
            assert r["after"][name] == r["before"][name], (rank, name)
        assert r["after"] == r["before"]  # every other group too
        assert r["sums"] == (4.0 + 2 * (rank % 2),) * 2  # DP all-reduce over {0, 2} / {1, 3} after the rebuild


@pytest.mark.slow
def test_rebuild_replays_the_virtual_pipeline_size(replays: dict) -> None:
    for r in _scenario(replays, "vpp"):
        assert r["rebuilt"] and r["same"]
        assert r["vpp"] == (2, 2)


@pytest.mark.slow
def test_failed_rebuild_is_undone_and_can_be_retried(replays: dict) -> None:
    for rank, r in enumerate(_scenario(replays, "retry")):
        missing_file, half_way, success = r["attempts"]
        assert missing_file["error"] is not None, f"rank {rank}: the first rebuild did not fail: {missing_file}"
        assert missing_file["cause"] == "FileNotFoundError" and "may be retried" in missing_file["error"]
        assert half_way["error"] is not None and half_way["cause"] == "RuntimeError"
        assert "embedding ranks unavailable" in half_way["error"]
        for failed in (missing_file, half_way):
            # undone: nothing initialized, no group left behind, the snapshot still on the worker
            assert not failed["initialized"] and failed["kept"] and failed["live_groups"] == 0, failed
        assert success == {"error": None, "rebuilt": True} and r["cleared"]
        assert r["after"] == r["before"]  # the recorded callback's embedding groups included
        if rank % 2 == 0:  # the first stage of PP groups [0, 1] and [2, 3]: the only embedding rank
            assert r["after"]["_EMBEDDING_GROUP"] == [[rank]]
        else:
            assert "_EMBEDDING_GROUP" not in r["after"]
        assert r["sum"] == 4.0 + 2 * (rank % 2)


@pytest.mark.slow
def test_unrecorded_layout_the_fallback_cannot_rebuild_fails_loudly(replays: dict) -> None:
    """Without a recorded call the fall-back uses Megatron's default order; the rank check turns what would be
    wrong gradients into an error, with the rebuild undone and the snapshot kept."""
    for r in _scenario(replays, "fallback"):
        assert r["error"] is not None, f"the fall-back rebuilt another layout silently: {r}"
        assert "_PIPELINE_MODEL_PARALLEL_GROUP" in r["error"] and "record_initialize_calls" in r["error"]
        assert not r["initialized"] and r["kept"]


@pytest.mark.slow
def test_a_rebuild_that_fails_on_one_rank_is_undone_on_every_rank(replays: dict) -> None:
    for rank, r in enumerate(_scenario(replays, "one rank fails")):
        assert r["first"]["error"] is not None, f"rank {rank} kept its rebuild: {r}"
        assert not r["first"]["initialized"]
        assert ("_EMBEDDING_GROUP" if rank in (0, 3) else "on another rank") in r["first"]["error"], r["first"]
        assert r["retry"] and r["same"]
