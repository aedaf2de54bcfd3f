"""The trainer's offload at a real model shape: NeMo RL's pageable copies vs rlix's state arena (GPU only).

After every training step a time-shared DTensor trainer that cannot keep its states on the GPU moves its fp32
weights and Adam moments to host memory and back before its next step: 9-15 s of every training grant at the
Qwen2.5-1.5B shape on an H200 (``rlix/offload_s``). NeMo RL copies with ``to("cpu")`` into fresh pageable memory
each time (``offload_after_refit``, then ``prepare_for_training``). rlix's offload
(``rlix_plugins.nemo_rl.state_arena.offload_to_arena``, what the runtime runs on every DTensor worker) keeps one
host buffer of exactly the states' size, page-locked once (torch's pinned caching allocator would round each block
up to a power of two, up to 1.9x the host memory at the Qwen2.5 shapes, printed below), copies into views of it by
DMA and leaves the parameters there; NeMo RL's own onload then reads pinned memory. Both run in one process on the
same FSDP2 module (the shape's parameters in fp32, sharded by ``fully_shard`` over one rank, and an AdamW step's
two moments each), every round checks the values came back, and the ratio is printed:

    python benchmarks/offload.py [--model Qwen/Qwen2.5-1.5B] [--rounds 2]

The arena's first round includes making and page-locking it; the rounds after it are what every later step costs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any


def build(model: str) -> tuple[Any, Any, list[int]]:
    """The shape's parameters in fp32 on the GPU, sharded by FSDP2 (one rank, NCCL), and an AdamW with both moments
    (one step); the tensors' bytes."""
    import socket

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlix_plugins.nemo_rl.model_shape import model_shape

    shape = model_shape(model)
    if shape is None:
        raise SystemExit(f"{model}: shape unknown here (a Hugging Face id rlix knows, or a directory with config.json)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    module = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(s, dtype=torch.float32, device="cuda")) for _, s in shape.tensor_shapes()])
    fully_shard(module, mesh=init_device_mesh("cuda", (1,)))
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5)
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return module, optimizer, [p.numel() * 4 for p in module.parameters()] * 3


def fingerprint(module: Any, optimizer: Any) -> float:
    """A sum over every parameter shard and moment: the values a round must bring back."""
    from torch.distributed.tensor import DTensor

    tensors = list(module.parameters()) + [v for st in optimizer.state.values() for k, v in st.items() if k != "step"]
    return sum(float((t.to_local() if isinstance(t, DTensor) else t).detach().double().sum()) for t in tensors)


def move(module: Any, optimizer: Any, device: str) -> None:
    """NeMo RL's ``move_to_device`` and ``move_optimizer_to_device`` (DTensor workers, the pinned commit):
    ``model.to(device)``, then every optimizer state ``.to(device)``; to the CPU in ``offload_after_refit``, back in
    ``prepare_for_training``."""
    import torch

    module.to(device)
    for state in optimizer.state.values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                state[k] = v.to(device)
    torch.cuda.synchronize()


def stock_round(module: Any, optimizer: Any) -> tuple[float, float]:
    """NeMo RL's offload, then its onload."""
    import torch

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    move(module, optimizer, "cpu")
    t1 = time.perf_counter()
    move(module, optimizer, "cuda")
    return t1 - t0, time.perf_counter() - t1


def arena_round(module: Any, optimizer: Any, keep: list[Any]) -> tuple[float, float]:
    """rlix's offload into the arena (kept across rounds), then NeMo RL's onload."""
    import torch

    from rlix_plugins.nemo_rl.state_arena import offload_to_arena

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    arena, moved = offload_to_arena(module, optimizer, keep[0] if keep else None)
    keep[:] = [arena]
    if moved.repadded:
        print(f"  {moved.repadded} parameters re-padded by FSDP2 outside the arena")
    t1 = time.perf_counter()
    move(module, optimizer, "cuda")
    return t1 - t0, time.perf_counter() - t1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/offload.py times device-host copies: no CUDA device here")
    module, optimizer, sizes = build(args.model)
    gb = sum(sizes) / 1e9
    rounded = sum(1 << (n - 1).bit_length() for n in sizes) / 1e9
    keep: list[Any] = []
    want = fingerprint(module, optimizer)
    rows: dict[str, list[tuple[float, float]]] = {"stock": [], "arena": []}
    for path, run in (("stock", lambda: stock_round(module, optimizer)),
                      ("arena", lambda: arena_round(module, optimizer, keep))):
        for _ in range(args.rounds):
            rows[path].append(run())
            got = fingerprint(module, optimizer)
            if got != want:
                raise SystemExit(f"{path}: the states came back changed ({got} != {want})")
    print(f"{args.model}: {gb:.1f} GB of fp32 weights and Adam moments (torch's pinned caching allocator would pin "
          f"{rounded:.1f} GB: {rounded / gb:.2f}x)")
    print(f"{'round':>5} {'path':>6} {'offload s':>10} {'GB/s':>6} {'onload s':>9} {'GB/s':>6}")
    for i in range(args.rounds):
        for path, runs in rows.items():
            off, on = runs[i]
            print(f"{i + 1:>5} {path:>6} {off:>10.2f} {gb / off:>6.1f} {on:>9.2f} {gb / on:>6.1f}")
    last = {p: r[-1] for p, r in rows.items()}
    print(f"last round, stock / arena: offload {last['stock'][0] / last['arena'][0]:.1f}x, onload "
          f"{last['stock'][1] / last['arena'][1]:.1f}x; "
          f"a step's hand-over {sum(last['stock']):.1f} s -> {sum(last['arena']):.1f} s")
    print("RESULT " + json.dumps({"model": args.model, "gb": round(gb, 2), "pow2_gb": round(rounded, 2), **{
        p: [[round(a, 3), round(b, 3)] for a, b in r] for p, r in rows.items()}}))
    return 0 if all(math.isfinite(x) for r in rows.values() for pair in r for x in pair) else 1


if __name__ == "__main__":
    raise SystemExit(main())
