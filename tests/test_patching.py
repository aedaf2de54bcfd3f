"""``rlix patch`` against a small synthetic NeMo RL git checkout and a series made with git format-patch.

Runs in CI without NeMo RL. The real series is checked for shape and size at the end; applying it to the real
checkout is the conformance suite's job (tests/nemo_rl/).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from rlix_plugins._patch_series import Series, discover_series, load_series
from rlix_plugins.errors import PatchError
from rlix_plugins.patching import (
    APPLIED,
    DEFAULT_SERIES_ROOT,
    DRIFTED,
    NOT_APPLIED,
    PARTIAL,
    _run_git_apply,
    apply,
    find_checkout,
    revert,
    run_cli,
    series_status,
)

GRPO = "".join(f"line {i}\n" for i in range(1, 41))
OTHER = "".join(f"other {i}\n" for i in range(1, 21))


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


def _write(repo: Path, rel: str, text: str) -> None:
    path = repo / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def fake_nemo(tmp_path: Path) -> tuple[Path, Path, str]:
    """(checkout at the pin, series root, pin commit). The series: 0001 edits grpo.py twice and adds a file,
    0002 edits another file."""
    repo = tmp_path / "RL"
    repo.mkdir()
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    _write(repo, "nemo_rl/algorithms/grpo.py", GRPO)
    _write(repo, "nemo_rl/models/other.py", OTHER)
    _write(repo, "README.md", "readme\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    pin = git(repo, "rev-parse", "HEAD")
    _write(repo, "nemo_rl/algorithms/grpo.py", GRPO.replace("line 5\n", "line 5\nhooked A\n").replace(
        "line 35\n", "line 35\nhooked B\n"))
    _write(repo, "nemo_rl/algorithms/seam.py", "SEAM = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "seam")
    _write(repo, "nemo_rl/models/other.py", OTHER.replace("other 10\n", "other ten\n"))
    git(repo, "commit", "-qam", "other")
    series = tmp_path / "series"
    out = series / pin[:7]
    git(repo, "format-patch", "-q", "-2", "--zero-commit", "--no-signature", "-o", str(out), "HEAD")
    for i, p in enumerate(sorted(out.iterdir()), start=1):
        p.rename(out / f"{i:04d}-part{i}.patch")
    git(repo, "reset", "-q", "--hard", pin)
    return repo, series, pin


def test_apply_check_revert_roundtrip(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, pin = fake_nemo
    root, head = find_checkout(repo)
    assert head == pin
    st = series_status(root, head, series)
    assert st.state == NOT_APPLIED and st.at_pin
    assert apply(root, head, series).state == APPLIED
    assert "hooked A" in (repo / "nemo_rl/algorithms/grpo.py").read_text()
    assert (repo / "nemo_rl/algorithms/seam.py").exists()
    assert apply(root, head, series).state == APPLIED  # idempotent
    status, left = revert(root, head, series)
    assert status.state == NOT_APPLIED and left == []
    assert git(repo, "status", "--porcelain") == ""  # byte-for-byte back to the pin
    assert revert(root, head, series)[0].state == NOT_APPLIED  # idempotent


def test_cli_exit_codes_and_report(fake_nemo: tuple[Path, Path, str], monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    repo, series, _ = fake_nemo
    monkeypatch.setenv("RLIX_PATCHES_DIR", str(series))
    assert run_cli(action="check", nemo_rl=str(repo)) == 1
    assert "0001-part1.patch: not applied" in capsys.readouterr().out
    assert run_cli(action="apply", nemo_rl=str(repo)) == 0
    assert run_cli(action="check", nemo_rl=str(repo)) == 0
    assert "series" in capsys.readouterr().out
    assert run_cli(action="revert", nemo_rl=str(repo)) == 0
    with pytest.raises(PatchError, match="unknown action"):
        run_cli(action="frobnicate", nemo_rl=str(repo))


def test_not_a_checkout(tmp_path: Path) -> None:
    with pytest.raises(PatchError, match="not a NeMo RL checkout"):
        find_checkout(tmp_path)
    _write(tmp_path, "nemo_rl/algorithms/grpo.py", GRPO)  # right files, but no git
    with pytest.raises(PatchError, match="not the root of a git checkout"):
        find_checkout(tmp_path)


def test_dirty_touched_file_is_refused_untouched_is_fine(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, pin = fake_nemo
    (repo / "nemo_rl/algorithms/grpo.py").write_text(GRPO.replace("line 20\n", "line twenty\n"))
    with pytest.raises(PatchError, match=r"uncommitted changes in files the series touches: nemo_rl/algorithms/grpo\.py"):
        apply(repo, pin, series)
    assert "hooked" not in (repo / "nemo_rl/algorithms/grpo.py").read_text()
    git(repo, "checkout", "-q", ".")
    (repo / "README.md").write_text("my notes\n")
    assert apply(repo, pin, series).state == APPLIED


def test_drift_names_file_and_hunk_and_changes_nothing(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, pin = fake_nemo
    (repo / "nemo_rl/algorithms/grpo.py").write_text(GRPO.replace("line 35\n", "line 35 changed upstream\n"))
    st = series_status(repo, pin, series)
    assert st.state == DRIFTED
    [drifted] = [p for p in st.patches if p.state == DRIFTED]
    assert drifted.patch.name == "0001-part1.patch"
    assert len(drifted.drift) == 1 and drifted.drift[0].startswith("nemo_rl/algorithms/grpo.py: hunk 2/2 @@")
    assert "drifted: nemo_rl/algorithms/grpo.py: hunk 2/2" in st.report()
    before = (repo / "nemo_rl/algorithms/grpo.py").read_text()
    with pytest.raises(PatchError, match="drifted"):
        apply(repo, pin, series)
    assert (repo / "nemo_rl/algorithms/grpo.py").read_text() == before
    assert not (repo / "nemo_rl/algorithms/seam.py").exists()


def test_unknown_version(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, _ = fake_nemo
    (repo / "nemo_rl/models/other.py").write_text(OTHER.replace("other 10\n", "other 10 upstream\n"))
    git(repo, "commit", "-qam", "upstream moved on")
    head = git(repo, "rev-parse", "HEAD")
    with pytest.raises(PatchError, match=r"unknown NeMo RL version: HEAD \w+ is not a pinned commit .*other\.py: hunk 1/1"
                                         r".*Supported: NeMo RL at \w{7} \(commit \w{7}\)"):
        series_status(repo, head, series)


def test_a_release_checkout_gets_its_release_series_by_version(fake_nemo: tuple[Path, Path, str]) -> None:
    """A release moved a line the pin's series changes; the release has its own series (series.json names the
    release). A user's commit on top of the release still gets it (by nemo_rl's version, not by HEAD); a local
    change on a line that series changes is refused naming the release."""
    repo, series, _ = fake_nemo
    _write(repo, "nemo_rl/package_info.py", 'MAJOR = 0\nMINOR = 7\nPATCH = 0\nPRE_RELEASE = ""\n')
    (repo / "nemo_rl/models/other.py").write_text(OTHER.replace("other 10\n", "other 10 released\n"))
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "release 0.7.0")
    release = git(repo, "rev-parse", "HEAD")
    _write(repo, "nemo_rl/algorithms/seam.py", "SEAM = 1\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "seam")
    (repo / "nemo_rl/models/other.py").write_text(OTHER.replace("other 10\n", "other ten\n"))
    git(repo, "commit", "-qam", "other")
    out = series / release[:7]
    git(repo, "format-patch", "-q", "-2", "--zero-commit", "--no-signature", "-o", str(out), "HEAD")
    for i, p in enumerate(sorted(out.iterdir()), start=1):
        p.rename(out / f"{i:04d}-part{i}.patch")
    (out / "series.json").write_text('{"describes": "NeMo RL v0.7.0", "release": "0.7.0"}')
    git(repo, "reset", "-q", "--hard", release)
    _write(repo, "NOTES.md", "my notes\n")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "a user's commit on the release")
    st = series_status(repo, git(repo, "rev-parse", "HEAD"), series)
    assert (st.series.name, st.series.release, st.state, st.at_pin) == (release[:7], "0.7.0", NOT_APPLIED, False)
    (repo / "nemo_rl/models/other.py").write_text(OTHER.replace("other 10\n", "other 10 mine\n"))
    git(repo, "commit", "-qam", "a local change where the series edits")
    with pytest.raises(PatchError, match=r"NeMo RL 0\.7\.0 at HEAD \w+ is not the v0\.7\.0 release commit "
                                         r".*other\.py: hunk 1/1.*git checkout v0\.7\.0"):
        series_status(repo, git(repo, "rev-parse", "HEAD"), series)


def test_other_commit_where_series_applies_cleanly(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, _ = fake_nemo
    (repo / "README.md").write_text("newer upstream readme\n")
    git(repo, "commit", "-qam", "unrelated upstream commit")
    head = git(repo, "rev-parse", "HEAD")
    st = apply(repo, head, series)
    assert st.state == APPLIED and not st.at_pin
    assert "not the pin" in st.report()


def test_git_apply_is_all_or_nothing(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, _ = fake_nemo
    (repo / "nemo_rl/models/other.py").write_text("rewritten\n")  # 0002 cannot apply; 0001 could
    patches = load_series(series / next(iter(series.iterdir())).name).patches
    with pytest.raises(PatchError, match="nothing was changed"):
        _run_git_apply(repo, patches, reverse=False)
    assert (repo / "nemo_rl/algorithms/grpo.py").read_text() == GRPO
    assert not (repo / "nemo_rl/algorithms/seam.py").exists()


def test_partial_state_apply_refuses_revert_restores(fake_nemo: tuple[Path, Path, str]) -> None:
    repo, series, pin = fake_nemo
    first = sorted((series / pin[:7]).iterdir())[0]
    git(repo, "apply", str(first))
    st = series_status(repo, pin, series)
    assert st.state == PARTIAL and [p.state for p in st.patches] == [APPLIED, NOT_APPLIED]
    with pytest.raises(PatchError, match=r"partially applied.*rlix patch revert"):
        apply(repo, pin, series)
    assert revert(repo, pin, series)[0].state == NOT_APPLIED
    assert git(repo, "status", "--porcelain") == ""


#: The shipped series: NeMo RL main at the pin, and the v0.7.0 release (series name, its loops part, their files).
SHIPPED = {
    "7ea279a": (["0005", "0006", "0007"], {"nemo_rl/algorithms/grpo_sync.py", "nemo_rl/algorithms/single_controller.py",
                                           "nemo_rl/algorithms/single_controller_utils/setup.py",
                                           "nemo_rl/data_plane/adapters/transfer_queue.py"}),
    "81aa43d": (["0005", "0007"], {"nemo_rl/algorithms/grpo_sync.py",  # v0.7.0 has no SingleController loop
                                   "nemo_rl/data_plane/adapters/transfer_queue.py"}),
}


def _shipped(name: str) -> Series:
    series = {s.name: s for s in discover_series(DEFAULT_SERIES_ROOT)}
    assert sorted(series) == sorted(SHIPPED), sorted(series)
    return series[name]


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_real_series_shape(name: str) -> None:
    """Each shipped series: named by its commit (recorded in its apis.json), numbered patches, the seam file
    identical in every series, small (README: ~300 changed lines, 342 / 345 with the setup() placement seam, the
    per-call sleep level and token-only requests, justified there; v0.7.0's 0003 also backports main's collective_rpc
    pass-through)."""
    series = _shipped(name)
    assert json.loads((series.directory / "apis.json").read_text())["commit"].startswith(series.name)
    names = [p.name for p in series.patches]
    assert names == sorted(names) and all(n[:4].isdigit() for n in names)
    touched = set(series.touched_paths)
    assert {"nemo_rl/algorithms/rlix_hooks.py", "nemo_rl/algorithms/grpo.py"} <= touched
    assert all(p.startswith("nemo_rl/") for p in touched), touched  # no test, config or doc files of NeMo RL
    assert series.patches[0].text == _shipped("7ea279a").patches[0].text  # one hook seam (0001) for every version
    changed = sum(p.changed_lines for p in series.part(""))
    assert 0 < changed <= 345, changed


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_real_loops_part_shape(name: str) -> None:
    """The second part (``loops/``: the TransferQueue and SingleController GRPO loops, those the version has)
    follows the first, touches only those loops' files, and has its own cap (221 changed lines since the pickled TQ
    client's scope, 2026-11-25)."""
    series = _shipped(name)
    numbers, files = SHIPPED[name]
    loops = series.part("loops")
    assert [p.name[:4] for p in loops] == numbers
    assert [p.name for p in series.patches][-len(loops):] == [p.name for p in loops]  # applied after the first part
    touched = {t for p in loops for t in p.touched_paths}
    assert touched == files, touched
    changed = sum(p.changed_lines for p in loops)
    assert 0 < changed <= 225, changed


def test_revert_after_the_series_changed_uses_the_recorded_copy(fake_nemo: tuple[Path, Path, str]) -> None:
    """Applied by an older rlix-plugins, reverted by a newer one whose series differs."""
    repo, series, pin = fake_nemo
    assert apply(repo, pin, series).state == APPLIED
    newer = sorted((series / pin[:7]).iterdir())[0]
    newer.write_text(newer.read_text().replace("+hooked A", "+hooked A, improved"))
    assert series_status(repo, pin, series).state == DRIFTED
    status, _ = revert(repo, pin, series)
    assert status.state == NOT_APPLIED
    assert git(repo, "status", "--porcelain") == ""
