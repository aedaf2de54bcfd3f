"""What is slow for ~100 ms after a vLLM wake: host->device copies in the engine run at half the link then.

Right after a level-2 ``wake_up()`` and with no sleep before (the reference), series of 64 MiB operations, each
timed with CUDA events, for ``--seconds``:

* ``ce_h2d``: the engine worker's copy from the cache's pinned pages (a copy engine), as ``expand.py`` measures;
* ``sm_h2d``: the same bytes read by a kernel (the SMs) through the pages' device address (UVA), no copy engine;
* ``ce_d2d``: a device-to-device copy (a copy engine, no PCIe);
* ``matmul``: a 4096^3 bf16 matmul (whether the engine's context is time-sliced with another);
* ``driver_ce_h2d``: a pinned host->device copy in this (the driver's) process, started as the wake returns:
  whether the slowness is the device's (every context) or the engine context's own.

Usage (GPU machine, vLLM kit): ``python benchmarks/wake_window.py [--json out.json]``
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))
# importing expand sets the environment the engine needs (spawned workers, offline, functions sent to the worker)
from expand import emit, engine_and_cache, progress

CHUNK = 64 << 20
OPS = ("ce_h2d", "sm_h2d", "sm_h2d_triton", "ce_d2d", "matmul")


_TRITON_SRC = """
import triton
import triton.language as tl


@triton.jit
def copy_kernel(src, dst, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
"""


def _triton_copy() -> Any:
    """A triton copy kernel, from a source file (triton reads the kernel's source; this function may arrive in the
    worker pickled by value)."""
    import importlib.util

    path = Path(tempfile.mkdtemp(prefix="rlix-triton-")) / "rlix_copy_kernel.py"
    path.write_text(_TRITON_SRC)
    spec = importlib.util.spec_from_file_location("rlix_copy_kernel", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.copy_kernel


class _Ptr:
    """What triton needs of a pointer argument."""

    def __init__(self, ptr: int, dtype: torch.dtype) -> None:
        self.ptr, self.dtype = ptr, dtype

    def data_ptr(self) -> int:
        return self.ptr


def op_series(worker: Any, payload: dict[str, Any] | None, op: str, seconds: float) -> dict[str, Any]:
    """``op`` back to back for ``seconds`` (in the engine's worker, or here with ``worker=None``): per op
    (seconds since the call, GB/s or TFLOP/s)."""
    from rlix_plugins.transport import device_view, open_host_pull

    dev = torch.device("cuda", torch.cuda.current_device())
    if payload is not None:
        src = open_host_pull(payload, pin=True)[0][1][:CHUNK]
    else:
        src = torch.empty(CHUNK, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(CHUNK, dtype=torch.uint8, device=dev)
    a = b = None
    note = ""
    if op == "sm_h2d":
        try:
            view = device_view(src, dev).view(torch.int32)
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        out32 = dst.view(torch.int32)

        def run() -> None:
            torch.bitwise_or(view, 0, out=out32)
        note = "bitwise_or(uva_view, 0)"
    elif op == "sm_h2d_triton":
        try:
            kernel = _triton_copy()
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
        n = CHUNK // 8
        s64, d64 = _Ptr(src.data_ptr(), torch.int64), dst.view(torch.int64)

        def run() -> None:
            kernel[(-(-n // 4096),)](s64, d64, n, BLOCK=4096)
        note = "triton int64 copy from the UVA address"
    elif op in ("ce_h2d", "driver_ce_h2d"):
        def run() -> None:
            dst.copy_(src, non_blocking=True)
    elif op == "ce_d2d":
        other = torch.empty_like(dst)

        def run() -> None:
            other.copy_(dst, non_blocking=True)
    elif op == "matmul":
        a = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
        b = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)

        def run() -> None:
            torch.matmul(a, b)
    else:
        raise ValueError(op)
    work = 2 * 4096**3 / 1e12 if op == "matmul" else CHUNK / 1e9
    torch.cuda.synchronize()
    start = time.perf_counter()
    points = []
    while time.perf_counter() - start < seconds:
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        run()
        e1.record()
        e1.synchronize()
        points.append((round(time.perf_counter() - start, 4), round(work / (e0.elapsed_time(e1) / 1e3), 1)))
    if op.startswith("sm_h2d"):  # the kernel read the right bytes
        note += ", bytes equal" if torch.equal(dst.cpu(), src) else ", BYTES DIFFER"
    return {"windows": windows(points), "note": note, "points": points}


def windows(points: list[tuple[float, float]]) -> dict[str, float]:
    out = {}
    for lo, hi in ((0, 0.05), (0.05, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.7)):
        xs = [v for t, v in points if lo <= t < hi]
        out[f"{lo}-{hi}s"] = round(sum(xs) / len(xs), 1) if xs else 0.0
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="1.5b")
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    from rlix_plugins.transport import make_host_pull_payload

    result: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    with tempfile.TemporaryDirectory(prefix="rlix-wake-window-") as tmp:
        llm, cache = engine_and_cache(Path(tmp), args.shape)
        with cache.read() as snap:
            payload = make_host_pull_payload(list(snap.buckets))
            for case in ("no sleep", "after a level-2 wake"):
                for op in (*OPS, "driver_ce_h2d"):
                    if case != "no sleep":
                        llm.sleep(level=2)
                        llm.wake_up()
                    if op == "driver_ce_h2d":
                        row = op_series(None, None, op, args.seconds)
                    else:
                        row = llm.collective_rpc(op_series, args=(payload, op, args.seconds))[0]
                    result.setdefault(case, {})[op] = row
                    progress(f"{case} {op}: {row}")
            # the driver's copies while the engine wakes: started before the wake call, in a thread
            llm.sleep(level=2)
            got: dict[str, Any] = {}
            t = threading.Thread(target=lambda: got.update(op_series(None, None, "driver_ce_h2d", 1.0)))
            t.start()
            time.sleep(0.2)
            t_wake = time.perf_counter()
            llm.wake_up()
            got["wake_s"] = round(time.perf_counter() - t_wake, 3)
            t.join(timeout=60)
            result["driver copies across a wake (wake starts at 0.2 s)"] = got
            progress(f"driver copies across a wake: {got}")
        try:
            import subprocess

            result["nvidia_smi_apps"] = subprocess.run(
                ["nvidia-smi", "--query-compute-apps=pid,process_name,used_memory", "--format=csv"],
                capture_output=True, text=True, timeout=20).stdout
        except Exception as exc:
            result["nvidia_smi_apps"] = repr(exc)
        cache.close()
    return emit(result, args.json)


if __name__ == "__main__":
    sys.exit(main())
