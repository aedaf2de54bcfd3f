"""A training step after the Megatron group teardown/rebuild gives the loss of a worker that never tore down.

Two processes, a real megatron-core ``GPTModel`` with tensor parallel 2 (the local layer spec: no Transformer
Engine), SGD. Worker A trains step 1, destroys its model-parallel groups as the offload does, rebuilds them
(refreshing the model's group handles) and trains step 2; worker B, built from the same seed, trains both steps
on groups it never tore down. The losses must agree: a rebuild that wired the model to other ranks or left it on
destroyed groups would change (or hang) step 2.

On CPU (gloo) this runs everywhere megatron-core is installed. On two GPUs (NCCL, ``-m gpu``) it also measures the
device memory the teardown returns (``cudaMemGetInfo``: NCCL's buffers live outside torch's allocator) and takes it
back at the rebuild: what the time-sharing offload is for.
"""

from __future__ import annotations

import os
import socket

import pytest

pytest.importorskip("megatron.core", reason="megatron-core not installed (pip install megatron-core==0.16.1)")

_SEQ, _VOCAB = 16, 128


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _train_worker(rank: int, port: int, out: dict, backend: str) -> None:  # runs in a spawned process
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    from rlix_plugins.nemo_rl.megatron_nccl import destroy_groups, rebuild_groups

    gpu = backend == "nccl"
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    if gpu:
        torch.cuda.set_device(device)
    else:  # two CUDA-only pieces of Megatron's local attention, CPU stand-ins here: its score buffer pool, and the
        # model-parallel RNG fork around its dropout (dropout is 0 in this model: no random numbers are drawn)
        import contextlib

        from megatron.core.tensor_parallel.random import CudaRNGStatesTracker
        from megatron.core.utils import GlobalMemoryBuffer

        GlobalMemoryBuffer.get_tensor = lambda self, shape, dtype, name, *a, **k: torch.empty(shape, dtype=dtype)
        CudaRNGStatesTracker.fork = lambda self, *a, **k: contextlib.nullcontext()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group(backend, rank=rank, world_size=2)
    ps.initialize_model_parallel(tensor_model_parallel_size=2)

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(1234)
        if gpu:
            model_parallel_cuda_manual_seed(1234)
        cfg = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                                tensor_model_parallel_size=2, params_dtype=torch.float32, hidden_dropout=0.0,
                                attention_dropout=0.0)
        model = GPTModel(cfg, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=_VOCAB,
                         max_sequence_length=_SEQ, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        model.to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    mask = torch.triu(torch.ones(_SEQ, _SEQ, dtype=torch.bool, device=device), diagonal=1).view(1, 1, _SEQ, _SEQ)
    pos = torch.arange(_SEQ, device=device).view(1, _SEQ)

    def step(model: torch.nn.Module, opt: torch.optim.Optimizer, n: int) -> float:
        g = torch.Generator().manual_seed(n)  # the same batch on both ranks and for both workers
        ids = torch.randint(0, _VOCAB, (2, _SEQ), generator=g).to(device)
        loss = model(ids, pos.expand(2, -1), mask, labels=torch.roll(ids, -1, dims=1)).float().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.item())

    def free_bytes() -> int:
        if not gpu:
            return 0
        torch.cuda.synchronize()
        return int(torch.cuda.mem_get_info()[0])

    class Worker:  # the members of NeMo RL's MegatronPolicyWorker that hold group handles
        def __init__(self, model: torch.nn.Module) -> None:
            self.model = model
            self.state: dict = {}

    model, opt = build()
    a = [step(model, opt, 1)]
    before = free_bytes()
    snap = destroy_groups(backends=(backend,))
    torn_down = free_bytes()
    assert rebuild_groups(snap, Worker(model))
    live = dist.distributed_c10d._world.pg_map  # a destroyed gloo group may still work: check the handles too
    stale = [n for n, m in model.named_modules() if isinstance(getattr(m, "tp_group", None), dist.ProcessGroup)
             and m.tp_group not in live]
    a.append(step(model, opt, 2))  # the first collective on the rebuilt groups creates their communicators again
    rebuilt = free_bytes()

    model, opt = build()  # worker B: the same seed, never torn down
    b = [step(model, opt, 1), step(model, opt, 2)]
    out[rank] = {"a": a, "b": b, "destroyed": snap.groups_destroyed, "stale": stale, "freed": torn_down - before,
                 "taken_back": torn_down - rebuilt}
    dist.destroy_process_group()


def _run(backend: str) -> dict:
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_train_worker, args=(_port(), out, backend), nprocs=2, start_method="spawn", join=True)
        return dict(out)


def _check_losses(results: dict) -> None:
    for rank in (0, 1):
        r = results[rank]
        assert r["destroyed"] >= 3 and r["stale"] == [], r
        assert r["a"][0] == pytest.approx(r["b"][0], rel=1e-6), r  # same seed, same batch
        assert r["a"][1] == pytest.approx(r["b"][1], rel=1e-5), r  # step 2 after the rebuild
        assert r["a"][1] != pytest.approx(r["a"][0], rel=1e-3), r  # the step changed the weights


@pytest.mark.slow  # two processes that import torch and Megatron, and two models trained: ~70 s on 2 cores
def test_step_after_rebuild_matches_a_worker_that_never_tore_down_gloo() -> None:
    _check_losses(_run("gloo"))


@pytest.mark.gpu
def test_step_after_rebuild_matches_and_the_teardown_frees_nccl_memory() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    results = _run("nccl")
    _check_losses(results)
    for rank in (0, 1):
        r = results[rank]
        print(f"rank {rank}: teardown freed {r['freed'] / 2**20:.0f} MiB, rebuild took back "
              f"{r['taken_back'] / 2**20:.0f} MiB; losses {r['a']} vs {r['b']}")
        assert r["freed"] >= 16 * 2**20, r  # the TP communicator's buffers, back to the device
        assert r["taken_back"] > 0, r
