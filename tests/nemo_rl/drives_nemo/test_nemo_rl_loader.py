"""The seam's loader in fresh interpreters: unset → nothing imported; set without a plugin (or without pluggy)
→ a clear error; unknown value → an error listing the valid values; set with rlix-plugins → our hooks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.nemo_rl._nemo_checkout import nemo_env, nemo_python

pytestmark = pytest.mark.nemo_rl

# Imports the seam file by path: no nemo_rl package import (so no torch) and no site-packages with -S.
_LOAD = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("rlix_hooks", sys.argv[1])
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
hooks = mod.load_rlix_hooks()
print("HOOKS", None if hooks is None else type(hooks.plugin_manager.get_plugin("rlix")).__module__)
print("MODULES", sorted(m for m in sys.modules if m.split(".")[0] in ("pluggy", "rlix_plugins")))
"""


def _bare_python(seam: Path, value: str | None, extra_path: list[Path]) -> subprocess.CompletedProcess[str]:
    """System-less interpreter (-S: no site-packages, so rlix-plugins is NOT installed for it). -P and a neutral
    working directory: an ``rlix_plugins.egg-info`` in the repository root (editable install) stays invisible."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.pathsep.join(map(str, extra_path))}
    if value is not None:
        env["RLIX_CONTROL_PLANE"] = value
    return subprocess.run([sys.executable, "-S", "-P", "-c", _LOAD, str(seam)], env=env, capture_output=True,
                          text=True, timeout=60, cwd=seam.parent)


@pytest.fixture(scope="module")
def pluggy_only(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding only the pluggy package (linked from this interpreter's site-packages)."""
    import pluggy

    d = tmp_path_factory.mktemp("pluggy_only")
    (d / "pluggy").symlink_to(Path(pluggy.__file__).parent)
    return d


def _seam(nemo_copies: dict[str, Path]) -> Path:
    return nemo_copies["patched"] / "nemo_rl" / "algorithms" / "rlix_hooks.py"


@pytest.mark.parametrize("value", [None, ""])
def test_unset_imports_nothing(nemo_copies: dict[str, Path], pluggy_only: Path, value: str | None) -> None:
    out = _bare_python(_seam(nemo_copies), value, [pluggy_only])
    assert out.returncode == 0, out.stderr
    assert "HOOKS None" in out.stdout and "MODULES []" in out.stdout, out.stdout


def test_set_without_plugin_is_a_clear_error(nemo_copies: dict[str, Path], pluggy_only: Path) -> None:
    out = _bare_python(_seam(nemo_copies), "rlix", [pluggy_only])
    assert out.returncode != 0
    assert "no implementation is registered under the entry-point group 'nemo_rl.rlix_hooks'" in out.stderr
    assert "pip install rlix-plugins" in out.stderr


def test_set_without_pluggy_is_a_clear_error(nemo_copies: dict[str, Path]) -> None:
    out = _bare_python(_seam(nemo_copies), "rlix", [])
    assert out.returncode != 0 and "needs the 'pluggy' package" in out.stderr, out.stderr


@pytest.mark.parametrize("value", ["RLIX", "ray", "none"])
def test_unknown_value_is_an_error(nemo_copies: dict[str, Path], pluggy_only: Path, value: str) -> None:
    out = _bare_python(_seam(nemo_copies), value, [pluggy_only])
    assert out.returncode != 0
    assert f"RLIX_CONTROL_PLANE={value!r} is not a known control plane" in out.stderr, out.stderr


def test_set_with_rlix_plugins_loads_our_hooks(nemo_copies: dict[str, Path]) -> None:
    """In the conformance venv (rlix-plugins installed): the entry point resolves to our implementation."""
    patched = nemo_copies["patched"]
    env = nemo_env(patched, RLIX_CONTROL_PLANE="rlix")
    out = subprocess.run([str(nemo_python()), "-c", _LOAD, str(_seam(nemo_copies))], env=env, cwd=patched,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "HOOKS rlix_plugins.nemo_rl.hooks" in out.stdout, out.stdout
