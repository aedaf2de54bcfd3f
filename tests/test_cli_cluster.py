"""`rlix up/status/down` act only on the Ray head `rlix up` started (recorded in RLIX_STATE_DIR) or on --address.

The lifecycle test starts a real head with `rlix up --num-gpus 2` while this session's own Ray cluster (4 declared
GPUs, with a control plane) runs on the same machine: `status` must show the 2-GPU head, `down --stop-ray` must
end exactly that head's processes and leave the session's cluster and control plane running.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlix_plugins.control import client
from rlix_plugins.control.admin import local_cluster
from rlix_plugins.control.admin.commands import NO_AUTH_WARNING
from rlix_plugins.control.admin.local_cluster import ClusterRecord
from tests.control._ray_helpers import control_plane
from tests.harness.cross_node import bindable
from tests.test_cli import one_line_error, rlix, without_token

__all__ = ["control_plane"]


def _record(state_dir: Path) -> ClusterRecord:
    return ClusterRecord(**json.loads((state_dir / "cluster.json").read_text()))


@pytest.mark.skipif(local_cluster.detect_gpus() > 0, reason="needs a machine without GPUs")
def test_up_on_a_cpu_machine_without_num_gpus_refuses_before_starting_anything(tmp_path: Path) -> None:
    (tmp_path / "tmp").mkdir()
    res = rlix("up", state_dir=tmp_path / "state", env={"TMPDIR": str(tmp_path / "tmp")})
    err = one_line_error(res, "up")
    assert "pass --num-gpus N" in err
    assert not (tmp_path / "state" / "cluster.json").exists()
    assert list((tmp_path / "tmp").iterdir()) == []  # no `ray start` temp directory: nothing was started


_RAW_CLIENT = """
import logging, sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
except Exception as exc:
    print("REFUSED", type(exc).__name__)
else:
    print("JOINED", ray.cluster_resources().get("GPU"))
