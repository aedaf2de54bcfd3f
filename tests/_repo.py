"""Test helpers about the repository itself."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(path: Path, name: str) -> ModuleType:
    """A script of the repository (not a package module) imported from its file, as ``name``."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def copy_tracked(dst: Path) -> None:
    """The files git tracks (plus working-tree edits), without build leftovers or venvs."""
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    for rel in filter(None, out.decode().split("\0")):
        src, target = REPO / rel, dst / rel
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the working tree
        target.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        else:
            shutil.copy2(src, target)
