"""Expand benchmark: a rollout rank's expand (wake + weight sync + finalize + verify) against wake alone, on a
real vLLM engine, with every number a ratio against its raw primitive measured in the same run.

For each model shape (Qwen2.5-0.5B and -1.5B shaped, ``load_format="dummy"``) and sleep level (1, 2):

* ``wake_only_s``: ``sleep(level)`` then ``wake_up()`` (level 1 restores the weights from vLLM's CPU copy);
* ``expand_s``: ``sleep(level)`` then what the resizer does - level 1: drop vLLM's CPU copy of the weights
  (a sync overwrites them); ``wake_up(["weights"])``; sync from the CPU bucket cache with
  ``wake_tags=["kv_cache"]`` (``host_pull``: the engine's worker queues copies from the sender's pinned pages
  straight into the parameters, the KV cache wakes while they run, then finalize and verify - every time);
  ``expand_over_wake`` is the ratio the target is set on;
* ``expand_over_wake_then_raw_copy``: expand over the wake plus a raw copy of the same bytes at the bandwidth the
  engine's worker measured right after a wake (``copy_after_wake_levelN_GBps``: for 0.1-0.3 s after a wake
  copy-engine host->device copies run at about half the link, the driver's work on the memory the wake mapped
  sharing the copy engines; ``..._sm_reads``: the same bytes read by a copy kernel, as an expand's host_pull does),
  the floor of any sync into a woken engine;
* ``--serve`` (0.5 s): the engine runs that long after each wake before it sleeps again, before the wake alone and
  before the expand alike (a rank serves between an expand and the next shrink);
* ``*_settled_1s`` (``--settle``): the resizer's expand with 1 s between the sleep and the wake (a training step
  sits between a shrink and the next expand); ``copy_after_wake_level2_by_sleep_gap_GBps``: the post-wake copy by
  that gap;
* ``load_vs_raw_h2d``: weight bytes per second into an awake engine during a sync (send to verified, finalize
  included; ``awake_sync``) over a raw pinned host->device copy of the same bytes in this process;
* the same sync by ``cuda_ipc`` (the previous path: sender GPU staging + IPC handle per bucket) for comparison;
* ``first_sync_s`` vs a warm sync on a fresh engine (what a pipeline's first expand pays).

Greedy output after every expand must equal the output after the first sync (the weights are right).

Usage (GPU machine, vLLM kit): ``python benchmarks/expand.py [--shapes 0.5b 1.5b] [--repeats 3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")  # this process uses CUDA (the sender)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # the copy probe is a function sent to the worker
os.environ.setdefault("RLIX_CONTROL_PLANE", "rlix")  # as in production: EngineCore resets the prefix cache in the finish call

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "0.5b": {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
             "num_key_value_heads": 2},
    "1.5b": {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12,
             "num_key_value_heads": 2},
}
PROMPTS = ["the model weight", "sleep wake gpu", "hello world token", "fast slow update"]
BUCKET_BYTES = 512 << 20
SLEEP_GAPS_S = (0.0, 0.1, 0.25, 0.5, 1.0, 2.0)


def progress(msg: str) -> None:
    print(f"[expand-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def emit(result: dict[str, Any], path: str | None) -> int:
    """Print the result as JSON and write it to ``path`` (if given); the exit code."""
    text = json.dumps(result, indent=1)
    if path:
        Path(path).write_text(text)
    print(text)
    return 0


def model_dir(root: Path, shape: str) -> Path:
    """A Qwen2.5-shaped config (dummy weights) with the tiny model's locally trained tokenizer."""
    from transformers import Qwen2Config

    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    tiny = build_tiny_qwen2(root / "tiny", seed=0) if not (root / "tiny").exists() else root / "tiny"
    out = root / f"qwen2p5-{shape}"
    out.mkdir(exist_ok=True)
    base = Qwen2Config.from_pretrained(str(tiny))
    fields: dict[str, Any] = {
        "vocab_size": 151936, "head_dim": 128 if shape == "1.5b" else 64, "max_position_embeddings": 4096,
        "tie_word_embeddings": True, "eos_token_id": base.eos_token_id, "bos_token_id": base.bos_token_id,
        "rope_theta": 10000.0, "torch_dtype": "bfloat16", **SHAPES[shape],
    }
    Qwen2Config(**fields).save_pretrained(str(out))
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def random_weights(path: Path) -> dict[str, torch.Tensor]:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config.from_pretrained(str(path))
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in Qwen2ForCausalLM(cfg).named_parameters()}
    shapes.pop("lm_head.weight", None)  # tied
    gen = torch.Generator(device="cuda:0").manual_seed(0)
    return {n: (torch.randn(s, generator=gen, device="cuda:0") * 0.02).to(torch.bfloat16) for n, s in shapes.items()}


