"""``rlix patch drift`` through the CLI, against a small synthetic NeMo RL git checkout and a series made with git
format-patch (runs in CI without NeMo RL), and the shipped record of signatures against the pinned checkout
(``NEMO_RL_SRC``)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from rlix_plugins._patch_series import discover_series, load_series
from rlix_plugins.cli import main
from rlix_plugins.errors import PatchError
from rlix_plugins.patch_drift import APIS_FILE, record_apis, signatures
from rlix_plugins.patching import DEFAULT_SERIES_ROOT

GRPO = '''def setup(config, tokenizer):
    a = 1
    b = 2
    c = 3
    return a + b + c


def train(policy, steps: int = 1) -> None:
    x = 1
    y = 2
    z = 3
    w = 4
    print(x, y, z, w)
'''


def git(repo: Path, *args: str) -> str:
    out = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=30)
    return out.stdout.strip()


def commit(repo: Path, text: str, message: str) -> None:
    (repo / "nemo_rl/algorithms/grpo.py").write_text(text)
    git(repo, "commit", "-qam", message)


@pytest.fixture
def fake(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(checkout at the pin, series directory with its apis.json). The series hooks one line into each function."""
    repo = tmp_path / "RL"
    (repo / "nemo_rl/algorithms").mkdir(parents=True)
    git(repo, "init", "-q")
    git(repo, "config", "user.email", "t@example.com")
    git(repo, "config", "user.name", "t")
    (repo / "nemo_rl/algorithms/grpo.py").write_text(GRPO)
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "base")
    pin = git(repo, "rev-parse", "HEAD")
    commit(repo, GRPO.replace("    b = 2\n", "    b = 2\n    hook_a()\n").replace("    z = 3\n", "    z = hook_b()\n"),
           "hooks")
    series = tmp_path / "series" / pin[:7]
    git(repo, "format-patch", "-q", "-1", "--zero-commit", "--no-signature", "-o", str(series), "HEAD")
    next(series.iterdir()).rename(series / "0001-hooks.patch")
    git(repo, "reset", "-q", "--hard", pin)
    record = record_apis(repo, load_series(series), {"nemo_rl/algorithms/grpo.py": ("setup",)})
    (series / APIS_FILE).write_text(json.dumps(record))
    monkeypatch.setenv("RLIX_PATCHES_DIR", str(series.parent))
    return repo, series


def drift(repo: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = main(["patch", "drift", "--nemo-rl", str(repo)])
    return rc, capsys.readouterr().out


def test_record_holds_what_the_hunks_change_and_what_is_called(fake: tuple[Path, Path]) -> None:
    _, series = fake
    record = json.loads((series / APIS_FILE).read_text())
    assert record["apis"] == {"nemo_rl/algorithms/grpo.py": {"setup": "(config, tokenizer)",
                                                             "train": "(policy, steps: int=1) -> None"}}
    assert record["patched"] == {}  # the hooks change bodies only


def test_at_the_pin_and_once_applied_nothing_drifts(fake: tuple[Path, Path],
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    repo, _ = fake
    rc, out = drift(repo, capsys)
    assert rc == 0 and "(2 hunks: 0 applied, 2 clean, 0 fuzz, 0 conflict)" in out
    assert "every recorded signature is unchanged" in out
    assert main(["patch", "apply", "--nemo-rl", str(repo)]) == 0
    rc, out = drift(repo, capsys)
    assert rc == 0 and "2 applied" in out
    assert main(["patch", "revert", "--nemo-rl", str(repo)]) == 0
    assert git(repo, "status", "--porcelain") == ""


def test_moved_neighbours_are_fuzz_a_changed_line_a_conflict_a_new_parameter_a_changed_api(
        fake: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    repo, _ = fake
    # the neighbours of the first hook change: it applies only with less context
    commit(repo, GRPO.replace("    a = 1\n", "    a = 10\n"), "neighbour")
    rc, out = drift(repo, capsys)
    assert rc == 1 and "fuzz: 0001-hooks.patch nemo_rl/algorithms/grpo.py hunk 1/2 @@ -1,6 +1,7 @@" in out
    # the line the second hook rewrites is gone, and setup takes another parameter
    commit(repo, GRPO.replace("    a = 1\n", "    a = 10\n").replace("    z = 3\n", "    z = 30\n").replace(
        "def setup(config, tokenizer):", "def setup(config, tokenizer, processor=None):"), "moved on")
    rc, out = drift(repo, capsys)
    assert rc == 2 and "conflict: 0001-hooks.patch nemo_rl/algorithms/grpo.py hunk 2/2" in out
    assert "1 fuzz, 1 conflict" in out
    assert "setup: changed" in out and "now setup(config, tokenizer, processor=None)" in out
    assert git(repo, "status", "--porcelain") == ""  # read only
    # functions that are gone
    commit(repo, "SETUP = None\n", "rewritten")
    rc, out = drift(repo, capsys)
    assert rc == 2 and "setup: gone (was setup(config, tokenizer))" in out and "train: gone" in out


def test_signatures_of_functions_classes_and_typed_fields() -> None:
    source = '''class Args(TypedDict):
    tp: int
    sleep_level: NotRequired[int]

    def method(self, *a, k: int = 2, **kw) -> bool:
        def inner(): ...
        return True


async def run(x, /, y=1): ...
'''
    assert signatures(source) == {"Args": "(TypedDict) {tp: int; sleep_level: NotRequired[int]}",
                                  "Args.method": "(self, *a, k: int=2, **kw) -> bool", "run": "(x, /, y=1)"}


def test_recording_away_from_the_pin_is_refused(fake: tuple[Path, Path]) -> None:
    repo, series = fake
    commit(repo, GRPO + "\n# later\n", "later")
    with pytest.raises(PatchError, match="at its pin"):
        record_apis(repo, load_series(series), {})


@pytest.mark.skipif(not os.environ.get("NEMO_RL_SRC"),
                    reason="needs a NeMo RL checkout at a supported version (main at 7ea279a, or v0.7.0): set "
                           "NEMO_RL_SRC=/path/to/RL (see README)")
def test_the_shipped_record_is_the_pins(capsys: pytest.CaptureFixture[str]) -> None:
    """apis.json of the checkout's series holds what the checkout says (re-record it with
    scripts/record_nemo_rl_apis.py when the series or the list of called APIs changes), and it drifts nowhere."""
    from rlix_plugins.patching import find_checkout

    checkout = Path(os.environ["NEMO_RL_SRC"])
    _, head = find_checkout(checkout)
    [series] = [s for s in discover_series(DEFAULT_SERIES_ROOT) if head.startswith(s.name)]
    assert json.loads((series.directory / APIS_FILE).read_text()) == record_apis(checkout, series)
    rc, out = drift(checkout, capsys)
    assert rc in (0,) and " 0 fuzz, 0 conflict" in out, out
