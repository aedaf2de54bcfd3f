"""Host->device bandwidth by engine: a copy engine, the SMs, and both at once.

The same pinned pages (a ``host_pull`` cache buffer) copied into one device buffer: by a copy engine
(``cudaMemcpyAsync``), by a copy kernel reading the pages through their device address
(``transport.device_view`` + ``_foreach_copy_``, what an expand does), and split between the two on two streams
(the first ``share`` of the bytes read by the SMs): whether the link takes more than one engine gives it.

Usage (GPU machine, torch only): ``python benchmarks/h2d_mix.py [--gib 1] [--json out.json]``
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).parent))


def main(argv: list[str] | None = None) -> int:
    from expand import best_gpu_seconds, emit

    from rlix_plugins.transport import SharedHostBuffer, device_view

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    nbytes = int(args.gib * (1 << 30)) // 4096 * 4096
    dev = torch.device("cuda", 0)
    buf = SharedHostBuffer(nbytes, pin=True)
    buf.tensor.fill_(7)
    host = buf.tensor
    view = device_view(host, dev)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "bytes": nbytes}

    def ce(lo: int = 0, hi: int = nbytes) -> None:
        dst[lo:hi].copy_(host[lo:hi], non_blocking=True)

    def sm(lo: int = 0, hi: int = nbytes) -> None:
        torch._foreach_copy_([dst[lo:hi].view(torch.int64)], [view[lo:hi].view(torch.int64)])

    def mix(share: float) -> Any:
        cut = int(nbytes * share) // 4096 * 4096

        def run() -> None:
            main = torch.cuda.current_stream(dev)
            for s in side:
                s.wait_stream(main)
            with torch.cuda.stream(side[0]):
                sm(0, cut)
            with torch.cuda.stream(side[1]):
                ce(cut, nbytes)
            for s in side:
                main.wait_stream(s)
        return run

    out["copy_engine_GBps"] = nbytes / best_gpu_seconds(ce, args.repeats + 1) / 1e9
    out["sms_GBps"] = nbytes / best_gpu_seconds(sm, args.repeats + 1) / 1e9
    for share in (0.1, 0.2, 0.3, 0.5):
        out[f"sms_{share:g}_plus_copy_engine_GBps"] = nbytes / best_gpu_seconds(mix(share), args.repeats + 1) / 1e9
    torch.cuda.synchronize()
    out["bytes_right"] = bool((dst == 7).all())
    buf.close()
    return emit({k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}, args.json)


if __name__ == "__main__":
    sys.exit(main())
