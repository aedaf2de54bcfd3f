"""The trainer's offload at a real model shape: NeMo RL's pageable copies vs an exact-size pinned arena (GPU only).

After every training step a time-shared DTensor trainer moves its fp32 weights and Adam moments to host memory and
back before its next step (``offload_after_refit``, then ``prepare_for_training``): 9-15 s of every training grant
at the Qwen2.5-1.5B shape on an H200 (``rlix/offload_s``). NeMo RL copies with ``to("cpu")`` into fresh pageable
memory each time. The alternative measured here keeps one host buffer of exactly the states' size, pinned once
(``cudaHostRegister``; torch's pinned caching allocator would round each block up to a power of two, up to 1.9x the
host memory at the Qwen2.5 shapes, printed below), and copies into views of it by DMA. Both run in one process on
the same tensors (the shape's parameters in fp32 and an AdamW step's two moments each), and the ratio is printed:

    python benchmarks/offload.py [--model Qwen/Qwen2.5-1.5B] [--rounds 2]

The arena's first round includes pinning it; the rounds after it are what every later step would cost.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any


def build(model: str) -> tuple[Any, Any, list[int]]:
    """The shape's parameters in fp32 on the GPU and an AdamW with both moments (one step); the tensors' bytes."""
    import torch

    from rlix_plugins.nemo_rl.model_shape import model_shape

    shape = model_shape(model)
    if shape is None:
        raise SystemExit(f"{model}: shape unknown here (a Hugging Face id rlix knows, or a directory with config.json)")
    module = torch.nn.ParameterList(
        [torch.nn.Parameter(torch.zeros(s, dtype=torch.float32, device="cuda")) for _, s in shape.tensor_shapes()])
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5)
    for p in module.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return module, optimizer, [p.numel() * 4 for p in module.parameters()] * 3


def stock_round(module: Any, optimizer: Any) -> tuple[float, float]:
    """NeMo RL's ``move_to_device`` and ``move_optimizer_to_device`` (DTensor workers, the pinned commit), each way."""
    import torch

    def move(device: str) -> None:
        module.to(device)
        for state in optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, torch.Tensor):
                    state[k] = v.to(device)
        torch.cuda.synchronize()

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    move("cpu")
    t1 = time.perf_counter()
    move("cuda")
    return t1 - t0, time.perf_counter() - t1


class Arena:
    """One pageable host buffer of exactly ``total`` bytes, registered with CUDA once (page-locked, DMA-able)."""

    def __init__(self, total: int) -> None:
        import torch

        self.buffer = torch.empty(total, dtype=torch.uint8)
        err = torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), total, 0)
        if int(err) != 0:
            raise SystemExit(f"cudaHostRegister of {total / 1e9:.1f} GB failed: {err}")

    def views(self, like: list[Any]) -> list[Any]:
        out, offset = [], 0
        for t in like:
            n = t.numel() * t.element_size()
            out.append(self.buffer[offset:offset + n].view(t.dtype).view(t.shape))
            offset += n
        return out


def arena_round(module: Any, optimizer: Any, arena: list[Any]) -> tuple[float, float]:
    """The same tensors through the arena: device -> arena views, free the device copies; then back to new ones."""
    import torch

    params = list(module.parameters())
    moments = [(s, k) for s in optimizer.state.values() for k, v in s.items() if isinstance(v, torch.Tensor)
               and v.is_cuda]
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    live = [p.data for p in params] + [s[k] for s, k in moments]
    if not arena:
        arena.append(Arena(sum(t.numel() * t.element_size() for t in live)))
    host = arena[0].views(live)
    for dst, src in zip(host, live, strict=True):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    for p, h in zip(params, host[:len(params)], strict=True):
        p.data = h
    for (s, k), h in zip(moments, host[len(params):], strict=True):
        s[k] = h
    del live
    t1 = time.perf_counter()
    for p in params:
        p.data = p.data.to("cuda", non_blocking=True)
    for s, k in moments:
        s[k] = s[k].to("cuda", non_blocking=True)
    torch.cuda.synchronize()
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
    rows = {"stock": [stock_round(module, optimizer) for _ in range(args.rounds)],
            "arena": [arena_round(module, optimizer, keep) for _ in range(args.rounds)]}
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
