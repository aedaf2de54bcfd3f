"""A vLLM worker's start under its pipeline's start-up grant (``control.start_gate``), for both receiver workers.

vLLM's executor picks the worker's rendezvous address (``tcp://ip:port``, a port free at that moment) before the
worker's ``init_device`` binds it. The grant is waited for in between, often for minutes, so another pipeline's
engine starting meanwhile may take that port (seen on a GPU: ``EADDRINUSE`` on port 7000, the engine lost). A
one-process engine therefore re-picks a free port once it holds the grant; nothing else knows the old one.
"""

from __future__ import annotations

import socket
from typing import Any

from rlix_plugins.control.start_gate import hold_start_grant

__all__ = ["fresh_tcp_port", "start_under_grant"]


def fresh_tcp_port(init_method: str) -> str:
    """``init_method`` with a port free now, when it is a ``tcp://host:port`` address; otherwise unchanged."""
    if not init_method.startswith("tcp://"):
        return init_method  # file:// or env:// rendezvous: nothing to collide
    host = init_method[len("tcp://"):].rpartition(":")[0]
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        port = s.getsockname()[1]
    return f"tcp://{host}:{port}"


def start_under_grant(worker: Any) -> None:
    """Block until the worker's pipeline holds its start-up grant (no-op outside a time-shared pipeline), then give a
    one-process engine a rendezvous port that is free now. An engine of several workers (vLLM TP > 1) keeps its
    address: every worker must agree on it (shared placement runs TP 1 only)."""
    if hold_start_grant() is None:
        return
    if worker.parallel_config.world_size == 1:
        worker.distributed_init_method = fresh_tcp_port(worker.distributed_init_method)
