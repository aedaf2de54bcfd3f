"""Sample GPU busy share, GPU memory and host memory into a CSV until stopped (a GPU-run tool, not the product).

    python3 tools/gpu-offline/gpu/nvml_sampler.py OUT.csv [--interval 0.2] [--gpus 0,1]     (SIGTERM/SIGINT ends it)

``--gpus``: the physical GPUs (NVML indices) of the run sampled (default: every GPU of the machine), so a run that
shares the machine with another run on other GPUs reports only its own. Columns: unix time, then per GPU
``util_<i>`` (NVML's utilization.gpu: the percent of the last sample period in which a kernel ran) and ``mem_<i>``
(bytes in use), then ``host_used`` (MemTotal - MemAvailable, bytes).
"""

from __future__ import annotations

import argparse
import signal
import sys
import time


def host_used() -> int:
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            info[key] = int(value.split()[0]) * 1024
    return info["MemTotal"] - info["MemAvailable"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--interval", type=float, default=0.2)
    ap.add_argument("--gpus", default="", help="comma-separated NVML indices (default: all)")
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    ids = [int(g) for g in args.gpus.split(",") if g] or list(range(pynvml.nvmlDeviceGetCount()))
    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in ids]
    stop = False

    def end(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, end)
    signal.signal(signal.SIGINT, end)
    with open(args.out, "w", buffering=1) as f:
        f.write(",".join(["time", *(f"util_{i}" for i in ids), *(f"mem_{i}" for i in ids), "host_used"]) + "\n")
        while not stop:
            t = time.time()
            util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
            mem = [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles]
            f.write(",".join([f"{t:.3f}", *map(str, util), *map(str, mem), str(host_used())]) + "\n")
            time.sleep(max(args.interval - (time.time() - t), 0.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
