"""A DTensor (FSDP2) trainer's offload into one exact-size host arena, registered with CUDA once.

NeMo RL's offload after every step (``offload_after_refit``) moves the fp32 weights and both Adam moments with
``.to("cpu")`` into fresh pageable memory, and its onload (``prepare_for_training``) moves them back: 12.1-14.2 s and
3.1-3.2 s at the Qwen2.5-1.5B shape on an H200, inside every training grant of a trainer that cannot keep its states
on the GPU. Here the same tensors go by DMA into views of one host buffer of exactly their size, page-locked once
(``cudaHostRegister``; torch's pinned caching allocator rounds every block up to a power of two: 1.26x the host
memory at 1.5B, 1.9x at 0.5B and 7B), and the parameters and optimizer states are left pointing at those views,
as NeMo RL's own offload leaves them pointing at CPU tensors. NeMo RL's onload then runs unchanged and reads pinned
memory. On two H200 machines at the 1.5B shape (18.5 GB of states) ``benchmarks/offload.py`` measured 0.44-0.52 s
out and 0.42-0.48 s back (36-44 GB/s) against NeMo RL's 8.2-10.7 s and 2.2-2.8 s; the first offload, which makes and
page-locks the arena, 4.7-5.5 s.

How the parameters move: ``model._apply(fn)``, the path ``model.to`` takes, so that FSDP2's ``_apply`` re-points
its sharded data at what ``fn`` returns (``FSDPParam.reset_sharded_param``). ``fn`` builds the CPU DTensor itself:
``DTensor.from_local`` would move a CPU local tensor back to the mesh's device. The copies all run first and are
waited for once, because FSDP2 re-pads an uneven dim-0 shard by reading it on the CPU as soon as ``_apply`` returns
(that shard then lives in memory of FSDP2's own, copied once more: correct, counted in ``repadded``). A parameter
tied to another (Qwen's embedding and LM head) is one object and gets one slot. Gradients (NeMo RL frees them after
each step) go with ``.to("cpu")`` and buffers are swapped in place (the same objects), as NeMo RL's offload moves
them.

The layout is fixed at the first offload; an offload whose tensors differ from it (another optimizer state, a new
shape) replaces the arena.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["ArenaOffload", "StateArena", "offload_to_arena"]

#: Every slot starts on this boundary (any dtype's view of the uint8 buffer is then aligned).
_ALIGN: Final = 256


@dataclass(frozen=True)
class ArenaOffload:
    """What one offload moved: bytes and tensors into the arena, whether it built a new one, how many parameters
    FSDP2 re-padded into memory of its own, and the seconds it took."""

    bytes: int
    tensors: int
    new_arena: bool
    repadded: int
    seconds: float


def _local(t: Any) -> Any:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


class StateArena:
    """One host buffer holding a slot of exactly each tensor's bytes, page-locked with ``cudaHostRegister`` where
    CUDA is available (DMA copies both ways; a plain host buffer otherwise)."""

    def __init__(self, layout: list[tuple[Any, tuple[int, ...], Any]]) -> None:
        import torch

        self.layout = layout
        self.slots: dict[Any, tuple[int, tuple[int, ...], Any]] = {}
        offset = 0
        for key, shape, dtype in layout:
            offset = -(-offset // _ALIGN) * _ALIGN
            self.slots[key] = (offset, shape, dtype)
            offset += _numel(shape) * torch.empty((), dtype=dtype).element_size()
        self.nbytes = offset
        self.buffer = torch.empty(max(offset, 1), dtype=torch.uint8)
        self.registered = False
        if torch.cuda.is_available():
            err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.buffer.numel(), 0)
            if int(err) != 0:
                raise RuntimeError(f"cudaHostRegister of the trainer's {offset / 2**30:.1f} GiB state arena failed "
                                   f"({err}): the locked-memory limit (ulimit -l) may be too low for it")
            self.registered = True

    def view(self, key: Any) -> Any:
        offset, shape, dtype = self.slots[key]
        import torch

        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        return self.buffer[offset:offset + n].view(dtype).view(shape)

    def holds(self, t: Any) -> bool:
        """Whether ``t``'s (local) data lies in this arena (an empty shard, which has no data, counts as held)."""
        local = _local(t)
        ptr, start = local.data_ptr(), self.buffer.data_ptr()
        return local.numel() == 0 or start <= ptr < start + self.buffer.numel()

    def close(self) -> None:
        if self.registered:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
            self.registered = False


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _tensors(model: Any, optimizer: Any) -> list[tuple[Any, Any]]:
    """(key, tensor) of every parameter (each object once: tied parameters are one) and every optimizer state
    tensor of its parameter's shape (Adam's moments). Not the step count: torch makes it on the CPU and NeMo RL's
    onload moves it to the GPU, so a layout that followed its device changed between the first offload and the
    second (on an H200 each pipeline built and page-locked a second arena at its second step: 7.9-9.2 s)."""
    import torch

    out: list[tuple[Any, Any]] = []
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names[id(p)] = name
        out.append((("param", name), p))
    for p, state in optimizer.state.items():
        name = names.get(id(p))
        if name is None:
            continue
        for k, v in state.items():
            if isinstance(v, torch.Tensor) and _local(v).shape == _local(p).shape:
                out.append((("state", name, k), v))
    return out


