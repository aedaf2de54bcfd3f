"""The fault file the chaos tools arm and a broken component claims (no vLLM, no Ray: read in any process).

``RLIX_FAULT_FILE`` names a JSON file ``{"op": ..., "action": ..., "seconds": ..., "node_ip": ...}`` (``node_ip``:
only a process on that Ray node claims it). The process that reaches
``op`` first claims it by renaming the file (atomic, so a fault fires once), then puts its record, pid included, at
``<file>.hit`` in one rename; the injector waits for that file to know the operation is under way.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

__all__ = ["FAULT_FILE_ENV", "claim_fault"]

FAULT_FILE_ENV = "RLIX_FAULT_FILE"


def claim_fault(op: str) -> dict[str, Any] | None:
    """The armed fault for ``op`` (claimed: it fires once), or None."""
    path = os.environ.get(FAULT_FILE_ENV)
    if not path or not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            fault = json.load(f)
    except (OSError, ValueError):
        return None
    if fault.get("op") != op:
        return None
    if fault.get("node_ip") and os.environ.get("RLIX_NODE_IP") != fault["node_ip"]:
        return None  # aimed at the engine on another Ray node (``transport.export_node_env`` names this one's)
    claimed = f"{path}.claimed.{os.getpid()}"
    try:
        os.rename(path, claimed)
    except OSError:
        return None  # another process claimed it
    # The record appears under ``.hit`` whole, pid included: renaming the armed file straight to ``.hit`` let the
    # injector read the fault's own JSON (no pid yet) in the moment before this process rewrote it.
    with open(claimed, "w") as f:
        json.dump({**fault, "pid": os.getpid(), "time": time.time()}, f)
    os.replace(claimed, path + ".hit")
    return dict(fault)


