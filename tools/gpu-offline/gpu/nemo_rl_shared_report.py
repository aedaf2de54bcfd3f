"""Summarise NeMo RL runs on the GPU machine (tools/gpu-offline/gpu_nemo_rl.sh, tools/gpu-offline/gpu_nemo_rl_scale.sh).

Reads DIR/console_<p>.log (one per driver, lines prefixed with a UNIX time), the rlix metrics NeMo RL's logger wrote
to tensorboard (DIR/logs_<p>/**/events.*: ``train/rlix/*``), and when present DIR/status.json, DIR/gpu_after.csv,
DIR/trace.jsonl (the scheduler's trace) and DIR/nvml*.csv (tools/gpu-offline/gpu/nvml_sampler.py: its per-process
``*_procs.csv`` gives each GPU process's peak); writes DIR/summary.json
plus a few lines: steps per pipeline, the steps phase (first step started -> last step's reward logged) and the
whole run, steps/hour over each, GPU busy share over the steps phase (NVML samples) and allocated share (trace),
GPU and host memory peaks, fairness (trace), the rlix figures, the GPU memory left after the drivers ended.

    python3 tools/gpu-offline/gpu/nemo_rl_shared_report.py DIR
"""

from __future__ import annotations

import glob
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

STEP = re.compile(r"^(\d+\.\d+) .*=+ Step (\d+)/(\d+) =+")
REWARD = re.compile(r"^(\d+\.\d+) .*Avg Reward: ([-\d.]+)")
STAMP = re.compile(r"^(\d+\.\d+) ")
# The SingleController logs a finished step as its own metrics line, then "train step N/M  trainer_v=V".
SC_METRICS = re.compile(r"^(\d+\.\d+) .*step_metrics=\{.*'reward': ([-\d.e]+|nan)")
SC_STEP = re.compile(r"^(\d+\.\d+) .*train step (\d+)/(\d+)\s+trainer_v=")
STEP_TIME = re.compile(r"^(\d+\.\d+) .*Total step time: ([\d.]+)s")
# NeMo RL's step timing: the seconds a step waited for its batch (async GRPO: the rollout not ready when training could start)
BATCH_WAIT = re.compile(r"^(\d+\.\d+) .*\bexposed_generation: ([\d.]+)s")


def console(path: Path) -> dict[str, Any]:
    steps: list[tuple[float, int]] = []
    rewards: list[float] = []
    reward_times: list[tuple[float, float]] = []
    step_times: list[float] = []
    batch_waits: list[float] = []
    sc_steps = 0
    first = last = None
    for line in path.read_text(errors="replace").splitlines():
        m = STAMP.match(line)
        if not m:
            continue
        t = float(m.group(1))
        first = t if first is None else first
        last = t
        if s := STEP.match(line):
            steps.append((t, int(s.group(2))))
        elif r := REWARD.match(line) or SC_METRICS.match(line):
            rewards.append(float(r.group(2)))
            reward_times.append((t, float(r.group(2))))
        elif s := SC_STEP.match(line):
            sc_steps += 1
        elif s := STEP_TIME.match(line):
            step_times.append(float(s.group(2)))
        elif s := BATCH_WAIT.match(line):
            batch_waits.append(float(s.group(2)))
    return {"started": first, "ended": last, "step_starts": steps, "rewards": rewards, "reward_times": reward_times,
            "step_times_s": step_times, "batch_waits_s": batch_waits, "steps_done": max(len(rewards), sc_steps)}


def rlix_metrics(logdir: Path) -> dict[str, list[float]]:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return {}
    out: dict[str, list[float]] = {}
    for events in glob.glob(str(logdir / "**" / "events.*"), recursive=True):
        acc = EventAccumulator(events)
        acc.Reload()
        for tag in acc.Tags().get("scalars", []):
            if "rlix/" in tag:
                out.setdefault(tag, []).extend(e.value for e in acc.Scalars(tag))
    return out


def samples(path: Path) -> list[dict[str, float]]:
    """Rows of an nvml_sampler CSV."""
    lines = path.read_text().splitlines()
    head = lines[0].split(",")
    return [dict(zip(head, map(float, line.split(",")), strict=True)) for line in lines[1:] if line.count(",") ==
            len(head) - 1]


