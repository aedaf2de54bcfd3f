"""Library functions behind ``rlix up/down/status/timeline`` (``rlix_plugins/cli.py`` only parses arguments).

Each returns a process exit code and raises an ``RlixError`` subclass for bad input or an unreachable cluster
(the CLI prints it on one line and exits 2). The cluster acted on: ``--address``, else ``RAY_ADDRESS``, else the
one ``rlix up`` started or joined (recorded by ``control/admin/local_cluster.py``); never whatever Ray's ``"auto"`` finds.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

from rlix_plugins import envs
from rlix_plugins.control.admin import local_cluster, ray_auth
from rlix_plugins.control.admin.local_cluster import ClusterRecord
from rlix_plugins.errors import RlixConfigError, SchedulerError


def _connect_ray(address: str) -> None:
    from rlix_plugins.control.client import ensure_ray

    ensure_ray(address)


#: Printed (stderr) whenever `rlix up --insecure-no-auth` starts a head.
NO_AUTH_WARNING: Final = (
    "WARNING: --insecure-no-auth: this Ray cluster has no token authentication; anyone who can reach its ports "
    "can run code on it as this user"
)


def _check_auth_choice(insecure_no_auth: bool) -> None:
    """Before starting a head: a ``RAY_AUTH_MODE`` the user set must agree with the flag (one way to opt out)."""
    mode = envs.ray_auth_mode()
    if mode is None or (mode.lower() == "disabled") == insecure_no_auth:
        return
    if insecure_no_auth:
        raise RlixConfigError(f"{ray_auth.MODE_ENV}={mode} contradicts --insecure-no-auth; unset one of them")
    raise RlixConfigError(
        f"{ray_auth.MODE_ENV}={mode} is set, but `rlix up` starts Ray clusters with token authentication; "
        f"unset {ray_auth.MODE_ENV} (or opt out explicitly with --insecure-no-auth)"
    )


def _target(address: str | None) -> tuple[str, ClusterRecord | None]:
    """The cluster a command acts on, and the record when it is the head ``rlix up`` started."""
    explicit = address or envs.ray_address()
    if explicit:
        return explicit, None
    record = local_cluster.load()
    if record is None:
        raise SchedulerError(
            f"no Ray cluster to act on: `rlix up` has not started one ({local_cluster.state_path()} does not exist); "
            "run `rlix up` or pass --address HOST:PORT"
        )
    if not local_cluster.head_pids(record):
        local_cluster.clear()
        raise SchedulerError(
            f"the Ray head `rlix up` started at {record.address} no longer runs (its record is removed); "
            "run `rlix up` again or pass --address HOST:PORT"
        )
    return record.address, record


def _check_declared(flag: str, asked: int | None, have: float, address: str) -> None:
    if asked is not None and int(have) != asked:
        raise RlixConfigError(
            f"{flag} {asked}, but the Ray cluster `rlix up` started at {address} declares {have:g}; "
            f"stop it with `rlix down --stop-ray` and run `rlix up {flag} {asked}` again, or drop {flag}"
        )


def up(address: str | None, num_gpus: int | None, num_cpus: int | None, insecure_no_auth: bool = False,
       node_ip: str | None = None) -> int:
    """Join ``address`` (or the head ``rlix up`` started before); otherwise start a local Ray head and record it.

    A head it starts demands Ray's auth token unless ``insecure_no_auth`` (which prints ``NO_AUTH_WARNING``).
    Refuses before starting anything when the head would have no GPUs (a CPU machine needs ``--num-gpus``),
    and refuses ``--num-gpus/--num-cpus`` that differ from what the running recorded head declares. The head is
    recorded at its node IP (``node_ip``, else the one Ray picks), the address other nodes join."""
    import ray

    from rlix_plugins.control.client import connect

    explicit = address or envs.ray_address()
    if explicit is not None and (num_gpus is not None or num_cpus is not None or insecure_no_auth or node_ip):
        raise RlixConfigError(
            "--num-gpus/--num-cpus/--insecure-no-auth/--node-ip-address only apply when `rlix up` starts a local Ray "
            "cluster; drop them with --address"
        )
    started: ClusterRecord | None = None
    recorded = None if explicit is not None else local_cluster.load()
    if explicit is not None:
        _connect_ray(explicit)
    elif recorded is not None and local_cluster.head_pids(recorded):
        if insecure_no_auth:
            raise RlixConfigError(
                f"--insecure-no-auth only applies when `rlix up` starts a Ray cluster, and the one it started at "
                f"{recorded.address} runs; drop the flag, or `rlix down --stop-ray` first"
            )
        if node_ip and recorded.address.rsplit(":", 1)[0].strip("[]") != node_ip:
            raise RlixConfigError(
                f"--node-ip-address {node_ip}, but the Ray head `rlix up` started runs at {recorded.address}; stop "
                f"it with `rlix down --stop-ray` and run `rlix up --node-ip-address {node_ip}` again, or drop the flag"
            )
        _connect_ray(recorded.address)
        resources = ray.cluster_resources()
        _check_declared("--num-gpus", num_gpus, resources.get("GPU", 0.0), recorded.address)
        _check_declared("--num-cpus", num_cpus, resources.get("CPU", 0.0), recorded.address)
    else:
        if num_gpus is None and local_cluster.detect_gpus() == 0:
            raise RlixConfigError(
                "this machine has no GPUs for Ray to detect; pass --num-gpus N to declare N GPUs "
                "(e.g. `rlix up --num-gpus 2`; work placed on them runs on the CPU)"
            )
        _check_auth_choice(insecure_no_auth)
        if recorded is not None:  # its head is gone: drop the stale record
            local_cluster.clear()
        if insecure_no_auth:
            print(f"rlix up: {NO_AUTH_WARNING}", file=sys.stderr)
        started = recorded = local_cluster.start_head(num_gpus, num_cpus, token_auth=not insecure_no_auth,
                                                      node_ip=node_ip)
    t0 = time.monotonic()
    try:
        if started is not None:
            local_cluster.save(started)
            _connect_ray(started.address)
        pool = connect(create_if_missing=True).pool()
    except BaseException:
        if started is not None:  # leave nothing running that this call started
            local_cluster.stop_head(started)
            local_cluster.clear()
        raise
    where = ray.get_runtime_context().gcs_address
    print(
        f"rlix control plane {'started' if started else 'running'} on Ray cluster {where} "
        f"({pool['num_gpus']} GPUs, {pool['gpus_per_node']} per node; ready in {time.monotonic() - t0:.1f} s)\n"
        f"  pipelines join with RAY_ADDRESS={where}{_auth_note()}; "
        f"stop with `rlix down{' --stop-ray' if recorded is not None else ''}`"
    )
    return 0


def _auth_note() -> str:
    """How clients authenticate to the cluster this process joined (token mode: its GCS demanded the token)."""
    if (envs.ray_auth_mode() or "").lower() != "token":
        return " (no token authentication)"
    # RAY_AUTH_MODE too: a process joining by an explicit address (NeMo RL's init_ray under RAY_ADDRESS) never
    # turns token mode on by itself, sends no token and is refused (NeMo RL then fails to start a cluster of its own).
    return f" {envs.RAY_AUTH_MODE}=token and this cluster's auth token ({ray_auth.token_source()} here)"


def down(address: str | None, stop_ray: bool) -> int:
    """Stop the control plane (its waiters get an error); with ``stop_ray`` also the Ray head ``rlix up`` started.

    ``--stop-ray`` ends only that head's own processes; a cluster named with ``--address`` is never stopped."""
    from rlix_plugins.control.client import connect

    target, record = _target(address)
    if stop_ray and record is None:
        raise RlixConfigError(
            f"--stop-ray stops only the Ray head `rlix up` started, not the cluster at {target}; "
            "drop --stop-ray (or --address / RAY_ADDRESS to stop the recorded head)"
        )
    try:
        _connect_ray(target)
        cp = connect(create_if_missing=False)
    except SchedulerError as exc:
        if not stop_ray:
            raise
        print(f"no control plane to stop ({exc})")
    else:
        pipelines = sorted(cp.status()["pipelines"])
        cp.shutdown()
        print("rlix control plane stopped" + (f"; pipelines unregistered: {', '.join(pipelines)}" if pipelines else ""))
    if stop_ray and record is not None:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        stopped = local_cluster.stop_head(record)
        local_cluster.clear()
        print(f"Ray head at {target} that `rlix up` started: " +
              (f"stopped ({stopped} processes)" if stopped else "already gone"))
    return 0


