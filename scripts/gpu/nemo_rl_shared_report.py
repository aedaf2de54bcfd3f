"""Summarise a time-shared NeMo RL run on the GPU machine (scripts/gpu_nemo_rl.sh `shared` / `sequential`).

Reads DIR/console_{a,b}.log (lines prefixed with a UNIX time), the rlix metrics NeMo RL's logger wrote to
tensorboard (DIR/logs_{a,b}/**/events.*: ``train/rlix/*``), DIR/status.json and DIR/gpu_after.csv, and writes
DIR/summary.json plus a few lines: steps per pipeline, the step phase (first step started -> last driver ended),
steps/hour, the rlix figures, the GPU memory left after both drivers ended.

    python3 scripts/gpu/nemo_rl_shared_report.py DIR
"""

from __future__ import annotations

import glob
import json
import re
import sys
from pathlib import Path
from typing import Any

STEP = re.compile(r"^(\d+\.\d+) .*=+ Step (\d+)/(\d+) =+")
REWARD = re.compile(r"^(\d+\.\d+) .*Avg Reward: ([-\d.]+)")
STAMP = re.compile(r"^(\d+\.\d+) ")
# The SingleController logs a finished step as its own metrics line, then "train step N/M  trainer_v=V".
SC_METRICS = re.compile(r"^(\d+\.\d+) .*step_metrics=\{.*'reward': ([-\d.e]+|nan)")
SC_STEP = re.compile(r"^(\d+\.\d+) .*train step (\d+)/(\d+)\s+trainer_v=")


def console(path: Path) -> dict[str, Any]:
    steps: list[tuple[float, int]] = []
    rewards: list[float] = []
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
        elif s := SC_STEP.match(line):
            sc_steps += 1
    return {"started": first, "ended": last, "step_starts": steps, "rewards": rewards,
            "steps_done": max(len(rewards), sc_steps)}


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


def main() -> int:
    d = Path(sys.argv[1])
    runs = {p: console(d / f"console_{p}.log") for p in ("a", "b") if (d / f"console_{p}.log").exists()}
    for p, r in runs.items():
        r["rlix_metrics"] = rlix_metrics(d / f"logs_{p}")
    starts = [r["step_starts"][0][0] for r in runs.values() if r["step_starts"]]
    ends = [r["ended"] for r in runs.values() if r["ended"]]
    begun = [r["started"] for r in runs.values() if r["started"]]
    steps = sum(r["steps_done"] for r in runs.values())
    summary: dict[str, Any] = {"pipelines": runs, "steps_total": steps}
    if starts and ends and begun:
        phase = max(ends) - min(starts)
        wall = max(ends) - min(begun)
        summary.update(step_phase_s=phase, wall_s=wall, steps_per_hour_step_phase=steps * 3600 / phase,
                       steps_per_hour_wall=steps * 3600 / wall)
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
        print(f"pipeline {p}: {r['steps_done']} steps, rewards {r['rewards']}")
        for tag in sorted(m):
            print(f"  {tag}: {[round(v, 3) for v in m[tag]]}")
    if "step_phase_s" in summary:
        print(f"steps {steps}; step phase {summary['step_phase_s']:.1f} s -> {summary['steps_per_hour_step_phase']:.0f}"
              f" steps/h; wall {summary['wall_s']:.1f} s -> {summary['steps_per_hour_wall']:.0f} steps/h")
    print("GPU after:", gpu_after.replace("\n", " | "))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
