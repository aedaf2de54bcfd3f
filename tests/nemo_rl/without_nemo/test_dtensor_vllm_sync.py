"""The DTensor weight source end to end on CPU: 2 FSDP2 ranks as Ray actors (reached with ``__ray_call__`` as
NeMo RL's policy workers are) → :class:`PolicyWeightSource` (``trainer="dtensor"``) builds the cache → one real
vLLM-CPU engine receives it through the shared ``sync_from_cache`` (same-GPU cpu_serialize and gloo broadcast).

One engine for the module (~25 s): it starts on the base weights, so its first greedy outputs are the reference
"an engine loaded with these weights". The ranks start on other weights (a sync must change the outputs), then
load the base weights, and the next sync must reproduce the reference token for token. In between, the runtime's
offload steps run (mark offloaded → release the communication groups → build refused → restore → train step).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.nemo_rl.weights import PolicyWeightSource
from tests.nemo_rl.without_nemo.dtensor_ranks import BUCKET_BYTES, WORLD, FsdpRankActor, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

PROMPTS = ["hello world the model", "sync sleep wake gpu", "the cache memory bucket"]
MAX_TOKENS = 12
ENV = {"HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
SENDER = (0, 0)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2, write_tiny_qwen2_variant

    base = build_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return base, write_tiny_qwen2_variant(base, base.parent / "tiny-seed1", seed=1)


@pytest.fixture(scope="module")
def engine(ray_cluster: dict[str, float], models: tuple[Path, Path]) -> Iterator[Any]:
    from rlix_plugins.vllm import CPU_WORKER_CLS
    from rlix_plugins.vllm.engine_actor import RlixEngineActor

    kwargs = {"model": str(models[0]), "dtype": "bfloat16", "max_model_len": 128, "max_num_seqs": 8,
              "enforce_eager": True, "seed": 0, "kv_cache_memory_bytes": 64 << 20, "worker_cls": CPU_WORKER_CLS}
    actor = ray.remote(num_cpus=0)(RlixEngineActor).options(runtime_env={"env_vars": ENV}).remote(
        kwargs, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
    ray.get(actor.pid.remote(), timeout=300)
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def ranks(ray_cluster: dict[str, float], models: tuple[Path, Path]) -> Iterator[list[Any]]:
    """The FSDP2 ranks, on the variant weights."""
    port = free_port()
    cls = ray.remote(num_cpus=0)(FsdpRankActor).options(runtime_env={"env_vars": ENV})
    actors = [cls.remote(r, port, str(models[1])) for r in range(WORLD)]
    ray.get([a.__ray_ready__.remote() for a in actors], timeout=300)
    yield actors
    for a in actors:
        ray.kill(a)


def _greedy(engine: Any) -> list[list[int]]:
    return ray.get(engine.generate_greedy.remote(PROMPTS, MAX_TOKENS), timeout=120)  # type: ignore[no-any-return]


def test_dtensor_cache_synced_into_vllm_matches_an_engine_on_the_same_weights(
        engine: Any, ranks: list[Any], models: tuple[Path, Path]) -> None:
    from rlix_plugins.vllm.driver import RayEngineRpc

    reference = _greedy(engine)  # the engine loaded the base weights itself
    source = PolicyWeightSource(ranks, SENDER, BUCKET_BYTES, "dtensor")
    rpc = RayEngineRpc(engine)

    assert source.build_cache(1, 120.0) == 1
    first = source.sync({0: (rpc, [SENDER])}, 60.0, verify=True)  # same device: cpu_serialize
    assert first.version == 1 and first.ipc_dp_ranks == (0,) and first.verified
    assert _greedy(engine) != reference  # the variant weights are serving

    # The runtime's offload and the next step's start (NemoRuntime._offload / before_training).
    source.mark_offloaded(True)
    source.release_comm_groups(60.0)
    with pytest.raises(Exception, match="before_weight_sync"):
        source.build_cache(2, 60.0)
    source.restore_comm_groups(60.0)
    source.mark_offloaded(False)
    losses = ray.get([r.train_step.remote() for r in ranks], timeout=120)  # FSDP2's groups survived the release
    assert losses[0] == losses[1]

    ray.get([r.load_weights.remote(str(models[0])) for r in ranks], timeout=120)
    assert source.build_cache(2, 120.0) == 2
    second = source.sync({0: (rpc, [(0, 1)])}, 60.0, verify=True)  # another device: gloo broadcast group
    assert second.version == 2 and second.broadcast_dp_ranks == (0,) and second.verified
    assert _greedy(engine) == reference  # token for token what the engine on these weights generated
