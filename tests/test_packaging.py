"""What the wheel carries: the NeMo RL patch series, so ``rlix patch`` works for a user who pip-installed rlix-plugins
(no checkout, no ``RLIX_PATCHES_DIR``); and no test harness (``tests/harness``)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests._repo import copy_tracked

REPO = Path(__file__).resolve().parents[1]
#: Test harness that once shipped in the wheel (it now lives in tests/harness): it drives or breaks the product and
#: no ``rlix`` command uses it.
HARNESS = ("rlix_plugins.testing", "rlix_plugins.testing.local_receiver", "rlix_plugins.demo.chaos",
           "rlix_plugins.demo.fault_file", "rlix_plugins.demo.fault_worker")


@pytest.mark.timeout(300)
def test_wheel_contains_the_patch_series(tmp_path: Path) -> None:
    src = tmp_path / "src"
    copy_tracked(src)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                           str(tmp_path / "dist"), str(src)], capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [wheel] = list((tmp_path / "dist").glob("rlix_plugins-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    series = sorted(n for n in names if n.startswith("rlix_plugins/patches/nemo-rl/"))
    root = REPO / "rlix_plugins/patches/nemo-rl"
    repo_series = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert series == [f"rlix_plugins/patches/nemo-rl/{n}" for n in repo_series], series  # every version's series
    for pin in ("7ea279a", "81aa43d"):  # NeMo RL main at the pin, v0.7.0
        assert any(n.startswith(f"rlix_plugins/patches/nemo-rl/{pin}/loops/") for n in series)  # the second part
        assert f"rlix_plugins/patches/nemo-rl/{pin}/series.json" in series
    assert any(n.endswith(".patch") for n in series)
    assert "rlix_plugins/transport/_pack_checksum.c" in names  # the CPU pack kernel is compiled from it at first use

    # Installed from the wheel (extracted as site-packages would hold it), the default root finds the series.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = ("from rlix_plugins.patching import DEFAULT_SERIES_ROOT, discover_series;"
            "print(DEFAULT_SERIES_ROOT); print([s.name for s in discover_series(DEFAULT_SERIES_ROOT)])")
    env = {k: v for k, v in os.environ.items() if k != "RLIX_PATCHES_DIR"}
    env["PYTHONPATH"] = str(site)
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    root, found = run.stdout.splitlines()
    assert root.startswith(str(site)) and found == "['7ea279a', '81aa43d']"


def test_test_harness_stays_out_of_the_package() -> None:
    """The wheel ships every module under ``rlix_plugins/`` (``packages.find`` includes ``rlix_plugins*``), so the
    harness must not be there; and no shipped module may import it (``tests`` is not installed for users)."""
    pkg = REPO / "rlix_plugins"
    modules = {".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__") for p in pkg.rglob("*.py")}
    back = sorted(set(HARNESS) & modules)
    assert not back, f"test harness in the package (it would ship in the wheel): {back}; it belongs in tests/harness"
    importers = sorted(str(p.relative_to(REPO)) for p in pkg.rglob("*.py")
                       if re.search(r"^\s*(from|import)\s+tests\b", p.read_text(), re.MULTILINE))
    assert not importers, f"shipped modules import the test harness: {importers}"
    for name in ("tests.harness.chaos", "tests.harness.fault_worker", "tests.harness.local_receiver"):
        assert importlib.util.find_spec(name) is not None, name
