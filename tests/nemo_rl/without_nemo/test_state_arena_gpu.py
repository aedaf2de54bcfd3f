"""The state arena on a GPU (device machine only): an FSDP2 model (one rank, NCCL) with AdamW offloads into its
page-locked arena, the device memory of its states is freed, NeMo RL's onload brings them back from it, and the model
trains on exactly as a twin that never offloaded. The speed against NeMo RL's own copies: ``benchmarks/offload.py``."""

from __future__ import annotations

import socket
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.gpu


def _twin(seed: int) -> tuple[Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)).cuda()
    model.register_buffer("scale", torch.ones(256, device="cuda"))  # as a rotary embedding's inv_freq
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=init_device_mesh("cuda", (1,)))
    fully_shard(model, mesh=init_device_mesh("cuda", (1,)))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def _step(model: Any, optimizer: Any) -> float:
    model.train()
    x = torch.linspace(-1, 1, 8 * 256, device="cuda").view(8, 256)
    loss = (model(x) - x).pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return float(loss)


def _onload(model: Any, optimizer: Any) -> None:
    """NeMo RL's ``prepare_for_training`` (DTensor workers): buffers swapped to the GPU, ``model.to("cuda")``, every
    optimizer state ``.to("cuda")``."""
    for b in model.buffers():
        torch.utils.swap_tensors(b, b.to("cuda"))
    model.to("cuda")
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to("cuda")


def test_states_offload_into_the_page_locked_arena_and_train_on_after_nemo_rls_onload() -> None:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from rlix_plugins.nemo_rl.state_arena import offload_to_arena

    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    model, optimizer = _twin(0)
    twin, twin_optimizer = _twin(0)
    assert _step(model, optimizer) == _step(twin, twin_optimizer)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()

    buffer = model.scale
    arena, moved = offload_to_arena(model, optimizer, None)
    assert model.scale is buffer and buffer.is_cpu  # the same object, as NeMo RL's offload leaves it
    assert arena.registered and arena.buffer.is_pinned() and moved.new_arena and moved.repadded == 0
    states = [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
    for t in [*model.parameters(), *states]:
        assert isinstance(t, DTensor) and t.to_local().is_cpu and arena.holds(t)
    assert held - torch.cuda.memory_allocated() >= moved.bytes  # the states' device memory is free

    _onload(model, optimizer)
    assert all(p.to_local().is_cuda for p in model.parameters())
    for _ in range(2):  # trains on exactly as the twin; the second offload reuses the arena
        assert _step(model, optimizer) == _step(twin, twin_optimizer)
        again, moved = offload_to_arena(model, optimizer, arena)
        assert again is arena and not moved.new_arena
        _onload(model, optimizer)
    for p, q in zip(model.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p.to_local(), q.to_local())
    arena.close()