"""


def raw_ray_client(address: str, env: dict[str, str]) -> str:
    """What a plain `ray.init(address=...)` of another process gets: JOINED or REFUSED."""
    res = subprocess.run([sys.executable, "-c", _RAW_CLIENT, address], capture_output=True, text=True,
                         timeout=180, env=env)
    return next((line for line in res.stdout.splitlines() if line.startswith(("JOINED", "REFUSED"))),
                res.stdout[-500:] + res.stderr[-1500:])


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    return {**env, **extra}


@pytest.mark.slow
def test_a_head_rlix_up_starts_refuses_clients_without_its_token(tmp_path: Path) -> None:
    """`rlix up` leaves Ray's token authentication on: a client without the cluster's token cannot join (before,
    `rlix up` set RAY_AUTH_MODE=disabled and anyone reaching the port could); `rlix` of the same user joins it with
    the token `rlix up` wrote (0600 in a 0700 directory, where RAY_AUTH_TOKEN_PATH says), no flag needed."""
    state = tmp_path / "state"
    token = tmp_path / "tokens" / "auth_token"  # none yet: `rlix up` creates it
    auth = {"RAY_AUTH_TOKEN_PATH": str(token)}
    res = res_up = rlix("up", "--num-gpus", "1", "--num-cpus", "1", state_dir=state, timeout=240, env=auth)
    assert res.returncode == 0, res.stderr
    record = _record(state)
    try:
        assert f"and this cluster's auth token (RAY_AUTH_TOKEN_PATH={token}" in res.stdout
        assert "WARNING" not in res.stderr
        assert (token.stat().st_mode & 0o777, token.parent.stat().st_mode & 0o777) == (0o600, 0o700)
        res = rlix("status", "--json", state_dir=state, env=auth)
        assert res.returncode == 0 and json.loads(res.stdout)["gpus"] == [0], res.stderr

        (tmp_path / "home").mkdir()
        no_token = _env(HOME=str(tmp_path / "home"))
        assert raw_ray_client(record.address, no_token) == "REFUSED ConnectionError"
        (tmp_path / "other").write_text("0" * 64)
        assert raw_ray_client(record.address, _env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(tmp_path / "other"))) \
            == "REFUSED ConnectionError"
        assert raw_ray_client(record.address, _env(RAY_AUTH_MODE="token", **auth)) == "JOINED 1.0"

        # The join advice `rlix up` prints, followed as a NeMo RL driver joins (init_ray: "auto" under RAY_ADDRESS):
        # it joins; without the mode the advice names, the same driver sends no token and is refused.
        advice = dict(pair.split("=", 1) for pair in
                      re.search(r"pipelines join with (.+?) and this cluster's", res_up.stdout).group(1).split())
        assert advice == {"RAY_ADDRESS": record.address, "RAY_AUTH_MODE": "token"}
        assert raw_ray_client("auto", _env(**advice, **auth)) == "JOINED 1.0"
        assert raw_ray_client("auto", _env(RAY_ADDRESS=record.address, **auth)) == "REFUSED ConnectionError"

        err = one_line_error(rlix("status", state_dir=state, **without_token(tmp_path)), "status")
        assert "requires its auth token and this machine has none" in err
    finally:
        local_cluster.stop_head(record)


_NODES = """
import logging, sys, ray
ray.init(address=sys.argv[1], log_to_driver=False, logging_level=logging.ERROR)
print("NODES", " ".join(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))
"""


@pytest.mark.slow
def test_the_head_is_recorded_at_its_node_ip_where_another_node_joins(tmp_path: Path) -> None:
    """`rlix up` records the head's node IP (before: 127.0.0.1, which another machine reads as itself), and a
    raylet at another address (127.0.0.2, standing in for a second machine) joins the cluster at that address."""
    ip = local_cluster.head_node_ip()
    if ip.startswith("127.") or not bindable("127.0.0.2"):
        pytest.skip(f"this machine has no address other than loopback ({ip}) or cannot bind 127.0.0.2")
    state = tmp_path / "state"
    auth = {"RAY_AUTH_TOKEN_PATH": str(tmp_path / "tokens" / "auth_token")}
    res = rlix("up", "--num-gpus", "1", "--num-cpus", "1", state_dir=state, timeout=240, env=auth)
    assert res.returncode == 0, res.stderr
    record = _record(state)
    joined: subprocess.Popen[str] | None = None
    try:
        assert record.address.rsplit(":", 1)[0] == ip and f"RAY_ADDRESS={record.address}" in res.stdout
        ray_exe = str(Path(sys.executable).parent / "ray")
        joined = subprocess.Popen(  # --block: the raylet stays in this process's own session, ended below
            [ray_exe, "start", f"--address={record.address}", "--node-ip-address=127.0.0.2", "--num-cpus=1",
             "--num-gpus=1", "--block", "--disable-usage-stats"],
            env=_env(RAY_AUTH_MODE="token", **auth), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        nodes = ""
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and nodes != f"NODES 127.0.0.2 {ip}":
            out = subprocess.run([sys.executable, "-c", _NODES, record.address], capture_output=True, text=True,
                                 timeout=120, env=_env(RAY_AUTH_MODE="token", **auth)).stdout
            nodes = next((line for line in out.splitlines() if line.startswith("NODES")), "")
            time.sleep(1)
        assert nodes == f"NODES 127.0.0.2 {ip}"
    finally:
        if joined is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(joined.pid, signal.SIGTERM)
            try:
                joined.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(joined.pid, signal.SIGKILL)
        local_cluster.stop_head(record)


@pytest.mark.slow
def test_insecure_no_auth_is_explicit_and_warns(tmp_path: Path) -> None:
    state = tmp_path / "state"
    res = rlix("up", "--num-gpus", "1", "--num-cpus", "1", "--insecure-no-auth", state_dir=state, timeout=240)
    assert res.returncode == 0, res.stderr
    record = _record(state)
    try:
        warning = [line for line in res.stderr.splitlines() if "WARNING" in line]
        assert warning == [f"rlix up: {NO_AUTH_WARNING}"], res.stderr
        assert "(no token authentication)" in res.stdout
        (tmp_path / "home").mkdir()
        assert raw_ray_client(record.address, _env(HOME=str(tmp_path / "home"))) == "JOINED 1.0"
        err = one_line_error(rlix("up", "--insecure-no-auth", state_dir=state), "up")
        assert "--insecure-no-auth only applies when `rlix up` starts a Ray cluster" in err
    finally:
        local_cluster.stop_head(record)


@pytest.mark.parametrize(("mode", "flags", "fragment"), [
    ("disabled", (), "RAY_AUTH_MODE=disabled is set, but `rlix up` starts Ray clusters with token authentication; "
                     "unset RAY_AUTH_MODE (or opt out explicitly with --insecure-no-auth)"),
    ("token", ("--insecure-no-auth",), "RAY_AUTH_MODE=token contradicts --insecure-no-auth; unset one of them"),
])
def test_up_refuses_an_auth_mode_that_contradicts_the_flag_before_starting(
        mode: str, flags: tuple[str, ...], fragment: str, tmp_path: Path) -> None:
    """RAY_AUTH_MODE=disabled left in a shell never turns authentication off silently."""
    (tmp_path / "tmp").mkdir()
    res = rlix("up", "--num-gpus", "1", *flags, state_dir=tmp_path / "state",
               env={"RAY_AUTH_MODE": mode, "TMPDIR": str(tmp_path / "tmp")})
    assert fragment in one_line_error(res, "up")
    assert list((tmp_path / "tmp").iterdir()) == [] and not (tmp_path / "state" / "cluster.json").exists()


@pytest.mark.slow
def test_up_status_down_act_only_on_the_head_up_started(control_plane: client.ControlPlane, tmp_path: Path) -> None:
    state = tmp_path / "state"
    res = rlix("up", "--num-gpus", "2", "--num-cpus", "2", state_dir=state, timeout=240)
    assert res.returncode == 0, res.stderr
    record = _record(state)
    try:
        assert "control plane started" in res.stdout and "(2 GPUs" in res.stdout
        assert local_cluster.head_pids(record)

        err = one_line_error(rlix("up", "--num-gpus", "3", state_dir=state), "up")
        assert "--num-gpus 3, but the Ray cluster `rlix up` started" in err and "declares 2" in err
        err = one_line_error(rlix("up", "--node-ip-address", "198.51.100.7", state_dir=state), "up")
        assert f"--node-ip-address 198.51.100.7, but the Ray head `rlix up` started runs at {record.address}" in err
        res = rlix("up", "--num-gpus", "2", state_dir=state)  # the same again: joins, starts nothing
        assert res.returncode == 0 and "control plane running" in res.stdout, res.stderr
        assert _record(state) == record

        res = rlix("status", "--json", state_dir=state)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["gpus"] == [0, 1]  # the recorded head, not this session's 4-GPU cluster

        res = rlix("down", "--stop-ray", state_dir=state, timeout=120)
        assert res.returncode == 0, res.stderr
        assert "control plane stopped" in res.stdout and "stopped (" in res.stdout
        assert local_cluster._session_pids(record.session_id) == []  # every process of that head is gone
        assert not (state / "cluster.json").exists() and not Path(record.temp_dir).exists()
    finally:
        local_cluster.stop_head(record)
    assert control_plane.status()["gpus"] == [0, 1, 2, 3]  # this session's cluster and control plane still run
    err = one_line_error(rlix("status", state_dir=state), "status")
    assert "no Ray cluster to act on" in err


def test_a_record_whose_head_is_gone_is_dropped(tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait(timeout=30)
    record = ClusterRecord(address="127.0.0.1:1", session_id=gone.pid, temp_dir=str(tmp_path / "rlix-ray-x"))
    (state / "cluster.json").write_text(json.dumps(record.__dict__))
    err = one_line_error(rlix("status", state_dir=state), "status")
    assert "no longer runs" in err and "rlix up" in err
    assert not (state / "cluster.json").exists()


def test_stop_head_ends_only_the_recorded_heads_session(tmp_path: Path) -> None:
    """A session whose processes do not run from the recorded temp dir (a reused session id) is left alone;
    the recorded one is ended, children included."""
    marker = tmp_path / "rlix-ray-abc"
    sleeper = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); time.sleep(120)"
    other = subprocess.Popen([sys.executable, "-c", sleeper, str(tmp_path / "elsewhere" / "session_1")],
                             start_new_session=True)
    ours = subprocess.Popen([sys.executable, "-c", sleeper, f"{marker}/session_2026_1"], start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while min(len(local_cluster._session_pids(p.pid)) for p in (other, ours)) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert local_cluster.stop_head(ClusterRecord("127.0.0.1:1", other.pid, str(marker))) == 0
        assert other.poll() is None and len(local_cluster._session_pids(other.pid)) == 2
        assert local_cluster.stop_head(ClusterRecord("127.0.0.1:1", ours.pid, str(marker))) == 2
        assert ours.wait(timeout=10) is not None and local_cluster._session_pids(ours.pid) == []
        assert other.poll() is None
    finally:
        for proc in (other, ours):
            for pid in local_cluster._session_pids(proc.pid):
                os.kill(pid, 9)
            proc.wait(timeout=10)