def raw_h2d_s(nbytes: int, repeats: int) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
    best = float("inf")
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def best_gpu_seconds(fn: Any, runs: int) -> float:
    """The fastest of ``runs`` calls of ``fn``, each timed on the GPU with CUDA events (the device idle before)."""
    best = float("inf")
    for _ in range(runs):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1000)
    return best


def copy_probe(worker: Any, payload: dict[str, Any], repeats: int, scratch_only: bool = False,
               kept: bool = False, sm: bool = False) -> dict[str, Any]:
    """Runs inside the engine's worker (``collective_rpc`` with a function): where host_pull's copies lose speed.
    The cache's pages copied, with CUDA events, (a) into one fresh device buffer in bucket order (``kept``: into
    the buffer :func:`_keep_buffer` allocated earlier; ``sm``: read by a copy kernel through the pages' device
    address instead of a copy engine), (b) into the parameters as a direct sync does (no checksums, no finalize),
    by a copy engine and (``params_sm_GBps``) by the SMs as an expand does, (c) (a) again; best of ``repeats``."""
    from rlix_plugins.transport import device_view, open_host_pull
    from rlix_plugins.vllm.receive_state import layout_key

    opened = open_host_pull(payload, pin=True)
    total = sum(m.used_bytes for m, _ in opened)
    state = worker._rlix()
    direct = [state.layouts.direct.get(layout_key(m)) for m, _ in opened]
    scratch = worker._rlix_kept[:total] if kept else torch.empty(total, dtype=torch.uint8, device=worker.device)

    def timed(fn: Any) -> float:
        return best_gpu_seconds(fn, repeats)

    def to_scratch() -> None:
        at = 0
        for meta, host in opened:
            if sm:
                torch._foreach_copy_([scratch[at : at + meta.used_bytes]], [device_view(host, worker.device)])
            else:
                scratch[at : at + meta.used_bytes].copy_(host, non_blocking=True)
            at += meta.used_bytes

    def to_params() -> None:
        dsts = [d for layout in direct if layout for d, _, _ in layout.copies]
        srcs = [host[lo:hi] for (_, host), layout in zip(opened, direct, strict=True) if layout for _, lo, hi in layout.copies]
        torch._foreach_copy_(dsts, srcs, non_blocking=True)

    out = {"bytes": total, "scratch_GBps": total / timed(to_scratch) / 1e9}
    if scratch_only:
        return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}
    if all(direct):
        out["params_GBps"] = total / timed(to_params) / 1e9

        def to_params_sm() -> None:
            for (_, host), layout in zip(opened, direct, strict=True):
                torch._foreach_copy_(*layout.word_copies(device_view(host, worker.device)), non_blocking=True)
        out["params_sm_GBps"] = total / timed(to_params_sm) / 1e9
    out["scratch_again_GBps"] = total / timed(to_scratch) / 1e9
    return {k: round(v, 1) if isinstance(v, float) else v for k, v in out.items()}


def engine(path: Path) -> Any:
    """The benchmarks' engine: dummy weights of ``path``'s shape, sleep mode, our receiver, 45% of the GPU."""
    from vllm import LLM

    from rlix_plugins.vllm import EXTENSION_CLS

    return LLM(model=str(path), dtype="bfloat16", max_model_len=512, enforce_eager=True, seed=0, load_format="dummy",
               gpu_memory_utilization=0.45, enable_sleep_mode=True, worker_extension_cls=EXTENSION_CLS)


def engine_and_cache(root: Path, shape: str) -> tuple[Any, Any]:
    """A ``shape`` :func:`engine` and a pinned bucket cache of random weights of that shape (version 1)."""
    from rlix_plugins.transport import VersionedBucketCache

    path = model_dir(root, shape)
    cache = VersionedBucketCache(BUCKET_BYTES)
    cache.build(1, sorted(random_weights(path).items()))
    torch.cuda.empty_cache()
    return engine(path), cache