def process_peaks(path: Path) -> list[dict[str, Any]]:
    """Each GPU process's largest reading in an nvml_sampler ``*_procs.csv`` (GPU, pid, GiB, when, and the title it
    carried most often other than an idle Ray worker's), largest first per GPU."""
    peaks: dict[tuple[int, int], dict[str, Any]] = {}
    titles: dict[tuple[int, int], Counter[str]] = {}
    for line in path.read_text().splitlines()[1:]:
        parts = line.split(",", 4)
        if len(parts) != 5:
            continue
        t, gpu, pid, used, name = float(parts[0]), int(parts[1]), int(parts[2]), int(parts[3]), parts[4]
        key = (gpu, pid)
        titles.setdefault(key, Counter())[name] += name != "ray::IDLE"
        if key not in peaks or used > peaks[key]["bytes"]:
            peaks[key] = {"gpu": gpu, "pid": pid, "bytes": used, "time": t}
    for key, peak in peaks.items():
        peak["gib"] = round(peak.pop("bytes") / 2**30, 2)
        peak["name"] = titles[key].most_common(1)[0][0]
    return sorted(peaks.values(), key=lambda p: (p["gpu"], -p["gib"]))


def sampled_gpus(rows: list[dict[str, float]]) -> list[int]:
    return sorted(int(k.removeprefix("util_")) for k in (rows[0] if rows else {}) if k.startswith("util_"))


def nvml_figures(rows: list[dict[str, float]], t0: float, t1: float) -> dict[str, Any]:
    """Busy share over [t0, t1] (mean NVML utilization) per GPU and over all of them, and the GPU (per GPU, largest)
    and host memory peaks of the whole run."""
    gpus = sampled_gpus(rows)
    inside = [r for r in rows if t0 <= r["time"] <= t1]
    busy = {g: sum(r[f"util_{g}"] for r in inside) / len(inside) / 100 if inside else float("nan") for g in gpus}
    peaks = {g: max((r[f"mem_{g}"] for r in rows), default=0) / 2**30 for g in gpus}
    return {"gpu_busy_share_steps_phase": sum(busy.values()) / len(busy) if busy else float("nan"),
            "gpu_busy_share_by_gpu": busy,
            "gpu_memory_peak_gib": max(peaks.values(), default=0.0), "gpu_memory_peak_gib_by_gpu": peaks,
            "host_memory_peak_gib": max((r["host_used"] for r in rows), default=0) / 2**30,
            "samples": len(inside)}


def phase_busy(spans: list[Any], rows: list[dict[str, float]], t0: float, t1: float,
               gpu: int = 0) -> dict[str, dict[str, float]]:
    """Seconds, mean NVML utilization and the most memory in use of ``gpu`` over [t0, t1] by what held it
    (``timeline.occupancy_spans`` of that GPU): start-up, training, rollout, both (a rollout next to a training
    step), no one. The memory is the whole GPU's (the asleep tenants' share included): what the scheduler's figures
    for that state, plus its tenants asleep, must cover."""
    names = {"init": "start-up", "rollout": "rollout"}
    out: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        if not t0 <= r["time"] <= t1:
            continue
        held = Counter(names.get(s.phase, "training") for s in spans if s.start <= r["time"] <= s.end)
        # "rollout + training": a rollout next to a training step; "2 x rollout": two pipelines' rollouts
        kind = " + ".join(k if n == 1 else f"{n} x {k}" for k, n in sorted(held.items())) or "no one"
        out.setdefault(kind, []).append((r[f"util_{gpu}"], r.get(f"mem_{gpu}", 0.0)))
    dt = (t1 - t0) / max(sum(len(v) for v in out.values()), 1)
    return {k: {"seconds": round(len(v) * dt, 1), "busy": round(sum(u for u, _ in v) / len(v) / 100, 3),
                "memory_max_gib": round(max(m for _, m in v) / 2**30, 1)} for k, v in out.items()}


def trace_figures(path: Path, t0: float, t1: float, rows: list[dict[str, float]] | None = None) -> dict[str, Any]:
    """Allocated share of each GPU over [t0, t1] (some cluster held it) and over all, fairness and, with NVML
    ``rows``, the busy share by what held each GPU, from the scheduler's trace."""
    from rlix_plugins.control.capacity.fairness import fairness
    from rlix_plugins.control.capacity.timeline import held_seconds, occupancy_spans, read_trace

    events = read_trace(path)
    events.sort(key=lambda e: e.time)
    # The trace names a GPU as the scheduler does, by its place among the GPUs its Ray cluster sees (0, 1, ...);
    # NVML's columns by the machine's index. A cluster on GPUs 2,3 traces them as 0,1.
    sampled = sampled_gpus(rows) if rows else []
    gpus = dict(enumerate(sampled)) if sampled else {g: g for g in sorted({g for e in events for g in e.gpus})}
    every = occupancy_spans(events)
    spans = {gpus[i]: [s for s in every if s.gpu == i] for i in gpus}
    shares = {g: held_seconds(spans[g], [i], t0, t1) / (t1 - t0) if t1 > t0 else float("nan") for i, g in gpus.items()}
    out: dict[str, Any] = {"gpu_allocated_share_steps_phase": sum(shares.values()) / len(shares) if shares else 0.0,
                           "gpu_allocated_share_by_gpu": shares, "fairness": fairness(events).as_dict()}
    if rows:
        out["busy_by_holder"] = {g: phase_busy(s, rows, t0, t1, g) for g, s in spans.items()}
    return out


