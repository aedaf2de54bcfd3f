"""The receiver on real GPUs (vLLM 0.25.1 on the device machine; ``pytest -m gpu tests/vllm``).

One GPU runs all but the NCCL test. That one needs 2 GPUs: NCCL cannot put two ranks of one group on one GPU,
so the broadcast sender stages on ``cuda:1`` while the engines run on ``cuda:0`` (vLLM's default device);
``cuda_ipc`` stages on ``cuda:0``.

Engines (module-scoped, default multiprocess engine, receiver as ``worker_extension_cls``):
``engine_a`` (dp 0) on the original weights, ``engine_f`` (dp 1) a fresh engine on the seed-1 weights
(the reference, and the second DP rank), ``engine_big`` a Qwen2.5-1.5B-shaped dummy-weight engine for the
expand timing. Measured numbers are printed and written to ``$OUT/vllm_gpu_results.json`` when ``OUT`` is set.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from rlix_vllm_helpers import MAX_TOKENS, PROMPTS, build_cache

from rlix_plugins.errors import RlixTimeoutError, TransportError, WeightVerificationError
from rlix_plugins.transport import build_comm_plan
from rlix_plugins.vllm import EXTENSION_CLS
from rlix_plugins.vllm.driver import EngineRpc, LLMEngineRpc, sync_engines

pytestmark = [pytest.mark.gpu, pytest.mark.vllm, pytest.mark.slow]

# This process uses CUDA itself (the sender): vLLM's forked engine processes could not re-initialize it.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")

ENGINE_GPU = (0, 0)
OTHER_GPU = (0, 1)
TIMEOUT_S = 120.0
RESULTS: dict[str, Any] = {}


def _record(key: str, value: Any) -> None:
    RESULTS[key] = value
    print(f"RESULT {key} = {value}")
    out = os.environ.get("OUT")
    if out:
        Path(out, "vllm_gpu_results.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def _engine(model: Path, util: float, **extra: Any) -> Any:
    from vllm import LLM

    t0 = time.perf_counter()
    old = os.environ.get("RLIX_CONTROL_PLANE")
    os.environ["RLIX_CONTROL_PLANE"] = "rlix"  # as in production: EngineCore resets the prefix cache in the finish call
    try:
        llm = LLM(model=str(model), dtype="bfloat16", max_model_len=256, enforce_eager=True, seed=0,
                  gpu_memory_utilization=util, enable_sleep_mode=True, worker_extension_cls=EXTENSION_CLS, **extra)
    finally:
        if old is None:
            os.environ.pop("RLIX_CONTROL_PLANE", None)
        else:
            os.environ["RLIX_CONTROL_PLANE"] = old
    _record(f"startup_s[{Path(model).name}]", round(time.perf_counter() - t0, 2))
    return llm


def _close(llm: Any) -> None:
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


@pytest.fixture(scope="module")
def gpus() -> int:
    import torch

    n = torch.cuda.device_count()
    if n < 1:
        pytest.skip("needs a GPU")
    return n


@pytest.fixture(scope="module")
def engines(gpus: int, tiny_model_dir: Path, variant_model_dir: Path) -> Iterator[dict[str, Any]]:
    a = _engine(tiny_model_dir, 0.2)
    f = _engine(variant_model_dir, 0.2)
    yield {"a": a, "f": f}
    _close(a)
    _close(f)


@pytest.fixture(scope="module")
def rpcs(engines: dict[str, Any]) -> Iterator[dict[int, EngineRpc]]:
    out = {0: LLMEngineRpc(engines["a"]), 1: LLMEngineRpc(engines["f"])}
    yield out
    for r in out.values():
        r.close()


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def baselines(engines: dict[str, Any]) -> dict[str, list[list[int]]]:
    return {"orig": greedy(engines["a"]), "seed1": greedy(engines["f"])}


def _sync(weights_or_cache: Any, targets: dict[int, list], rpcs: dict[int, EngineRpc], *, via: str,
          version: int = 0, **kw: Any) -> Any:
    cache = weights_or_cache if hasattr(weights_or_cache, "read") else build_cache(weights_or_cache, version)
    if via in ("cuda_ipc", "host_pull"):
        plan = build_comm_plan(ENGINE_GPU, targets, same_gpu_transport=via)
        staging = "cuda:0"
    elif via == "nccl":
        plan = build_comm_plan(OTHER_GPU, targets, same_gpu_transport="cuda_ipc")
        staging = "cuda:1"
    else:  # cpu_serialize into a GPU receiver
        plan = build_comm_plan(ENGINE_GPU, targets, same_gpu_transport="cpu_serialize")
        staging = "cpu"
    kw.setdefault("master_addr", "127.0.0.1")  # one machine, no Ray: the rendezvous address is given
    return sync_engines(cache, plan, rpcs, staging_device=staging, timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


def _info(rpc: EngineRpc) -> dict[str, Any]:
    return rpc.call("rlix_receiver_info", ()).result(timeout=60)[0]  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------------------------


def test_gpu_host_pull_sync_matches_fresh_engine(engines: dict, rpcs: dict, weight_sets: dict, baselines: dict) -> None:
    report = _sync(weight_sets["seed1"], {0: [ENGINE_GPU]}, rpcs, via="host_pull", version=3)
    assert report.transport.ipc_dp_ranks == (0,) and report.transport.group_name is None
    assert report.verified[0][0]["received"] == len(weight_sets["seed1"])
    assert greedy(engines["a"]) == baselines["seed1"]
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="host_pull", version=4)
    assert greedy(engines["a"]) == baselines["orig"]
    assert _info(rpcs[0])["dirty"] is False


def test_gpu_cuda_ipc_sync_matches_fresh_engine(engines: dict, rpcs: dict, weight_sets: dict, baselines: dict) -> None:
    assert _info(rpcs[0])["loader"] == "vllm_inplace" and _info(rpcs[0])["device"].startswith("cuda")
    assert baselines["orig"] != baselines["seed1"]
    report = _sync(weight_sets["seed1"], {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=1)
    assert report.transport.ipc_dp_ranks == (0,) and report.finalized_dp_ranks == (0,)
    assert report.verified[0][0]["received"] == len(weight_sets["seed1"])
    assert greedy(engines["a"]) == baselines["seed1"]  # identical to the fresh engine on these weights
    assert greedy(engines["f"]) == baselines["seed1"]  # dp 1 was not a target
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=2)
    assert greedy(engines["a"]) == baselines["orig"]
    _record("cuda_ipc_transfer_s", round(report.transport.transfer_seconds, 4))


class _CorruptBucket:
    def __init__(self, inner: EngineRpc, index: int) -> None:
        self.inner, self.index = inner, index

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "update_parameter_in_bucket" and args[0]["meta"]["index"] == self.index:
            payload = dict(args[0])
            data = bytearray(payload["data"])
            data[payload["meta"]["offsets"][-1]] ^= 0x01
            payload["data"] = bytes(data)
            args = (payload, *args[1:])
        return self.inner.call(method, args)

    def reset_prefix_cache(self) -> Any:
        return self.inner.reset_prefix_cache()


def test_gpu_verify_names_the_corrupted_parameter(engines: dict, rpcs: dict, weight_sets: dict,
                                                  baselines: dict) -> None:
    cache = build_cache(weight_sets["seed1"], 20)
    with cache.read() as snap:
        culprit = snap.buckets[1].meta.names[-1]
    with pytest.raises(WeightVerificationError, match=culprit.replace(".", r"\.")):
        _sync(cache, {0: [ENGINE_GPU]}, {0: _CorruptBucket(rpcs[0], 1)}, via="cpu_serialize")
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=21)
    assert greedy(engines["a"]) == baselines["orig"]


class _StallIpc:
    def __init__(self, inner: EngineRpc, index: int) -> None:
        self.inner, self.index = inner, index

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "update_parameter_in_bucket" and args[0]["meta"]["index"] >= self.index:
            return Future()
        return self.inner.call(method, args)

    def reset_prefix_cache(self) -> Any:
        return self.inner.reset_prefix_cache()


def test_gpu_timeout_staged_keeps_old_weights_eager_reports_dirty(engines: dict, rpcs: dict, weight_sets: dict,
                                                                  baselines: dict) -> None:
    with pytest.raises((RlixTimeoutError, TransportError)):
        _sync(weight_sets["seed1"], {0: [ENGINE_GPU]}, {0: _StallIpc(rpcs[0], 2)}, via="cuda_ipc",
              version=30, timeout_s=5.0, apply_mode="staged")
    assert greedy(engines["a"]) == baselines["orig"]
    assert not _info(rpcs[0])["dirty"]
    with pytest.raises((RlixTimeoutError, TransportError)):
        _sync(weight_sets["seed1"], {0: [ENGINE_GPU]}, {0: _StallIpc(rpcs[0], 2)}, via="cuda_ipc",
              version=31, timeout_s=5.0, apply_mode="eager")
    assert _info(rpcs[0])["dirty"]  # buckets 0-1 were loaded: the rank must not serve until re-synced
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=32)
    assert not _info(rpcs[0])["dirty"] and greedy(engines["a"]) == baselines["orig"]


@pytest.mark.parametrize("level", [1, 2])
def test_gpu_sleep_wake_sync_matches_fresh_engine(level: int, engines: dict, rpcs: dict, weight_sets: dict,
                                                  baselines: dict) -> None:
    llm = engines["a"]
    cache = build_cache(weight_sets["seed1"], 40 + level)
    llm.sleep(level=level)
    t0 = time.perf_counter()
    llm.wake_up(tags=["weights"])
    t1 = time.perf_counter()
    _sync(cache, {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", verify=False)
    t2 = time.perf_counter()
    llm.wake_up(tags=["kv_cache"])
    t3 = time.perf_counter()
    assert greedy(llm) == baselines["seed1"]
    _record(f"tiny_level{level}_expand_s", {"wake_weights": round(t1 - t0, 4), "sync_finalize": round(t2 - t1, 4),
                                           "wake_kv": round(t3 - t2, 4)})
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=50 + level)
    assert greedy(llm) == baselines["orig"]


def test_gpu_direct_pull_verifies_what_landed_and_a_failed_expand_sleeps(engines: dict, rpcs: dict,
                                                                        weight_sets: dict, baselines: dict) -> None:
    """host_pull straight into the parameters (a layout seen before): a byte flipped in the sender's host page after
    its checksums were taken is caught by verification, naming the parameter; the expand that failed still woke the
    KV cache (sync_engines(wake_tags)), so the rank goes back to sleep and frees its memory; a clean expand repairs it."""
    import torch

    llm = engines["a"]
    _sync(build_cache(weight_sets["seed1"], 60), {0: [ENGINE_GPU]}, rpcs, via="host_pull")
    assert _info(rpcs[0])["timing"].get("pull_direct_copies", 0) > 0, "the layout was not loaded directly"
    cache = build_cache(weight_sets["orig"], 61)
    with cache.read() as snap:
        bucket = snap.buckets[-1]
        culprit = bucket.meta.names[-1]
        bucket.payload[bucket.meta.offsets[-1]] ^= 1
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    with pytest.raises(WeightVerificationError, match=culprit.replace(".", r"\.")):
        _sync(cache, {0: [ENGINE_GPU]}, rpcs, via="host_pull", wake_tags=["kv_cache"])
    free = torch.cuda.mem_get_info()[0]
    llm.sleep(level=2)
    freed = torch.cuda.mem_get_info()[0] - free
    assert freed > 256 << 20, f"the rank did not go back to sleep after the failed expand (freed {freed} bytes)"
    llm.wake_up(tags=["weights"])
    _sync(weight_sets["orig"], {0: [ENGINE_GPU]}, rpcs, via="host_pull", version=62, wake_tags=["kv_cache"])
    assert greedy(llm) == baselines["orig"]


def test_gpu_expand_time_1p5b(gpus: int, tiny_model_dir: Path) -> None:
    """Qwen2.5-1.5B-shaped dummy engine: expand (wake + sync + finalize) vs wake alone, levels 1 and 2."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    big = tiny_model_dir.parent / "qwen2p5-1p5b-shape"
    big.mkdir(exist_ok=True)
    tiny = Qwen2Config.from_pretrained(str(tiny_model_dir))
    cfg = Qwen2Config(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                      num_attention_heads=12, num_key_value_heads=2, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=True, eos_token_id=tiny.eos_token_id, bos_token_id=tiny.bos_token_id,
                      rope_theta=10000.0, torch_dtype="bfloat16")
    cfg.save_pretrained(str(big))
    for f in tiny_model_dir.iterdir():
        if f.name.startswith(("tokenizer", "chat_template")):
            (big / f.name).write_bytes(f.read_bytes())
    with torch.device("meta"):
        shapes = {n: (tuple(p.shape), p.dtype) for n, p in Qwen2ForCausalLM(cfg).named_parameters()}
    shapes.pop("lm_head.weight", None)  # tied
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    weights = {n: (torch.randn(s, generator=gen, device="cuda:0", dtype=torch.float32) * 0.02).to(torch.bfloat16)
               for n, (s, _) in shapes.items()}
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    t0 = time.perf_counter()
    cache = build_cache(weights, 1, bucket_bytes=512 << 20)
    _record("big_cache_build_s", round(time.perf_counter() - t0, 2))
    del weights
    torch.cuda.empty_cache()
    llm = _engine(big, 0.45, load_format="dummy")
    rpc = {0: LLMEngineRpc(llm)}
    try:
        _sync(cache, {0: [ENGINE_GPU]}, rpc, via="host_pull", verify=False)  # warm-up (mapping, pinning, allocator)
        info = _info(rpc[0])  # the warm-up made every layout direct and built its checksum plan: none in an expand
        assert info["landed_plans"] == ["KernelChecksums"] * info["direct_layouts"] and info["direct_layouts"] > 0, info
        assert info["copy_plans"] == info["direct_layouts"], info  # and its SM copy plan, for the expands
        from vllm import SamplingParams

        ref = [list(o.outputs[0].token_ids) for o in
               llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)]
        for level in (1, 2):
            llm.sleep(level=level)
            t0 = time.perf_counter()
            llm.wake_up()
            wake_only = time.perf_counter() - t0
            llm.sleep(level=level)
            t0 = time.perf_counter()
            if level == 1:  # what the resizer does: the sync overwrites the weights, never restore the old ones
                llm.collective_rpc("rlix_discard_weight_backup")
            llm.wake_up(tags=["weights"])
            report = _sync(cache, {0: [ENGINE_GPU]}, rpc, via="host_pull", verify=True, wake_tags=["kv_cache"])
            expand = time.perf_counter() - t0
            timing = _info(rpc[0])["timing"]
            assert timing.get("pull_direct_copies", 0) > 0 and timing["pull_deferred"], timing
            assert timing["pull_sm_reads"], f"an expand read the pages with a copy engine: {timing}"
            assert timing["pull_copy_kernel_buckets"] == info["direct_layouts"], f"torch's copy, not the SM kernel: {timing}"
            assert timing["pull_checksum_kernel"], f"the checksum kernel failed its self-check: {timing}"
            assert report.separate_reset_dp_ranks == (), "EngineCore did not reset the prefix cache in the finish call"
            out = [list(o.outputs[0].token_ids) for o in
                   llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)]
            assert out == ref, f"level {level}: output after expand differs from the synced reference"
            _record(f"big_level{level}", {
                "weights_gib": round(nbytes / 2**30, 2), "buckets": report.transport.num_buckets,
                "wake_only_s": round(wake_only, 3), "expand_s": round(expand, 3),
                "expand_over_wake": round(expand / max(wake_only, 1e-6), 1),
                "sync_transfer_s": round(report.transport.transfer_seconds, 3),
                "finalize_s": round(report.finalize_seconds, 3),
                "gib_per_s": round(nbytes / 2**30 / max(report.transport.transfer_seconds, 1e-6), 1),
                "receiver": timing,
            })
    finally:
        rpc[0].close()
        _close(llm)


