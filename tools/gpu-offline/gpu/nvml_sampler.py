"""Sample GPU busy share, GPU memory and host memory into a CSV until stopped (a GPU-run tool, not the product).

    python3 tools/gpu-offline/gpu/nvml_sampler.py OUT.csv [--interval 0.2] [--gpus 0,1]     (SIGTERM/SIGINT ends it)

``--gpus``: the physical GPUs (NVML indices) of the run sampled (default: every GPU of the machine), so a run that
shares the machine with another run on other GPUs reports only its own. Columns: unix time, then per GPU
``util_<i>`` (NVML's utilization.gpu: the percent of the last sample period in which a kernel ran) and ``mem_<i>``
(bytes in use), then ``host_used`` (MemTotal - MemAvailable, bytes). Next to it, ``OUT_procs.csv`` (once a
second): ``time,gpu,pid,bytes,name``, each process's GPU memory as NVML reports it and its process title (Ray
actors name theirs ``ray::Class.method``), so a whole GPU's peak can be split into who held what.
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


def process_name(pid: int) -> str:
    """The process's title now (what ``ps`` shows; a Ray worker's changes as it takes an actor and runs its
    methods); '?' when it is not visible from here."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            name = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"
    return name.replace(",", ";") or "?"


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
    procs_out = args.out[:-4] + "_procs.csv" if args.out.endswith(".csv") else args.out + "_procs.csv"
    last_procs = 0.0
    with open(args.out, "w", buffering=1) as f, open(procs_out, "w", buffering=1) as fp:
        f.write(",".join(["time", *(f"util_{i}" for i in ids), *(f"mem_{i}" for i in ids), "host_used"]) + "\n")
        fp.write("time,gpu,pid,bytes,name\n")
        while not stop:
            t = time.time()
            util = [pynvml.nvmlDeviceGetUtilizationRates(h).gpu for h in handles]
            mem = [pynvml.nvmlDeviceGetMemoryInfo(h).used for h in handles]
            f.write(",".join([f"{t:.3f}", *map(str, util), *map(str, mem), str(host_used())]) + "\n")
            if t - last_procs >= 1.0:
                last_procs = t
                for i, h in zip(ids, handles, strict=True):
                    try:
                        running = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
                    except pynvml.NVMLError:
                        continue
                    for proc in running:
                        used = proc.usedGpuMemory or 0  # None where the driver does not say
                        fp.write(f"{t:.3f},{i},{proc.pid},{used},{process_name(proc.pid)}\n")
            time.sleep(max(args.interval - (time.time() - t), 0.0))
    return 0


if __name__ == "__main__":
    sys.exit(main())