def greedy(llm: Any) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _profiler_start(worker: Any) -> bool:
    """In the engine's worker (``collective_rpc``): start a torch profiler that outlives this call."""
    from torch.profiler import ProfilerActivity, profile

    worker._rlix_wake_profiler = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
    worker._rlix_wake_profiler.start()
    return True


def _profiler_stop(worker: Any, out: str, shape: str) -> str:
    """In the engine's worker: stop the profiler; write its Chrome trace and a table sorted by CUDA time."""
    prof = worker._rlix_wake_profiler
    prof.stop()
    prof.export_chrome_trace(str(Path(out) / f"wake_{shape}.trace.json"))
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
    (Path(out) / f"wake_{shape}.txt").write_text(table)
    return table


def _keep_buffer(worker: Any, nbytes: int) -> bool:
    """In the engine's worker: a device buffer allocated now and kept (outside vLLM's sleep pool)."""
    worker._rlix_kept = torch.empty(nbytes, dtype=torch.uint8, device=worker.device)
    worker._rlix_kept.fill_(0)
    torch.cuda.synchronize()
    return True


def _before_copies(worker: Any, what: str) -> None:
    """One step of vLLM's wake on its own (``copy_series(before=...)``)."""
    import gc

    if what == "gc":
        gc.collect()
    elif what == "empty_cache":
        torch.accelerator.empty_cache()
    elif what == "free_1GiB":  # a cached block handed back to the driver (cudaFree)
        block = torch.empty(1 << 30, dtype=torch.uint8, device=worker.device)
        del block
        torch.accelerator.empty_cache()
    elif what == "synchronize":
        torch.accelerator.synchronize()
    elif what:
        raise ValueError(what)


def _wake_without_empty_cache(worker: Any, on: bool) -> bool:
    """In the engine's worker: make ``torch.accelerator.empty_cache`` a no-op (``on``) or restore it - vLLM's
    allocator calls it at the start of every wake."""
    if on:
        worker._rlix_empty_cache = torch.accelerator.empty_cache
        torch.accelerator.empty_cache = lambda: None
    else:
        torch.accelerator.empty_cache = worker._rlix_empty_cache
    return True


def copy_series(worker: Any, payload: dict[str, Any], seconds: float, wait: float = 0.0,
                streams: int = 1, before: str = "") -> list[tuple[float, float, float]]:
    """In the engine's worker: after ``before`` (:func:`_before_copies`) and ``wait`` seconds, back-to-back 64 MiB
    copies from the cache's pinned pages into a buffer kept from before the sleep for ``seconds``, each split over
    ``streams`` side streams: (seconds since the call, GB/s, ms the host took to queue the copy between its two
    events) each."""
    from rlix_plugins.transport import open_host_pull

    _before_copies(worker, before)

    chunk = 64 << 20
    part = chunk // streams
    pages = [host for _, host in open_host_pull(payload, pin=True)]
    chunks = [p[i:i + chunk] for p in pages for i in range(0, p.numel() - chunk + 1, chunk)]
    dst = worker._rlix_kept[:chunk]
    side = [torch.cuda.Stream() for _ in range(streams)]
    start = time.perf_counter()
    time.sleep(wait)
    out, i = [], 0
    while time.perf_counter() - start < wait + seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t_host = time.perf_counter()
        a.record()
        src = chunks[i % len(chunks)]
        for k, stream in enumerate(side):
            stream.wait_event(a)
            with torch.cuda.stream(stream):
                dst[k * part:(k + 1) * part].copy_(src[k * part:(k + 1) * part], non_blocking=True)
            torch.cuda.current_stream().wait_stream(stream)
        b.record()
        enqueue_ms = (time.perf_counter() - t_host) * 1e3  # host time between the events: in the GPU's time too
        b.synchronize()
        out.append((round(time.perf_counter() - start, 4), round(chunk / (a.elapsed_time(b) / 1e3) / 1e9, 1),
                    round(enqueue_ms, 3)))
        i += 1
    return out


def _windows(points: list[tuple[float, float, float]]) -> dict[str, float]:
    def mean(lo: float, hi: float) -> float:
        xs = [g for t, g, _ in points if lo <= t < hi]
        return round(sum(xs) / len(xs), 1) if xs else 0.0
    t0 = points[0][0] if points else 0.0
    return {f"{lo}-{hi}s": mean(t0 + lo, t0 + hi) for lo, hi in ((0, 0.1), (0.1, 0.2), (0.2, 0.4), (0.4, 0.7), (0.7, 1.0),
                                                              (1.0, 1.5))}


