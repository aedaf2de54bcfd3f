"""The `rlix` command: --help everywhere, one-line errors, and status/timeline against a live control plane.

The live tests run the real CLI in a subprocess that joins this pytest process's Ray cluster (``--address``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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


def rlix(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "rlix_plugins.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


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
    ],
)
def test_bad_input_exits_2_with_one_line(argv: list[str], fragment: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and fragment in err and err.startswith(f"rlix {argv[0]}:")


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


def test_status_without_control_plane_is_one_line_error(ray_cluster: object) -> None:
    from tests.control._ray_helpers import kill_control_plane

    kill_control_plane()
    res = rlix("status", "--address", ray.get_runtime_context().gcs_address)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("rlix status:") and "rlix up" in res.stderr


def test_up_joins_the_cluster_and_down_stops_the_control_plane(ray_cluster: object) -> None:
    from tests.control._ray_helpers import kill_control_plane

    kill_control_plane()
    address = ray.get_runtime_context().gcs_address
    res = rlix("up", "--address", address)
    assert res.returncode == 0, res.stderr
    assert f"on Ray cluster {address}" in res.stdout and "4 GPUs" in res.stdout
    assert client.connect(create_if_missing=False).pool()["num_gpus"] == 4
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
