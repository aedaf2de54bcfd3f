"""Process-tree GPU memory (NVML): the tree is found from /proc; no NVML/GPU means "not measurable" (None)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rlix_plugins.pipeline.gpu_memory import process_tree_gpu_bytes, process_tree_pids


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