def thread_stacks(worker: Any, seconds: float = 0.2, every: float = 0.005) -> list[tuple[str, int]]:
    """In the engine's worker: what every other thread of the process runs, sampled every ``every`` s for
    ``seconds`` (``sys._current_frames``): the most frequent (thread, innermost frames) with their sample counts."""
    import collections
    import threading

    names = {t.ident: t.name for t in threading.enumerate()}
    me = threading.get_ident()
    seen: collections.Counter[str] = collections.Counter()
    stop = time.perf_counter() + seconds
    while time.perf_counter() < stop:
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            where: list[str] = []
            f: Any = frame
            while f is not None and len(where) < 3:
                where.append(f"{Path(f.f_code.co_filename).name}:{f.f_lineno}:{f.f_code.co_name}")
                f = f.f_back
            seen[f"{names.get(ident, ident)} | {' < '.join(where)}"] += 1
        time.sleep(every)
    return seen.most_common(12)


def wake_series(llm: Any, payload: dict[str, Any]) -> dict[str, Any]:
    """64 MiB copy speed over 1.5 s after several kinds of wake (each after a level-2 sleep): which part of a wake
    slows copies, and whether time or traffic ends it."""
    cases: dict[str, Any] = {}
    for name, tags, wait, streams in (("no sleep", None, 0.0, 1), ("no sleep, 2 streams", None, 0.0, 2),
                                      ("full wake", None, 0.0, 1), ("weights only", ["weights"], 0.0, 1),
                                      ("full wake, 2 streams", None, 0.0, 2), ("full wake, 4 streams", None, 0.0, 4),
                                      ("full wake, copies 0.5 s later", None, 0.5, 1),
                                      ("no sleep: gc.collect()", None, 0.0, 1),
                                      ("no sleep: empty_cache()", None, 0.0, 1),
                                      ("no sleep: free 1 GiB + empty_cache()", None, 0.0, 1),
                                      ("no sleep: synchronize()", None, 0.0, 1),
                                      ("full wake without its empty_cache()", None, 0.0, 1)):
        before = {"gc.collect()": "gc", "empty_cache()": "empty_cache", "free 1 GiB + empty_cache()": "free_1GiB",
                  "synchronize()": "synchronize"}.get(name.partition(": ")[2], "")
        if not name.startswith("no sleep"):
            llm.sleep(level=2)
            patched = "without its empty_cache" in name
            if patched:
                llm.collective_rpc(_wake_without_empty_cache, args=(True,))
            llm.wake_up(tags=tags)
            if patched:
                llm.collective_rpc(_wake_without_empty_cache, args=(False,))
        points = llm.collective_rpc(copy_series, args=(payload, 1.5, wait, streams, before))[0]
        if tags is not None:  # vLLM maps a tag again if asked to wake it twice: wake only the one still asleep
            llm.wake_up(tags=[t for t in ("weights", "kv_cache") if t not in tags])
        cases[name] = {"windows_GBps": _windows(points), "first_12": points[:12]}
        progress(f"after '{name}': {cases[name]['windows_GBps']} first: {points[:12]}")
    return cases


def trace_wake(llm: Any, payload: dict[str, Any], out: Path, shape: str) -> dict[str, Any]:
    """torch-profile, inside the engine's worker, a level-2 wake and the raw copies right after it and 0.5 s later:
    which GPU work runs while a freshly woken engine's copies are slow (trace + table in ``out``). Then two more
    level-2 wakes, each followed at once by a copy into a buffer allocated before the sleep or into a fresh one:
    whether the destination's freshness or the time since the wake makes the copy slow."""
    llm.sleep(level=2)
    llm.collective_rpc(_profiler_start)
    llm.wake_up()
    now = llm.collective_rpc(copy_probe, args=(payload, 1, True))[0]["scratch_GBps"]
    time.sleep(0.5)
    later = llm.collective_rpc(copy_probe, args=(payload, 1, True))[0]["scratch_GBps"]
    progress(f"{shape} traced wake: copy {now} GB/s at once, {later} GB/s 0.5 s later")
    print(llm.collective_rpc(_profiler_stop, args=(str(out), shape))[0])
    nbytes = sum(b["meta"]["used_bytes"] for b in payload["buckets"])
    llm.collective_rpc(_keep_buffer, args=(nbytes,))
    result: dict[str, Any] = {"traced_at_once_GBps": now, "traced_after_0.5s_GBps": later}
    for attempt in range(2):
        llm.sleep(level=2)
        llm.wake_up()
        result[f"kept_buffer_at_once_GBps_{attempt}"] = llm.collective_rpc(copy_probe, args=(payload, 1, True, True))[0][
            "scratch_GBps"]
        llm.sleep(level=2)
        llm.wake_up()
        result[f"fresh_buffer_at_once_GBps_{attempt}"] = llm.collective_rpc(copy_probe, args=(payload, 1, True))[0][
            "scratch_GBps"]
    progress(f"{shape} right after a level-2 wake: {result}")
    result["copy_series_after_wakes"] = wake_series(llm, payload)
    result["threads_idle"] = llm.collective_rpc(thread_stacks)[0]
    llm.sleep(level=2)
    llm.wake_up()
    result["threads_after_wake"] = llm.collective_rpc(thread_stacks)[0]
    progress(f"threads right after a wake: {result['threads_after_wake']}")
    return result