def all_running(runs: dict[str, dict[str, Any]], t0: float, t_end: float,
                rows: list[dict[str, float]]) -> dict[str, float]:
    """The steps phase while every pipeline still runs, from t0 to the end of the first pipeline's last step: the
    steps done in it, a step in progress at its end counted by the share of its time that had passed, their rate
    and the GPU busy share. A run of a few steps each ends with pipelines that finish at different times, the last alone on the GPU;
    this is the figure of the time they all share it."""
    done = 0.0
    for r in runs.values():
        starts: dict[int, float] = {}
        for t, step in r.get("step_starts", ()):
            starts[int(step)] = min(t, starts.get(int(step), t))
        for (_, start), end in zip(sorted(starts.items()), r.get("step_ends", ()), strict=False):
            done += 1.0 if end <= t_end else max(t_end - start, 0.0) / (end - start)
    return {"seconds": t_end - t0, "steps": done, "steps_per_hour": done * 3600 / (t_end - t0),
            "gpu_busy_share": nvml_figures(rows, t0, t_end)["gpu_busy_share_steps_phase"]}


def against_alone(summary: dict[str, Any], alone: dict[str, Any], pipelines: int) -> str:
    """Together vs the same pipelines one after another, from one pipeline alone (its ``summary.json``): N identical
    pipelines in a row make the alone run's steps/hour, so the ratio is the two rates'; next to the ceiling that one
    pipeline's idle time allows (1 / its busy share), and never above N.

    Where that ceiling is 1 / busy and the pipelines share one GPU, the fraction of it reached splits exactly into
    the busy share together (the idle time left) times the GPU-busy seconds a step costs alone over what it costs
    together (how much slower a step's kernels run among the others'): the line says both."""
    busy = alone["nvml"]["gpu_busy_share_steps_phase"]
    ceiling = min(float(pipelines), 1 / busy)
    rate_alone, rate = alone["steps_per_hour_step_phase"], summary["steps_per_hour_step_phase"]
    phase = rate / rate_alone
    whole = summary["steps_per_hour_wall"] / alone["steps_per_hour_wall"]
    line = (f"against one pipeline alone ({rate_alone:.0f} steps/h over its steps phase, busy "
            f"{busy:.3f}): together / one after another {phase:.2f}x over the steps phase, {whole:.2f}x over the "
            f"whole run (one after another derived from the alone run); ceiling min({pipelines}, 1 / {busy:.3f}) = "
            f"{ceiling:.2f}x: {phase / ceiling:.2f} of it")
    nvml = summary.get("nvml") or {}
    if 1 / busy < pipelines and len(nvml.get("gpu_busy_share_by_gpu") or {}) == 1:
        busy_together = nvml["gpu_busy_share_steps_phase"]
        cost_alone, cost = busy * 3600 / rate_alone, busy_together * 3600 / rate
        line += (f" = busy together {busy_together:.3f} x GPU-busy s a step alone / together {cost_alone:.1f} / "
                 f"{cost:.1f}")
    if "all_running" in summary:
        every = summary["all_running"]["steps_per_hour"] / rate_alone
        line += f"; while every pipeline ran {every:.2f}x: {every / ceiling:.2f} of it"
    return line


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Summarise one GPU run's directory (report.txt's lines).")
    ap.add_argument("dir", type=Path)
    ap.add_argument("--alone", type=Path, default=None,
                    help="one pipeline alone's run directory (its summary.json): print together vs one after another")
    args = ap.parse_args()
    d = args.dir
    runs = {p.stem.removeprefix("console_"): console(p) for p in sorted(d.glob("console_*.log"))}
    for p, r in runs.items():
        r["rlix_metrics"] = rlix_metrics(d / f"logs_{p}")
        r["step_ends"] = reward_times = [t for t, _ in r.pop("reward_times", [])]
        r["steps_phase"] = [r["step_starts"][0][0], reward_times[-1]] if r["step_starts"] and reward_times else None
    phases = [r["steps_phase"] for r in runs.values() if r["steps_phase"]]
    begun = [r["started"] for r in runs.values() if r["started"]]
    ends = [r["ended"] for r in runs.values() if r["ended"]]
    steps = sum(r["steps_done"] for r in runs.values())
    summary: dict[str, Any] = {"pipelines": runs, "steps_total": steps}
    if phases and begun and ends:
        t0, t1 = min(p[0] for p in phases), max(p[1] for p in phases)
        wall = max(ends) - min(begun)
        summary.update(step_phase_s=t1 - t0, wall_s=wall, steps_per_hour_step_phase=steps * 3600 / (t1 - t0),
                       steps_per_hour_wall=steps * 3600 / wall)
        for csv in sorted(d.glob("nvml*.csv")):
            if csv.stem.endswith("_procs"):
                summary[csv.stem] = process_peaks(csv)
                continue
            rows = samples(csv)
            if len(runs) == 1 or csv.stem == "nvml":
                summary[csv.stem] = nvml_figures(rows, t0, t1)
            else:  # standalone: one sample file per driver, each over its own steps phase
                own = runs.get(csv.stem.removeprefix("nvml_"), {}).get("steps_phase")
                if own:
                    summary[csv.stem] = nvml_figures(rows, own[0], own[1])
        shared_rows = samples(d / "nvml.csv") if (d / "nvml.csv").exists() else None
        first_end = min(p[1] for p in phases)
        if len(phases) > 1 and max(p[0] for p in phases) < first_end and shared_rows is not None:
            # (pipelines at once: one after another, the first ends before the next begins)
            summary["all_running"] = all_running(runs, t0, first_end, shared_rows)
        if (d / "trace.jsonl").exists():
            summary.update(trace_figures(d / "trace.jsonl", t0, t1, shared_rows))
    gpu_after = (d / "gpu_after.csv").read_text() if (d / "gpu_after.csv").exists() else ""
    summary["gpu_after"] = gpu_after
    if (d / "status.json").exists():
        try:
            summary["status"] = json.loads((d / "status.json").read_text())
        except json.JSONDecodeError:
            summary["status"] = (d / "status.json").read_text()[-2000:]
    (d / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    for p, r in runs.items():
        m = r["rlix_metrics"]
        print(f"pipeline {p}: {r['steps_done']} steps, rewards {r['rewards']}, step times (NeMo RL's 'Total step "
              f"time') {[round(t, 1) for t in r['step_times_s']]} s")
        if r["batch_waits_s"]:
            print(f"  waits for its batch (NeMo RL's 'exposed_generation') {[round(t, 1) for t in r['batch_waits_s']]} s")
        for tag in sorted(m):
            print(f"  {tag}: {[round(v, 3) for v in m[tag]]}")
    if "step_phase_s" in summary:
        print(f"steps {steps}; step phase {summary['step_phase_s']:.1f} s -> {summary['steps_per_hour_step_phase']:.0f}"
              f" steps/h; wall {summary['wall_s']:.1f} s -> {summary['steps_per_hour_wall']:.0f} steps/h")
    if "all_running" in summary:
        a = summary["all_running"]
        print(f"while every pipeline ran (the first {a['seconds']:.1f} s of the steps phase): {a['steps']:.1f} steps "
              f"(those in progress at its end by their time passed) -> {a['steps_per_hour']:.0f} steps/h, "
              f"GPU busy {a['gpu_busy_share']:.3f}")
    for key in sorted(k for k in summary if k.startswith("nvml") and not k.endswith("_procs")):
        f = summary[key]
        per_gpu = ", ".join(f"GPU {g} {b:.3f}" for g, b in f["gpu_busy_share_by_gpu"].items())
        print(f"{key}: GPU busy {f['gpu_busy_share_steps_phase']:.3f} of the steps phase ({per_gpu}; {f['samples']} "
              f"samples); peaks: GPU {f['gpu_memory_peak_gib']:.1f} GiB, host {f['host_memory_peak_gib']:.1f} GiB")
    if "gpu_allocated_share_steps_phase" in summary:
        fair = summary["fairness"]
        print(f"GPU allocated {summary['gpu_allocated_share_steps_phase']:.3f} of the steps phase (trace); fairness: "
              f"at most {fair['max_steps_watched']} steps of another while one waited {fair['worst_pair']}, longest "
              f"wait {fair['longest_wait_s']:.1f} s ({fair['longest_waiter']})")
        for gpu, holders in summary.get("busy_by_holder", {}).items():
            print(f"  GPU {gpu}: allocated {summary['gpu_allocated_share_by_gpu'][gpu]:.3f}")
            for holder, f in holders.items():
                print(f"    held by {holder}: {f['seconds']:.0f} s of the steps phase, busy {f['busy']:.3f}, "
                      f"GPU memory up to {f['memory_max_gib']:.1f} GiB")
    for key in sorted(k for k in summary if k.endswith("_procs")):
        print(f"{key}: each GPU process's peak (NVML)")
        for p in summary[key]:
            when = f" at {p['time'] - t0:+.0f} s of the steps phase" if "step_phase_s" in summary else ""
            print(f"  GPU {p['gpu']} pid {p['pid']}: {p['gib']:.2f} GiB{when} ({p['name']})")
    if args.alone is not None and "steps_per_hour_wall" in summary:
        print(against_alone(summary, json.loads((args.alone / "summary.json").read_text()), len(runs)))
    print("GPU after:", gpu_after.replace("\n", " | "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
