"""Library functions behind ``rlix up/down/status/timeline`` (``rlix_plugins/cli.py`` only parses arguments).

Each returns a process exit code and raises an ``RlixError`` subclass for bad input or an unreachable cluster
(the CLI prints it on one line and exits 2). Address resolution: ``--address``, else ``RAY_ADDRESS``, else the
local cluster (``"auto"``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Final

from rlix_plugins.errors import RlixConfigError, SchedulerError

#: ``ray start`` / ``ray stop`` must finish within this.
RAY_CLI_TIMEOUT_S: Final = 120.0


def _ray_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def _ray_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    if exe is None:
        raise SchedulerError("the `ray` command is not installed next to this Python; `pip install 'ray[default]'`")
    try:
        return subprocess.run([exe, *args], capture_output=True, text=True, timeout=RAY_CLI_TIMEOUT_S, env=_ray_env())
    except subprocess.TimeoutExpired:
        raise SchedulerError(f"`ray {' '.join(args)}` did not finish within {RAY_CLI_TIMEOUT_S:.0f} s") from None


def _connect_ray(address: str | None) -> None:
    from rlix_plugins.control.client import ensure_ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ensure_ray(address)


def up(address: str | None, num_gpus: int | None, num_cpus: int | None) -> int:
    """Join ``address`` (or the local cluster); start a local Ray head first when none is reachable."""
    import ray

    from rlix_plugins.control.client import connect

    target = address or os.environ.get("RAY_ADDRESS")
    if target is not None and (num_gpus is not None or num_cpus is not None):
        raise RlixConfigError(
            "--num-gpus/--num-cpus only apply when `rlix up` starts a local Ray cluster; drop them with --address"
        )
    started = False
    if target is None:
        try:
            _connect_ray("auto")
        except SchedulerError:
            cmd = ["start", "--head", "--disable-usage-stats", "--include-dashboard=false"]
            if num_gpus is not None:
                cmd.append(f"--num-gpus={num_gpus}")
            if num_cpus is not None:
                cmd.append(f"--num-cpus={num_cpus}")
            res = _ray_cli(cmd)
            if res.returncode != 0:
                tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["(no output)"]
                raise SchedulerError(f"`ray start --head` failed (exit {res.returncode}): {tail[0]}") from None
            started = True
            _connect_ray("auto")
    else:
        _connect_ray(target)
    t0 = time.monotonic()
    cp = connect(create_if_missing=True)
    pool = cp.pool()
    where = ray.get_runtime_context().gcs_address
    print(
        f"rlix control plane {'started' if started else 'running'} on Ray cluster {where} "
        f"({pool['num_gpus']} GPUs, {pool['gpus_per_node']} per node; ready in {time.monotonic() - t0:.1f} s)\n"
        f"  pipelines join with RAY_ADDRESS={where}; stop with `rlix down{' --stop-ray' if started else ''}`"
    )
    return 0


def down(address: str | None, stop_ray: bool) -> int:
    """Stop the control plane (its waiters get an error); with ``stop_ray`` also ``ray stop`` the local node."""
    from rlix_plugins.control.client import connect

    try:
        _connect_ray(address)
        cp = connect(create_if_missing=False)
    except SchedulerError as exc:
        if not stop_ray:
            raise
        print(f"no control plane to stop ({exc})")
    else:
        pipelines = sorted(cp.status()["pipelines"])
        cp.shutdown()
        print("rlix control plane stopped" + (f"; pipelines unregistered: {', '.join(pipelines)}" if pipelines else ""))
    if stop_ray:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        res = _ray_cli(["stop"])
        if res.returncode != 0:
            raise SchedulerError(f"`ray stop` failed (exit {res.returncode}): {res.stderr.strip()[:200]}")
        print("local Ray cluster stopped")
    return 0


def status(address: str | None, as_json: bool) -> int:
    from rlix_plugins.control.client import connect

    _connect_ray(address)
    st = connect(create_if_missing=False).status()
    print(json.dumps(st, indent=2, sort_keys=True) if as_json else format_status(st))
    return 0


def format_status(st: dict[str, Any]) -> str:
    """Readable tables: pipelines, allocations, pending requests, idle GPUs."""
    lines = [f"GPUs: {len(st['gpus'])} ({st['gpus_per_node']} per node)   idle: {_ids(st['idle_gpus'])}   "
             f"cycles: {st.get('cycles', 0)}   last plan: {st.get('last_plan_ms', 0)} ms"]
    lines.append("")
    lines.append(_table(
        ["PIPELINE", "ADMITTED", "CLUSTERS", "PROGRESS"],
        [[pid, "yes" if p["admitted"] else "no",
          " ".join(f"{n}:{_ids(c['device_mapping'])}/tp{c['tp_size']}" for n, c in sorted(p["clusters"].items())),
          "-" if not p["progress"] else
          f"step {p['progress']['step']}: {p['progress']['completed']}/{p['progress']['step_target']}"]
         for pid, p in st["pipelines"].items()],
        empty="(no pipelines registered)",
    ))
    lines.append("")
    lines.append(_table(
        ["CLUSTER", "PRIORITY", "GPUS", "ACTIVE DP RANKS"],
        [[cid, a["priority"], _ids(a["gpus"]), _ids(a["active_dp_ranks"]) if a["priority"] == "GENERATION" else "-"]
         for cid, a in st["allocations"].items()],
        empty="(no allocations)",
    ))
    lines.append("")
    lines.append(_table(
        ["PENDING CLUSTER", "PRIORITY", "STEP", "WAITING"],
        [[r["cluster_id"], r["priority"], "-" if r["step"] is None else str(r["step"]), f"{r['waiting_s']:.1f} s"]
         for r in st["pending"]],
        empty="(no pending requests)",
    ))
    if st.get("planned_releases"):
        lines.append(f"\nplanned releases: {', '.join(st['planned_releases'])}")
    return "\n".join(lines)


def _ids(ids: list[int]) -> str:
    return "[" + ",".join(str(i) for i in ids) + "]"


def _table(header: list[str], rows: list[list[str]], *, empty: str) -> str:
    if not rows:
        return f"{header[0]}: {empty}"
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def timeline(address: str | None, out: str) -> int:
    """Render the scheduler trace to ``out`` (PNG/SVG/PDF by suffix) as a Gantt chart, one row per GPU."""
    from rlix_plugins.control.client import connect
    from rlix_plugins.control.timeline import render_timeline

    path = Path(out)
    if path.suffix.lower() not in {".png", ".svg", ".pdf"}:
        raise RlixConfigError(f"--out {out!r}: use a .png, .svg or .pdf file name")
    if not path.parent.exists():
        raise RlixConfigError(f"--out {out!r}: directory {str(path.parent)!r} does not exist")
    _connect_ray(address)
    cp = connect(create_if_missing=False)
    events = cp.trace()
    pool = cp.pool()
    written = render_timeline(events, path, gpus=pool["num_gpus"], title="rlix scheduler timeline")
    print(f"wrote {written} ({len(events)} trace events)")
    return 0