class TimedRpc:
    """:class:`~rlix_plugins.vllm.driver.LLMEngineRpc`'s calls, each logged: (what, submitted, started, done) on this
    process's ``perf_counter`` - where a sync's time goes outside the worker (queueing, round trips, the driver's
    own work)."""

    def __init__(self, llm: Any, rpc_timeout_s: float = 300.0) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self.llm, self.rpc_timeout_s = llm, rpc_timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rlix-engine-rpc")
        self.log: list[tuple[str, float, float, float]] = []

    def _timed(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        submitted = time.perf_counter()

        def run() -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.log.append((what, submitted, started, time.perf_counter()))
        return self._pool.submit(run)

    def call(self, method: str, args: tuple[Any, ...]) -> Any:
        return self._timed(method, self.llm.collective_rpc, method, timeout=self.rpc_timeout_s, args=args)

    def reset_prefix_cache(self) -> Any:
        return self._timed("reset_prefix_cache", self.llm.reset_prefix_cache)

    def wake_up(self, tags: list[str]) -> Any:
        return self._timed("wake_up", self.llm.wake_up, tags=tags)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def rpc_timeline(log: list[tuple[str, float, float, float]], t0: float, t1: float) -> list[Any]:
    """A sync's engine calls in ms from its start: [what, submitted, started, done], then the sync's end."""
    ms = [[what, *(round((t - t0) * 1e3, 2) for t in times)] for what, *times in log if t0 <= times[0] <= t1]
    return [*ms, ["sync returned", round((t1 - t0) * 1e3, 2)]]


def bench_shape(shape: str, root: Path, repeats: int, wake_trace: Path | None = None,
                settle: float = 0.0, serve: float = 0.0) -> dict[str, Any]:
    from rlix_plugins.transport import VersionedBucketCache, build_comm_plan
    from rlix_plugins.vllm.driver import sync_engines

    path = model_dir(root, shape)
    weights = random_weights(path)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    cache = VersionedBucketCache(BUCKET_BYTES)
    t0 = time.perf_counter()
    cache.build(1, sorted(weights.items()))
    first_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    cache.build(2, sorted(weights.items()))
    rebuild = time.perf_counter() - t0
    del weights
    torch.cuda.empty_cache()
    raw = raw_h2d_s(nbytes, repeats)
    row: dict[str, Any] = {"weights_gib": round(nbytes / 2**30, 3), "buckets": cache.num_buffers,
                           "raw_h2d_GBps": round(nbytes / raw / 1e9, 1), "cache_first_build_s": round(first_build, 3),
                           "cache_rebuild_s(checksums on GPU)": round(rebuild, 3)}
    progress(f"{shape}: starting the engine")
    llm = engine(path)
    rpc = {0: TimedRpc(llm)}
    plans = {t: build_comm_plan((0, 0), {0: [(0, 0)]}, t) for t in ("host_pull", "cuda_ipc")}

    def sync(transport: str, wake_tags: list[str] | None = None) -> Any:
        return sync_engines(cache, plans[transport], rpc, staging_device="cuda:0", timeout_s=120, verify=True,
                            wake_tags=wake_tags)

    try:
        t0 = time.perf_counter()
        first = sync("host_pull")
        row["first_sync_s"] = round(time.perf_counter() - t0, 3)
        t0 = time.perf_counter()
        sync("host_pull")
        row["warm_sync_s"] = round(time.perf_counter() - t0, 3)
        row["first_over_warm_sync"] = round(row["first_sync_s"] / row["warm_sync_s"], 2)
        assert first.verified, "the first sync was not verified"
        ref = greedy(llm)
        from rlix_plugins.transport import make_host_pull_payload

        with cache.read() as snap:  # raw copies from the cache's own pages, inside the engine's worker
            row["engine_copy_probe"] = llm.collective_rpc(copy_probe, args=(make_host_pull_payload(list(snap.buckets)),
                                                                               repeats))[0]
            payload = make_host_pull_payload(list(snap.buckets))
        progress(f"{shape} copy probe in the engine: {row['engine_copy_probe']}")
        # the same copy right after a wake, and half a second later: what a freshly woken GPU gives a copy
        for level in (1, 2):
            for sm in (False, True):
                llm.sleep(level=level)
                llm.wake_up()
                now = llm.collective_rpc(copy_probe, args=(payload, 1, True, False, sm))[0]["scratch_GBps"]
                time.sleep(0.5)
                later = llm.collective_rpc(copy_probe, args=(payload, 1, True, False, sm))[0]["scratch_GBps"]
                key = f"copy_after_wake_level{level}_GBps" + ("_sm_reads" if sm else "")
                row[key] = {"at_once": now, "after_0.5s": later}
                progress(f"{shape} {key}: {now} GB/s at once, {later} GB/s 0.5 s later")
        # the same copy right after a level-2 wake, by the time between the sleep and the wake: a sleep hands ~40 GB
        # back to the driver, and if the driver's work on freed memory is what slows copies, a gap fixes it
        row["copy_after_wake_level2_by_sleep_gap_GBps"] = gaps = {}
        for gap in SLEEP_GAPS_S:
            llm.sleep(level=2)
            time.sleep(gap)
            llm.wake_up()
            gaps[str(gap)] = llm.collective_rpc(copy_probe, args=(payload, 1, True))[0]["scratch_GBps"]
        progress(f"{shape} copy right after a level-2 wake, by seconds between sleep and wake: {gaps}")
        if wake_trace is not None:
            row["wake_trace"] = trace_wake(llm, payload, wake_trace, shape)
            return row
        sync("host_pull")  # level 2 dropped the weights
        sync("cuda_ipc")  # warm the previous path too (staging, IPC open)
        for transport in ("host_pull", "cuda_ipc"):
            took = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                last = sync(transport)
                took.append(time.perf_counter() - t0)
            s = statistics.median(took)
            row[f"{transport}_awake_sync"] = {
                "sync_s": round(s, 4), "load_GBps": round(nbytes / s / 1e9, 1), "load_vs_raw_h2d": round(raw / s, 2),
                "receiver": llm.collective_rpc("rlix_receiver_info")[0]["timing"],
                "last_sync_engine_calls_ms": rpc_timeline(rpc[0].log, t0, t0 + took[-1]),
                "last_sync_finish_results": last.transport.finished}
            progress(f"{shape} {transport} awake sync: {row[f'{transport}_awake_sync']}")
        # overlap: what the resizer does (weights woken, the KV cache woken while the bytes move); sequential: the
        # whole engine woken first, then the sync (the comparison that says whether the overlap pays here).
        # serve: seconds an engine runs between a wake and the next sleep, before the wake alone and before the
        # expand alike (a rank serves rollouts before it is shrunk; the driver's work on the memory the previous wake
        # mapped - copy engines busy for ~0.25 s - must not fall on one of the two measurements and not the other).
        # settle: seconds between the sleep and the wake. 0 is a sleep followed at once by a wake (one rank's GPU
        # handed straight to another pipeline's rollout); in a training handover the training step sits between.
        modes = [("host_pull", "overlap", 0.0), ("host_pull", "sequential", 0.0), ("cuda_ipc", "overlap", 0.0)]
        if settle:
            modes.append(("host_pull", "overlap", settle))
        for transport, mode, gap in modes:
            for level in (1, 2):
                wake, expand, load, parts = [], [], [], []
                for _ in range(repeats):
                    time.sleep(serve)
                    llm.sleep(level=level)
                    time.sleep(gap)
                    t0 = time.perf_counter()
                    llm.wake_up()
                    wake.append(time.perf_counter() - t0)
                    time.sleep(serve)
                    llm.sleep(level=level)
                    time.sleep(gap)
                    t0 = time.perf_counter()
                    if level == 1 and transport == "host_pull":
                        llm.collective_rpc("rlix_discard_weight_backup")
                    llm.wake_up(tags=["weights"] if mode == "overlap" else None)
                    t1 = time.perf_counter()
                    report = sync(transport, ["kv_cache"] if mode == "overlap" else None)
                    t2 = time.perf_counter()
                    expand.append(t2 - t0)
                    load.append(t2 - t1)
                    parts.append({"wake_weights_s": t1 - t0, "sync_with_kv_wake_s": t2 - t1,
                                  "transfer_and_kv_wake_s": report.transport.transfer_seconds,
                                  "finish_s(finalize+verify+prefix reset)": report.finalize_seconds,
                                  "separate_reset": bool(report.separate_reset_dp_ranks)})
                    parts[-1]["engine_calls_ms"] = rpc_timeline(rpc[0].log, t0, t2)
                    parts[-1]["receiver"] = llm.collective_rpc("rlix_receiver_info")[0]["timing"]
                    assert all(v for per in report.verified.values() for v in per), "an expand was not verified"
                    llm.reset_prefix_cache()
                    assert greedy(llm) == ref, f"{shape} level {level} {transport}: output differs after expand"
                w, e, s = statistics.median(wake), statistics.median(expand), statistics.median(load)
                best = min(range(repeats), key=lambda i: expand[i])
                name = f"{transport}_level{level}" + ("_sequential" if mode == "sequential" else "") + (
                    f"_settled_{gap:g}s" if gap else "")
                # the floor of any sync into a woken engine: the wake, then a raw copy at the bandwidth a woken GPU gives
                sm = transport == "host_pull" and mode == "overlap"  # an expand's copies read with the SMs
                after = row[f"copy_after_wake_level{level}_GBps" + ("_sm_reads" if sm else "")]["at_once"] if not gap \
                    else row["engine_copy_probe"]["scratch_GBps"]
                floor = w + nbytes / (after * 1e9)
                row[name] = {
                    "wake_only_s": round(w, 4), "expand_s": round(e, 4), "expand_over_wake": round(e / w, 2),
                    "expand_over_wake_then_raw_copy": round(e / floor, 2),
                    "sync_with_kv_wake_s": round(s, 4),
                    "best_expand_parts_s": {k: v if isinstance(v, (dict, list)) else round(v, 4) for k, v in parts[best].items()},
                }
                progress(f"{shape} {name}: {row[name]}")
    finally:
        rpc[0].close()
        shutdown = getattr(getattr(llm.llm_engine, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        cache.close()
        del llm
        torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["0.5b", "1.5b"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--profile-pull", type=int, default=5,
                        help="torch-profile the engine worker's N-th host_pull (0: off); table next to --json")
    parser.add_argument("--serve", type=float, default=0.5,
                        help="seconds between a wake and the next sleep (the wake alone and the expand alike)")
    parser.add_argument("--settle", type=float, default=1.0,
                        help="also measure the resizer's host_pull expand with this many seconds between sleep and "
                             "wake (0: off)")
    parser.add_argument("--trace-wake", default=None, metavar="DIR",
                        help="only: profile a level-2 wake and the copies after it (trace + table in DIR), then stop")
    args = parser.parse_args(argv)
    if args.profile_pull:
        os.environ["RLIX_PROFILE_PULL"] = str(args.profile_pull)  # the engine processes inherit it
        os.environ["RLIX_PROFILE_DIR"] = str(Path(args.json).parent if args.json else Path.cwd())
    if not torch.cuda.is_available():
        print("expand benchmark: needs a GPU and vLLM (see docs/gpu.md)", file=sys.stderr)
        return 2
    results: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                               "bucket_bytes": BUCKET_BYTES, "serve_s": args.serve, "settle_s": args.settle}
    with tempfile.TemporaryDirectory(prefix="rlix-expand-") as tmp:
        for shape in args.shapes:
            results[shape] = bench_shape(shape, Path(tmp), args.repeats,
                                         Path(args.trace_wake) if args.trace_wake else None, args.settle,
                                         args.serve)
            if args.json:  # after each shape: a later one may run out of time
                Path(args.json).write_text(json.dumps(results, indent=1))
    return emit(results, args.json)


if __name__ == "__main__":
    sys.exit(main())