def test_gpu_zz_nccl_broadcast_several_syncs_two_ranks(gpus: int, engines: dict, rpcs: dict, weight_sets: dict,
                                                    baselines: dict) -> None:
    if gpus < 2:
        pytest.skip(f"needs 2 GPUs (NCCL broadcast sender and receiver on different GPUs), found {gpus}")
    seen = []
    for version, name in enumerate(["seed2", "orig", "seed1", "orig"], start=10):
        # overall deadline: NCCL communicator init blocks without honouring timeouts (it hung on the first
        # device run); runs last so a hang cannot take the other GPU results with it
        report = _sync(weight_sets[name], {0: [ENGINE_GPU]}, rpcs, via="nccl", version=version,
                       overall_timeout_s=90.0)
        assert report.transport.broadcast_dp_ranks == (0,)
        seen.append(greedy(engines["a"]))
    assert seen[0] not in (baselines["orig"], baselines["seed1"])
    assert seen[1] == seen[3] == baselines["orig"] and seen[2] == baselines["seed1"]
    # dp 1 shares cuda:0 with dp 0 (NCCL allows one rank per GPU): it takes the same weights by cuda_ipc
    _sync(weight_sets["seed2"], {1: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=14)
    assert greedy(engines["f"]) == seen[0] and greedy(engines["a"]) == baselines["orig"]
    _sync(weight_sets["seed1"], {1: [ENGINE_GPU]}, rpcs, via="cuda_ipc", version=15)
    assert greedy(engines["f"]) == baselines["seed1"]
    assert _info(rpcs[0])["groups"] == []
    # What a slept engine keeps, which every shrink checks against RuntimeConfig.post_sleep_max_bytes: one that has
    # received over NCCL (dp 0) keeps NCCL's state next to its CUDA context (a 1 GiB limit failed two healthy
    # pipelines on an H100), one that has not (dp 1) does not. Runs last: the engines stay asleep.
    from rlix_plugins.pipeline.config import RuntimeConfig
    from rlix_plugins.pipeline.gpu_memory import process_tree_gpu_bytes

    time.sleep(3)  # each sync's NCCL communicator is aborted on a background thread of the engine (~0.5 s)
    held = {}
    for label, dp, name in (("after_nccl", 0, "a"), ("without_nccl", 1, "f")):
        engines[name].sleep(level=2)
        held[label] = process_tree_gpu_bytes(_info(rpcs[dp])["pid"])
    _record("asleep_bytes", held)
    limit = RuntimeConfig().post_sleep_max_bytes
    assert limit is not None and all(b is not None and b <= limit for b in held.values()), (held, limit)