def status(address: str | None, as_json: bool) -> int:
    from rlix_plugins.control.client import connect

    _connect_ray(_target(address)[0])
    cp = connect(create_if_missing=False)
    st = cp.status()
    table = cp.node_table()
    st["nodes"] = [{"rank": n.rank, "ip": n.ip, "node_id": n.node_id,
                    "gpus": list(range(n.rank * table.gpus_per_node, (n.rank + 1) * table.gpus_per_node))}
                   for n in table.nodes]
    print(json.dumps(st, indent=2, sort_keys=True) if as_json else format_status(st))
    return 0


def format_status(st: dict[str, Any]) -> str:
    """Readable tables: pipelines, allocations, pending requests, idle GPUs."""
    lines = [f"GPUs: {len(st['gpus'])} ({st['gpus_per_node']} per node)   idle: {_ids(st['idle_gpus'])}   "
             f"cycles: {st.get('cycles', 0)}   last plan: {st.get('last_plan_ms', 0)} ms"]
    if st.get("nodes"):  # which machine each GPU id is on (the control plane's node table)
        lines.append("nodes: " + "; ".join(f"{n['rank']} = {n['ip']} GPUs {n['gpus'][0]}..{n['gpus'][-1]}"
                                           for n in st["nodes"]))
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
    if st.get("failed"):
        lines.append("")
        lines.append(_table(
            ["FAILED PIPELINE", "WHEN", "GPUS FREED", "WHY"],
            [[pid, time.strftime("%H:%M:%S", time.localtime(f["time"])), _ids(f.get("gpus_freed", [])), f["reason"]]
             for pid, f in st["failed"].items()],
            empty="",
        ))
    if st.get("fences"):
        lines.append("")
        lines.append(_table(
            ["FENCED GPUS", "OF FAILED PIPELINE", "UNTIL GONE (its Ray job's live processes; stop its driver to free them)"],
            [[_ids(f["gpus"]), key.split("/")[0], "; ".join(f["processes"]) or f"job {f['job_id']} (not checked yet)"]
             for key, f in st["fences"].items()],
            empty="",
        ))
    if st.get("invariant_violations"):
        lines.append(f"\nINVARIANT VIOLATIONS (an rlix bug, please report): {st['invariant_violations'][-3:]}")
    return "\n".join(lines)


