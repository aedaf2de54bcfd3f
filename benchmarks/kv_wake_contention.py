"""What slows a KV-cache wake while an expand's weight copies run: the link (PCIe reads) or the SMs?

An expand queues the weight copies, then wakes the KV cache while they run (``expand.py``). That wake maps ~60 GB
and takes longer with the copies running than alone. Here, per case, after a level-2 ``sleep`` and
``wake_up(["weights"])``: the engine's worker queues ``case``'s GPU work on a side stream and returns, the driver
times ``wake_up(["kv_cache"])``, then the worker reports how long the work ran (CUDA events). Cases:

* ``none``: the KV wake alone;
* ``sm_copy``: the weights' bytes (3.1 GB for 1.5B) read by the SMs from the pinned pages (``_foreach_copy_`` from
  ``transport.device_view``, as an expand's pull does) - PCIe reads and every SM;
* ``ce_copy``: the same bytes by a copy engine;
* ``sm_d2d``: the SMs busy for about as long without PCIe (device-to-device ``_foreach_copy_``);
* ``sm_copy_grid{P}``: the PCIe reads by a grid-stride triton copy kernel of only ``P`` programs (fewer SMs, less
  bandwidth: does a copy that leaves headroom on the link or the SMs leave the wake alone?).

Usage (GPU machine, vLLM kit): ``python benchmarks/kv_wake_contention.py [--repeats 3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
# importing expand sets the environment the engine needs (spawned workers, offline, functions sent to the worker)
from expand import emit, engine_and_cache, progress

CHUNK = 64 << 20
GRIDS = (16, 32, 64, 132)

_TRITON_SRC = """
import triton
import triton.language as tl


@triton.jit
def grid_copy(src, dst, n, BLOCK: tl.constexpr):
    step = tl.num_programs(0) * BLOCK
    for start in range(tl.program_id(0) * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
"""

def start_work(worker: Any, payload: dict[str, Any], case: str) -> float:
    """Queue ``case``'s work on a side stream (after the first call, which only sets up); host seconds to queue."""
    from rlix_plugins.transport import device_view, open_host_pull

    dev = torch.device("cuda", torch.cuda.current_device())
    if not hasattr(worker, "_kv_probe"):  # on the worker: this function arrives pickled by value, globals copied
        worker._kv_probe = {}
    _state = worker._kv_probe
    if "stream" not in _state:
        pages = [host for _, host in open_host_pull(payload, pin=True)]
        _state["stream"] = torch.cuda.Stream(dev)
        _state["pages"] = pages
        _state["views"] = [device_view(p, dev) for p in pages]
        total = sum(p.numel() for p in pages)
        _state["dst"] = torch.empty(total, dtype=torch.uint8, device=dev)
        _state["dst2"] = torch.empty(total, dtype=torch.uint8, device=dev)
        import importlib.util

        path = Path(tempfile.mkdtemp(prefix="rlix-triton-")) / "rlix_grid_copy.py"
        path.write_text(_TRITON_SRC)
        spec = importlib.util.spec_from_file_location("rlix_grid_copy", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _state["kernel"] = module.grid_copy
    stream, dst = _state["stream"], _state["dst"]
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream(dev))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record(stream)
        at = 0
        srcs, dsts, words = [], [], []
        for view, host in zip(_state["views"], _state["pages"], strict=True):
            n = view.numel() // 8 * 8
            srcs.append(view[:n].view(torch.int64))
            dsts.append(dst[at : at + n].view(torch.int64))
            words.append((host, at, n))
            at += n
        if case == "sm_copy":
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
        elif case == "ce_copy":
            for host, lo, n in words:
                dst[lo : lo + n].copy_(host[:n], non_blocking=True)
        elif case == "sm_d2d":  # ~the copies' duration of SM work with no PCIe: 20 passes device to device
            others = [_state["dst2"][lo : lo + n].view(torch.int64) for _, lo, n in words]
            for _ in range(20):
                torch._foreach_copy_(others, dsts, non_blocking=True)
        elif case.startswith("sm_copy_grid"):
            grid = int(case.removeprefix("sm_copy_grid"))
            for src, out in zip(srcs, dsts, strict=True):
                _state["kernel"][(grid,)](src, out, src.numel(), BLOCK=1024)
        elif case != "none":
            raise ValueError(case)
        end.record(stream)
    _state["events"] = (start, end)
    return time.perf_counter() - t0


def finish_work(worker: Any) -> dict[str, Any]:
    _state = worker._kv_probe
    start, end = _state.pop("events")
    end.synchronize()
    ms = start.elapsed_time(end)
    nbytes = _state["dst"].numel()
    return {"work_ms": round(ms, 2), "GBps_if_copy": round(nbytes / (ms / 1e3) / 1e9, 1) if ms else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--serve", type=float, default=0.5, help="idle seconds after each wake before the next sleep")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from rlix_plugins.transport import make_host_pull_payload

    cases = ["none", "sm_copy", "ce_copy", "sm_d2d", *(f"sm_copy_grid{g}" for g in GRIDS)]
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "shape": args.shape}
    with tempfile.TemporaryDirectory(prefix="rlix-kv-wake-") as tmp:
        llm, cache = engine_and_cache(Path(tmp), args.shape)
        with cache.read() as snap:
            payload = make_host_pull_payload(list(snap.buckets))
            llm.collective_rpc(start_work, args=(payload, "sm_copy"))  # setup + triton compile, then a warm-up
            llm.collective_rpc(finish_work)
            for grid in GRIDS:
                llm.collective_rpc(start_work, args=(payload, f"sm_copy_grid{grid}"))
                llm.collective_rpc(finish_work)
            rows: dict[str, list[dict[str, Any]]] = {c: [] for c in cases}
            for _ in range(args.repeats):
                for case in cases:  # interleaved: drift over the run falls on every case alike
                    time.sleep(args.serve)
                    llm.sleep(level=2)
                    llm.wake_up(["weights"])
                    queued = llm.collective_rpc(start_work, args=(payload, case))[0]
                    t0 = time.perf_counter()
                    llm.wake_up(["kv_cache"])
                    kv_wake = time.perf_counter() - t0
                    row = {"kv_wake_ms": round(kv_wake * 1e3, 1), "queue_ms": round(queued * 1e3, 2),
                           **llm.collective_rpc(finish_work)[0]}
                    rows[case].append(row)
                    progress(f"{case}: {row}")
            result["cases"] = {
                c: {"kv_wake_ms_median": round(statistics.median(r["kv_wake_ms"] for r in rs), 1),
                    "work_ms_median": round(statistics.median(r["work_ms"] for r in rs), 1),
                    "GBps_median": round(statistics.median(r["GBps_if_copy"] for r in rs), 1), "runs": rs}
                for c, rs in rows.items()}
        cache.close()
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
