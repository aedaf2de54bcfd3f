"""Destroy/rebuild of Megatron's process groups with real megatron-core, 2 processes on gloo (CPU).

On CPU every Megatron group is a gloo group, so the tests destroy ``backends=("gloo",)``; on GPU the default
(``("nccl",)``) leaves the gloo groups alone. What is proven here: the walk over ``parallel_state`` finds and
destroys each distinct group once, model parallel is reset, ``initialize_model_parallel`` rebuilds it, collectives
on the rebuilt groups are correct, for 3 cycles; and on a real Megatron ``GPTModel`` (TP 2) every holder of a group
handle the worker can reach - the model's ``pg_collection`` (what NeMo RL's worker reads through
``get_pg_collection(self.model)``), each module's ``tp_group``, Megatron-Bridge-style
``partial(finalize_model_grads, pg_collection=...)`` in the model config and NeMo RL's saved copy of it - points at
the rebuilt (live) groups afterwards. Device-memory release needs a GPU.
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


def _spawn(fn: object) -> dict:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(fn, args=(_port(), out), nprocs=2, start_method="spawn", join=True)
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