def _ids(ids: list[int]) -> str:
    return "[" + ",".join(str(i) for i in ids) + "]"


def _table(header: list[str], rows: list[list[str]], *, empty: str) -> str:
    if not rows:
        return f"{header[0]}: {empty}"
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return "\n".join(fmt.format(*map(str, r)).rstrip() for r in [header, *rows])


def timeline(address: str | None, out: str, trace: str | None = None, names: Sequence[str] = ()) -> int:
    """Render the scheduler trace to ``out`` (PNG/SVG/PDF by suffix) as a Gantt chart, one row per GPU: the live
    control plane's, or the one saved in ``trace`` (no cluster needed). ``names``: ``PIPELINE_ID=NAME`` items, the
    names the legend shows for those pipelines."""
    from rlix_plugins.control.capacity.timeline import read_trace, render_timeline
    from rlix_plugins.control.client import connect

    path = Path(out)
    if path.suffix.lower() not in {".png", ".svg", ".pdf"}:
        raise RlixConfigError(f"--out {out!r}: use a .png, .svg or .pdf file name")
    if not path.parent.exists():
        raise RlixConfigError(f"--out {out!r}: directory {str(path.parent)!r} does not exist")
    legend: dict[str, str] = {}
    for item in names:
        pid, sep, name = item.partition("=")
        if not sep or not pid or not name:
            raise RlixConfigError(f"--name {item!r}: write PIPELINE_ID=NAME, e.g. --name ft_a19aa0f04941=a")
        legend[pid] = name
    if trace is not None:  # a saved trace: every GPU it names
        events, gpus, title = read_trace(trace), None, f"rlix scheduler timeline ({Path(trace).name})"
        if not events:
            raise RlixConfigError(f"--trace {trace!r}: no events to draw")
    else:
        _connect_ray(_target(address)[0])
        cp = connect(create_if_missing=False)
        events, title = cp.trace(), "rlix scheduler timeline"
        if not events:
            raise SchedulerError(
                "nothing to draw: the control plane has recorded no scheduling decision yet (0 trace events); "
                "run pipelines on it first (e.g. `rlix demo --address ...`)"
            )
        gpus = cp.pool()["num_gpus"]
    unknown = sorted(legend.keys() - {e.pipeline_id for e in events})
    if unknown:
        raise RlixConfigError(f"--name: no pipeline {', '.join(unknown)} in the trace; its pipelines are "
                              f"{', '.join(sorted({e.pipeline_id for e in events if e.pipeline_id}))}")
    written = render_timeline(events, path, gpus=gpus, title=title, names=legend)
    print(f"wrote {written} ({len(events)} trace events)")
    return 0
