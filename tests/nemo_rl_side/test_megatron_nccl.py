"""Destroy/rebuild of Megatron's process groups with real megatron-core, 2 processes on gloo (CPU).

On CPU every Megatron group is a gloo group, so the test destroys ``backends=("gloo",)``; on GPU the default
(``("nccl",)``) leaves the gloo groups alone. What is proven here: the walk over ``parallel_state`` finds and
destroys each distinct group once, model parallel is reset, ``initialize_model_parallel`` rebuilds it, and
collectives on the rebuilt groups are correct, for 3 cycles. Device-memory release needs a GPU.
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


def _worker(rank: int, port: int, out: dict) -> None:  # runs in a spawned process
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)
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


def test_destroy_rebuild_cycles_on_gloo() -> None:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_worker, args=(_port(), out), nprocs=2, start_method="spawn", join=True)
        results = dict(out)
    for rank in (0, 1):
        cycles = results[rank]
        assert len(cycles) == 4
        for total, destroyed, still_init, again_init, tp in cycles[:3]:
            assert total == 3.0  # the TP all-reduce is correct before every destroy (and after rebuilds)
            assert destroyed >= 3 and not still_init and not again_init and tp == 2
        assert cycles[3][0] == 3.0 and cycles[3][2]
