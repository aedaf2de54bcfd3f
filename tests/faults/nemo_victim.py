"""The victim pipeline of the NeMo RL host's fault rows: a driver process like NeMo RL's (its own Ray driver), running
our hooks (full mode: :class:`~rlix_plugins.nemo_rl.runtime_adapter.NemoRuntime`) over the CPU stand-ins with one
real vLLM engine whose worker breaks on demand (:mod:`tests.harness.fault_worker`, fault file in argv).

``python -m tests.faults.nemo_victim GCS_ADDRESS MODEL_DIR FAULT_FILE``: trains GPU 0, rolls out on GPU 0, steps
until it is broken; prints ``STARTED <pipeline id>`` once its collector is attached and ``STEP <n>`` after each
step. Its loop's ``finally`` calls ``on_pipeline_end`` as the patched ``async_grpo_train`` does.
"""

from __future__ import annotations

import sys

import ray

from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from tests.harness.fault_file import FAULT_FILE_ENV
from tests.nemo_rl.without_nemo.standins import (
    StandinCollector,
    StandinGeneration,
    StandinMegatronWorker,
    StandinPolicy,
    StandinReplayBuffer,
    StandinVllmWorker,
    standin_master_config,
)

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
#: Short bounds (as the built-in rows' ``chaos.BENCH_RUNTIME``); the lease is the NeMo RL host's ``rlix`` key.
RLIX = {"train_devices": [0], "infer_devices": [0], "request_timeout_s": 150, "init_timeout_s": 300,
        "sync_timeout_s": 30, "drain_timeout_s": 15, "watchdog_interval_s": 1.0, "bucket_size_bytes": 4 << 20,
        "heartbeat_lease_s": 10.0}


def config() -> dict[str, object]:
    return standin_master_config(dict(RLIX))


def main(address: str, model: str, fault_file: str) -> None:
    ray.init(address=address, namespace="rlix_tests", log_to_driver=False)
    engine = ray.remote(StandinVllmWorker).options(num_cpus=0, runtime_env={"env_vars": {
        **ENV, FAULT_FILE_ENV: fault_file}}).remote(model, 1, 512, "tests.harness.fault_worker.FaultCPUWorker")
    ray.get(engine.start.remote(), timeout=300)
    trainer = ray.remote(StandinMegatronWorker).options(num_cpus=0).remote(model)
    generation = StandinGeneration([engine])
    hooks = NemoRLHooks()
    hooks.rlix_pipeline_start(master_config=config(), policy=StandinPolicy(trainer), policy_generation=generation,
                              start_step=0)
    try:
        collector = ray.remote(StandinCollector).options(num_cpus=0, max_concurrency=4).remote(generation)
        replay = ray.remote(StandinReplayBuffer).options(num_cpus=0).remote()
        hooks.on_trajectory_collector_created(collector=collector, replay_buffer=replay)
        print("STARTED", hooks.pipeline_id, flush=True)
        step = 0
        while True:
            ray.get(replay.add.remote(step, 4), timeout=60)
            hooks.before_training(step=step)
            ray.get(trainer.train.remote(seed=100 + step), timeout=60)
            hooks.before_weight_sync(step=step)
            version = hooks.after_training(step=step)
            ray.get(collector.set_weight_version.remote(version), timeout=60)
            hooks.on_weight_version_published(step=step, weight_version=version)
            print("STEP", step, flush=True)
            step += 1
    finally:
        hooks.on_pipeline_end()


if __name__ == "__main__":
    main(*sys.argv[1:4])