def offload_to_arena(model: Any, optimizer: Any, arena: StateArena | None) -> tuple[StateArena, ArenaOffload]:
    """Move ``model``'s FSDP2 parameters and ``optimizer``'s states into ``arena`` (a new one when it is None or its
    layout differs) and leave them pointing there; returns the arena to keep for the next offload and what moved.
    Raises where a parameter is not a DTensor (not an FSDP2 model) and changes nothing then."""
    import gc

    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    t0 = time.perf_counter()
    for m in model.modules():  # the sharded parameters are the registered ones only after a reshard
        if isinstance(m, FSDPModule):
            m.reshard()
    tensors = _tensors(model, optimizer)
    plain = [key for key, t in tensors if key[0] == "param" and not isinstance(t, DTensor)]
    if plain:
        raise RuntimeError(f"offload_to_arena: {len(plain)} parameters are not DTensors (first: {plain[0][1]}): "
                           "the model is not sharded by FSDP2")
    layout = [(key, tuple(_local(t).shape), t.dtype) for key, t in tensors]
    new = arena is None or arena.layout != layout
    if new:
        if arena is not None:
            arena.close()
        arena = StateArena(layout)
    assert arena is not None
    on_gpu = any(_local(t).is_cuda for _, t in tensors)
    moved = 0
    for key, t in tensors:  # all copies first (asynchronous device-to-host into page-locked memory), one wait
        src = _local(t)
        arena.view(key).copy_(src, non_blocking=on_gpu and arena.registered)
        moved += src.numel() * src.element_size()
    if on_gpu:
        torch.cuda.synchronize()

    by_id = {id(t): key for key, t in tensors if key[0] == "param"}
    made: dict[int, Any] = {}

    def fn(t: Any) -> Any:
        key = by_id.get(id(t))
        if key is None:  # a gradient or a buffer: as NeMo RL's offload moves it
            return t.to("cpu")
        if id(t) not in made:  # a tied parameter comes twice: one slot, one DTensor
            made[id(t)] = DTensor(arena.view(key), t._spec, requires_grad=t.requires_grad)
        return made[id(t)]

    with torch.no_grad():
        for b in model.buffers():  # as NeMo RL's move_buffer_to_device: the same objects, their data on the CPU
            if not b.is_cpu:
                torch.utils.swap_tensors(b, b.to("cpu"))
        model._apply(fn)
        for p, state in optimizer.state.items():
            for k, v in list(state.items()):
                name = by_id.get(id(p))
                if not isinstance(v, torch.Tensor) or name is None:
                    continue
                if ("state", name[1], k) not in arena.slots:  # the step count: as NeMo RL's offload moves it
                    if not v.is_cpu:
                        state[k] = v.to("cpu")
                    continue
                view = arena.view(("state", name[1], k))
                state[k] = DTensor(view, v._spec, requires_grad=False) if isinstance(v, DTensor) else view
    repadded = sum(1 for _, p in model.named_parameters() if not arena.holds(p))
    del tensors
    made.clear()
    gc.collect()
    if on_gpu:
        torch.cuda.empty_cache()
    return arena, ArenaOffload(moved, len(layout), new, repadded, time.perf_counter() - t0)
