"""Process-tree GPU memory (NVML): the tree is found from /proc; no NVML/GPU means "not measurable" (None)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlix_plugins.pipeline.gpu_memory import (
    fullest_gpu_bytes,
    per_gpu_bytes,
    process_tree_gpu_bytes,
    process_tree_pids,
    release_cached_blocks,
    visible_gpu_free_bytes,
)


def test_tree_holds_this_process_and_a_grandchild_but_not_the_parent() -> None:
    code = "import subprocess, sys, time; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); " \
           "print(p.pid, flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        grandchild = int(child.stdout.readline())
        import os

        tree = process_tree_pids()
        assert {os.getpid(), child.pid, grandchild} <= tree
        assert os.getppid() not in tree
        assert process_tree_pids(child.pid) >= {child.pid, grandchild} and os.getpid() not in process_tree_pids(child.pid)
    finally:
        child.kill()
        child.wait(timeout=10)


def test_gpu_bytes_not_measurable_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: covered by the GPU demo run")
    assert process_tree_gpu_bytes() is None


def test_a_tensor_parallel_ranks_bytes_are_counted_per_gpu_not_summed() -> None:
    """NVML's per-GPU process lists (as a TP-2 engine shows them: its front-end and worker 0 on GPU 0, worker 1 on
    GPU 1, another pipeline's engine on both): the tree's bytes per GPU, other processes left out. The post-sleep
    check takes the fullest GPU (2.5 GiB here), not the sum over the rank's GPUs (4.5 GiB)."""
    gib = 1 << 30
    procs = {0: [(10, gib), (11, 3 * gib // 2), (99, 40 * gib)], 1: [(12, 2 * gib), (99, 40 * gib)], 2: []}
    assert per_gpu_bytes(procs, {10, 11, 12}) == {0: 5 * gib // 2, 1: 2 * gib}
    assert per_gpu_bytes(procs, {12, 13}) == {1: 2 * gib}
    assert per_gpu_bytes(procs, {13}) == {}


def test_a_rank_is_its_fullest_gpu_over_its_leaders_and_its_tp_workers_readings() -> None:
    """A TP-2 rank on vLLM's Ray executor (NeMo RL): the DP leader's tree holds its front-end (pid 10) and engine core
    (11) on GPU 0; the TP workers (20 on GPU 0, 21 on GPU 1) are other Ray actors, seen only by their own readings.
    Per GPU the sum over distinct processes: GPU 0 holds 0.5 + 0.25 + 2 GiB. A process two readings list (a
    worker inside its leader's tree, vLLM's multiprocessing executor) counts once; no reading: not measurable."""
    gib = 1 << 30
    leader = [(10, 0, gib // 2), (11, 0, gib // 4)]
    workers = [[(20, 0, 2 * gib)], [(21, 1, 3 * gib)]]
    assert fullest_gpu_bytes([leader, *workers]) == 3 * gib
    assert fullest_gpu_bytes([leader, [(20, 0, 2 * gib), (11, 0, gib // 4)], None]) == 2 * gib + 3 * gib // 4
    assert fullest_gpu_bytes([leader]) == 3 * gib // 4  # the leader's reading alone missed the TP workers
    assert fullest_gpu_bytes([None, None]) is None and fullest_gpu_bytes([[], None]) is None


def test_free_bytes_not_measurable_without_a_gpu() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: covered by the GPU demo run")
    assert visible_gpu_free_bytes() is None


def test_releasing_cached_blocks_never_imports_torch_or_makes_a_cuda_context() -> None:
    """A process without torch (Ray's driver side, a router) gets None and no torch: importing it would cost seconds
    and, on a GPU machine, a CUDA context is ~0.5 GiB on the GPU the reading is about."""
    code = ("import sys; from rlix_plugins.pipeline.gpu_memory import release_cached_blocks as r; "
            "print(r('test'), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.split() == ["None", "False"], out


def test_releasing_cached_blocks_without_a_cuda_context_measures_nothing() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pytest.skip("this process has a CUDA context: test_cached_blocks_go_back_to_the_driver covers it")
    assert release_cached_blocks("test") is None
    assert not torch.cuda.is_initialized()


@pytest.mark.gpu
def test_cached_blocks_go_back_to_the_driver() -> None:
    """A freed tensor's blocks stay in torch's cache, and NVML counts them as this process's, until released: the
    post-sleep readings release them first, so a slept engine is not charged for memory it no longer uses."""
    import torch

    held = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    keep = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    before = process_tree_gpu_bytes()
    del held
    got = release_cached_blocks("test")
    after = process_tree_gpu_bytes()
    assert got is not None and got[1] >= 512 << 20 and got[0] >= 64 << 20, got  # (other tests may hold more)
    assert before is not None and after is not None and before - after >= 500 << 20, (before, after)
    del keep
