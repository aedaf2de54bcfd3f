"""Fault-matrix rows across Ray nodes: two raylets on this machine (node B at 127.0.0.2) with two declared GPUs each
(node A: GPUs 0-1, node B: GPUs 2-3), the built-in pipelines of ``tests.harness.chaos`` placed by the control plane's
node table (trainer and engines on the node of their GPU).

The victim ``V`` trains on GPU 0 (node A) and rolls out on GPUs 0 and 2; the survivor ``S`` trains on GPU 3 (node
B) and rolls out on GPUs 0 and 3. So each has a rank on the other node from its trainer, synced by the gloo
broadcast with the rendezvous on the trainer's node, and GPU 0 is shared: V's training preempts S's rank there.
V's rank on GPU 2 is alone on its GPU, so it takes every refresh after V's steps: each row breaks V in a weight
sync into that engine on node B (the fault is claimed only by the engine on that node), and checks the row's promise
(``chaos.check_failed_alone``): V is failed within a bound, ``rlix status`` names why, nothing stays allocated to
it, and S trains on with its versions complete and in order. Then S ends cleanly and frees its GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.control._ray_helpers import wait_for
from tests.harness.chaos import RESOLVE_S, Bench, Survivor, check_failed_alone, inject, versions_in_order
from tests.harness.cross_node import two_nodes

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.own_cluster]

#: the rows whose moment is a weight sync into an engine on the other node from its trainer
ROWS = ["engine_kill_sync", "bucket_corrupt"]
SURVIVOR = {"train": [3], "infer": [0, 3]}
VICTIM = {"train": [0], "infer": [0, 2]}


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Bench]:
    with two_nodes(num_cpus=4, num_gpus=2):
        yield Bench(tmp_path_factory.mktemp("faults-nodes"))


@pytest.fixture(scope="module")
def survivor(bench: Bench) -> Iterator[Survivor]:
    box = Survivor(bench, SURVIVOR)
    yield box
    box.kill()


def test_the_node_table_puts_the_gpus_on_two_nodes(bench: Bench) -> None:
    table = bench.cp.node_table()
    assert table.locate(0).node_ip == table.locate(1).node_ip != table.locate(2).node_ip, table.describe()


@pytest.mark.parametrize("kind", ROWS)
def test_fault_across_nodes_fails_that_pipeline_alone(bench: Bench, survivor: Survivor, kind: str) -> None:
    s = survivor.get()
    victim = bench.launch("V", **VICTIM)
    try:
        wait_for(victim.started, timeout_s=300, what="the victim started")
        t0 = time.monotonic()
        done = inject(bench, victim, kind, node_ip=bench.cp.node_table().locate(2).node_ip)
        out = check_failed_alone(bench, victim, s, kind, done)
        print(f"\n{kind} across nodes: aim+inject {done['injected_s']:.0f} s, checks {time.monotonic() - t0:.0f} s; "
              f"{out}")
    finally:
        victim.kill()


def test_survivor_ends_cleanly_and_frees_its_gpus(bench: Bench, survivor: Survivor) -> None:
    s = survivor.get()
    s.driver.stop.remote()
    summary = s.result(RESOLVE_S)
    assert summary is not None and summary["error"] is None and not summary["end_errors"], summary
    versions = summary["collector"]["versions_seen"]
    assert versions_in_order(versions) and len(versions) == summary["steps"] + 1, versions
    wait_for(lambda: not bench.status()["allocations"], timeout_s=30, what="every GPU back in the pool")

