"""The Ray head ``rlix up`` started, recorded so that later ``rlix`` commands act on it and nothing else.

``rlix status/down/timeline`` without ``--address`` use the recorded address, never Ray's ``"auto"`` (which joins
whatever Ray cluster runs on the machine, e.g. another user's). The record lives in ``$RLIX_STATE_DIR/cluster.json``
(default ``~/.cache/rlix``).

A head that ``rlix up`` starts runs in a Unix session of its own (``ray start`` is its leader; every Ray process of
that head, workers included, inherits the session id) and in a private Ray temp directory, so no plain
``ray.init()`` on the machine joins it by accident. ``rlix down --stop-ray`` ends exactly the processes of that
session, after checking they still belong to the recorded head; a bare ``ray stop`` would end every Ray process of
the user. Unless started with ``--insecure-no-auth`` the head demands Ray's auth token (``control/admin/ray_auth.py``).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Final

from rlix_plugins import envs
from rlix_plugins.control.admin import ray_auth
from rlix_plugins.errors import RlixConfigError, SchedulerError

STATE_DIR_ENV: Final = envs.RLIX_STATE_DIR
#: ``ray start`` must finish within this.
RAY_START_TIMEOUT_S: Final = 120.0
#: SIGTERM grace before SIGKILL when stopping a head (its GCS keeps no state worth a longer wait).
STOP_GRACE_S: Final = 5.0


@dataclass(frozen=True)
class ClusterRecord:
    """The Ray head ``rlix up`` started: its address and how to find its processes."""

    #: ``<head node IP>:<port>``: the address other nodes join (``ray start --address``) and pipelines connect to;
    #: never 127.0.0.1, which another machine would read as itself.
    address: str
    #: Unix session id of the head's processes (the pid of the ``ray start`` that started them).
    session_id: int
    #: The head's private Ray temp directory; its session directory's name appears in the head's command lines.
    temp_dir: str


def state_path() -> Path:
    return envs.state_dir() / "cluster.json"


def load() -> ClusterRecord | None:
    path = state_path()
    try:
        data = json.loads(path.read_text())
        return ClusterRecord(**data)
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as exc:
        raise RlixConfigError(f"cannot read {path} ({type(exc).__name__}); delete it and run `rlix up` again") from None


def save(record: ClusterRecord) -> None:
    path = state_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(record)))
    tmp.replace(path)


def clear() -> None:
    state_path().unlink(missing_ok=True)


def detect_gpus() -> int:
    """GPUs a Ray head started here would declare (Ray's own detection: NVML, limited by CUDA_VISIBLE_DEVICES)."""
    try:
        from ray._private.accelerators import get_accelerator_manager_for_resource

        manager = get_accelerator_manager_for_resource("GPU")
        if manager is None:
            return 0
        count = int(manager.get_current_node_num_accelerators())
        visible = manager.get_current_process_visible_accelerator_ids()
        return count if visible is None else min(count, len(visible))
    except (ImportError, AttributeError):  # Ray moved its private API: ask torch instead
        import torch

        return int(torch.cuda.device_count())


def head_node_ip(node_ip: str | None = None) -> str:
    """The IP the head is started on and recorded with: ``node_ip`` when given (``rlix up --node-ip-address``, for a
    machine with several interfaces), else the one Ray itself would pick for this node (the interface of the route
    out, ``ray.util.get_node_ip_address``)."""
    if node_ip:
        return node_ip
    import ray

    return str(ray.util.get_node_ip_address())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def _ray_env(token_auth: bool) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env[ray_auth.MODE_ENV] = "token" if token_auth else "disabled"  # the caller checked it against the user's
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def start_head(num_gpus: int | None, num_cpus: int | None, token_auth: bool = True,
               node_ip: str | None = None) -> ClusterRecord:
    """``ray start --head`` on free ports, in a new Unix session and a private temp directory; returns its record.

    With ``token_auth`` (the default) the head demands Ray's auth token: ``ray start --head`` only uses one, so a
    missing token file is created first, private (``ray_auth.ensure_private_token``; Ray's own generator writes
    it readable by every local user)."""
    exe = shutil.which("ray", path=os.path.dirname(sys.executable) + os.pathsep + envs.search_path())
    if exe is None:
        raise SchedulerError("the `ray` command is not installed next to this Python; `pip install 'ray[default]'`")
    if token_auth:
        ray_auth.ensure_private_token()
    port = _free_port()
    ip = head_node_ip(node_ip)
    temp_dir = tempfile.mkdtemp(prefix="rlix-ray-")  # short: Ray's socket paths live under it
    cmd = [exe, "start", "--head", f"--node-ip-address={ip}", f"--port={port}",
           f"--ray-client-server-port={_free_port()}", f"--temp-dir={temp_dir}", "--disable-usage-stats",
           "--include-dashboard=false"]
    if num_gpus is not None:
        cmd.append(f"--num-gpus={num_gpus}")
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_ray_env(token_auth),
                            start_new_session=True)
    host = f"[{ip}]" if ":" in ip else ip
    record = ClusterRecord(address=f"{host}:{port}", session_id=proc.pid, temp_dir=temp_dir)
    try:
        output, _ = proc.communicate(timeout=RAY_START_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        stop_head(record)
        raise SchedulerError(f"`ray start --head` did not finish within {RAY_START_TIMEOUT_S:.0f} s") from None
    if proc.returncode != 0:
        stop_head(record)
        tail = output.strip().splitlines()[-1:] or ["(no output)"]
        raise SchedulerError(f"`ray start --head` failed (exit {proc.returncode}): {tail[0]}")
    return record


def _session_pids(session_id: int) -> list[int]:
    """Live processes (zombies excluded) of a Unix session, this one excepted."""
    own = os.getpid()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == own:
            continue
        with contextlib.suppress(OSError):
            if os.getsid(int(entry)) == session_id and _alive(int(entry)):
                pids.append(int(entry))
    return pids


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def head_pids(record: ClusterRecord) -> list[int]:
    """Live processes of the recorded head: its session's, if a process of it runs from the recorded temp dir
    (a reused session id of an unrelated program yields nothing)."""
    pids = _session_pids(record.session_id)
    marker = re.compile(re.escape(record.temp_dir.rstrip("/")) + r"/session_")
    return pids if any(marker.search(_cmdline(p)) for p in pids) else []


def stop_head(record: ClusterRecord) -> int:
    """SIGTERM the recorded head's processes, SIGKILL what is left of its session after ``STOP_GRACE_S`` and wait
    until it is gone; returns how many processes it had. Nothing else is touched. Removes the head's temp dir."""
    pids = head_pids(record)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    _wait_gone(pids, STOP_GRACE_S)
    if pids:  # the whole session now: also a worker the raylet spawned meanwhile
        left = _session_pids(record.session_id)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _wait_gone(left, STOP_GRACE_S)
    shutil.rmtree(record.temp_dir, ignore_errors=True)
    return len(pids)


def _wait_gone(pids: list[int], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)


def _alive(pid: int) -> bool:
    """Running (a zombie has exited; its parent has yet to reap it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
