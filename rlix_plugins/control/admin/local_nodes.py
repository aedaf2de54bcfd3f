"""Several Ray nodes on one machine, as a cluster of that many machines is (``rlix demo --nodes``; the tests' clusters
of two raylets): the head on the machine's address, node k at :func:`node_ip` (Linux routes all of 127/8 to
loopback, so a rendezvous on the wrong node's address fails instead of passing by accident), every raylet in one
private Ray temp directory.

Ray's ``Cluster`` records its head as *the* Ray cluster of the machine (the file a plain ``ray.init()`` joins,
in Ray's default temp directory whatever temp directory the nodes use): a test session or another user's
``ray.init()`` would join it while it runs; and its shutdown deletes the record, whoever's it is. The record is put
back as it was after both."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rlix_plugins.errors import RlixConfigError

__all__ = ["LocalNodes", "bindable", "node_ip", "start_local_nodes"]


def node_ip(k: int) -> str:
    """The address of node ``k`` >= 1 (the head, node 0, is on the machine's address)."""
    return f"127.0.0.{k + 1}"


def bindable(ip: str) -> bool:
    """Whether this machine can listen on ``ip`` (127/8 beyond 127.0.0.1 is routed to loopback on Linux, not macOS)."""
    try:
        with socket.socket() as sock:
            sock.bind((ip, 0))
        return True
    except OSError:
        return False


def _check_bindable(nodes: int) -> None:
    for k in range(1, nodes):
        if not bindable(node_ip(k)):
            raise RlixConfigError(f"{nodes} Ray nodes on one machine put node {k} at {node_ip(k)}, which this machine "
                                  "cannot listen on (Linux routes 127.0.0.0/8 to loopback, macOS does not): use a "
                                  "cluster of several machines")


@contextlib.contextmanager
def _address_record_kept() -> Iterator[None]:
    """Put Ray's record of the machine's cluster back as it was after the block (see the module docstring)."""
    from ray._private.utils import get_ray_address_file  # Ray keeps its path there only

    path = get_ray_address_file(None)
    try:
        with open(path, encoding="utf-8") as fh:
            before: str | None = fh.read()
    except OSError:
        before = None
    folder = os.path.dirname(path)
    made = not os.path.isdir(folder)
    os.makedirs(folder, exist_ok=True)  # Ray writes the record there without creating it (a machine new to Ray)
    try:
        yield
    finally:
        if before is None:
            with contextlib.suppress(OSError):
                os.remove(path)
                if made:
                    os.rmdir(folder)
        else:
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(before)


@dataclass
class LocalNodes:
    """A running cluster of :func:`start_local_nodes`; :meth:`end` stops every process of it."""

    cluster: Any
    temp_dir: str

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def end(self) -> None:
        with _address_record_kept():  # Ray's shutdown deletes the record, whoever's it is
            self.cluster.shutdown()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def start_local_nodes(nodes: int, *, num_cpus: int, num_gpus: int,
                      resources: Sequence[Mapping[str, float]] | None = None,
                      env: Sequence[Mapping[str, str]] | None = None, timeout_s: float = 120.0) -> LocalNodes:
    """``nodes`` raylets on this machine, each declaring ``num_cpus`` CPUs and ``num_gpus`` GPUs, plus node k's
    ``resources[k]`` and environment ``env[k]`` (e.g. its slice of the GPUs in ``CUDA_VISIBLE_DEVICES``); returns
    once every node registered (within ``timeout_s``). Nothing is connected to it."""
    from ray.cluster_utils import Cluster

    _check_bindable(nodes)
    temp_dir = tempfile.mkdtemp(prefix="rlix-nodes-")

    def args(k: int) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": num_cpus, "num_gpus": num_gpus, "temp_dir": temp_dir,
                               "include_dashboard": False, "resources": dict(resources[k]) if resources else {},
                               "env_vars": dict(env[k]) if env else {}}
        if k:
            out["node_ip_address"] = node_ip(k)
        return out

    with _address_record_kept():
        cluster = Cluster(initialize_head=True, head_node_args=args(0))
    started = LocalNodes(cluster, temp_dir)
    try:
        for k in range(1, nodes):
            cluster.add_node(**args(k))
        cluster.wait_for_nodes(timeout=timeout_s)
    except BaseException:
        started.end()
        raise
    return started
