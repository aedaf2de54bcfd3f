"""Write the rlix scheduler's trace of the Ray cluster at RAY_ADDRESS as JSON lines (a GPU-run tool); `rlix timeline
--trace OUT.jsonl --out t.png` draws it later.

    python3 tools/gpu-offline/gpu/dump_trace.py OUT.jsonl
"""

from __future__ import annotations

import sys

import ray

from rlix_plugins.control.capacity.timeline import write_trace
from rlix_plugins.control.client import connect

ray.init(address="auto", log_to_driver=False)
write_trace(connect(create_if_missing=False).trace(), sys.argv[1])
