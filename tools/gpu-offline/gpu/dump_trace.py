"""Write the rlix scheduler's trace of the Ray cluster at RAY_ADDRESS as JSON lines (a GPU-run tool).

    python3 tools/gpu-offline/gpu/dump_trace.py OUT.jsonl
"""

from __future__ import annotations

import dataclasses
import json
import sys

import ray

from rlix_plugins.control.client import connect

ray.init(address="auto", log_to_driver=False)
with open(sys.argv[1], "w") as f:
    for e in connect(create_if_missing=False).trace():
        f.write(json.dumps(dataclasses.asdict(e), default=str) + "\n")
