"""How many demo pipelines fit: each budget binds where it should, and the default demo fits a small machine."""

from __future__ import annotations

from rlix_plugins.demo.capacity import (
    ENGINE_HOST_GIB,
    PIPELINE_HOST_GIB,
    RAY_HOST_GIB,
    capacity,
)


def test_memory_binds_on_a_small_machine() -> None:
    cap = capacity(2, memory_gib=21.0, cores=2, init_timeout_s=900.0)
    assert cap.limit == int((21.0 - RAY_HOST_GIB) // (2 * ENGINE_HOST_GIB + PIPELINE_HOST_GIB)) == 10
    assert "GiB of memory per pipeline" in cap.reason and "8 processes" in cap.reason


def test_more_gpus_mean_more_engines_per_pipeline_so_fewer_pipelines() -> None:
    assert capacity(8, memory_gib=21.0, cores=2, init_timeout_s=900.0).limit < 10


def test_start_up_cpu_binds_with_plenty_of_memory_and_few_cores() -> None:
    cap = capacity(2, memory_gib=1000.0, cores=2, init_timeout_s=900.0)
    assert "CPU-seconds" in cap.reason and cap.limit == 2 * 450 // 32


def test_gpu_memory_binds_on_small_gpus() -> None:
    cap = capacity(2, memory_gib=1000.0, cores=64, init_timeout_s=900.0, gpu_memory_gib=16.0)
    assert "every GPU holds an engine of every pipeline" in cap.reason and cap.limit == 7


def test_the_default_demo_fits_an_8_gib_two_core_machine() -> None:
    assert capacity(2, memory_gib=8.0, cores=2, init_timeout_s=900.0).limit >= 2


def test_a_tensor_parallel_engine_counts_its_workers_and_its_own_process() -> None:
    """TP 2 on 4 GPUs: 2 engines of 2 workers + the engine's process each = 6 engine processes (TP 1: 4)."""
    cap = capacity(4, memory_gib=21.0, cores=2, init_timeout_s=900.0, tp=2)
    assert cap.limit == int((21.0 - RAY_HOST_GIB) // (6 * ENGINE_HOST_GIB + PIPELINE_HOST_GIB))
    assert "12 processes" in cap.reason and "2 vLLM engines of TP 2" in cap.reason
    assert cap.limit < capacity(4, memory_gib=21.0, cores=2, init_timeout_s=900.0).limit
