"""Test helpers about the repository itself."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


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
