"""Reading a patch series: ``<root>/<commit prefix>/NNNN-*.patch`` files (git format-patch output).

A series has parts: the patches of its directory (part ``""``, the async-GRPO seam) and those of its
:data:`PARTS` subdirectories (``loops/``: NeMo RL's other GRPO loops), applied after them as one series.
Each part has its own size cap (``tests/test_patching.py``).

Pure parsing, no git: a :class:`Patch` is split into per-file hunks so that ``rlix patch check`` can name
the hunk that drifted, and each hunk is a self-contained patch text (file header + one hunk).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins.errors import PatchError

_PATCH_NAME = re.compile(r"^\d{4}-[A-Za-z0-9._-]+\.patch$")
_SERIES_NAME = re.compile(r"^[0-9a-f]{7,40}$")
#: Subdirectories of a series directory holding further parts, in application order.
PARTS = ("loops",)
#: Per-series facts next to the patches (what NeMo RL version it is for).
SERIES_FILE = "series.json"


@dataclass(frozen=True)
class Hunk:
    path: str  # file the hunk changes, relative to the checkout root
    index: int  # 1-based position among the hunks of that file in this patch
    count: int  # hunks of that file in this patch
    header: str  # the "@@ -a,b +c,d @@ context" line
    text: str  # file header + this hunk: a patch git can apply on its own


@dataclass(frozen=True)
class Patch:
    name: str
    path: Path
    text: str
    hunks: tuple[Hunk, ...]
    part: str = ""  # "" (the series directory) or one of PARTS

    @property
    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.path for h in self.hunks))

    @property
    def changed_lines(self) -> int:
        """Added plus removed lines (what `git diff --stat` counts)."""
        return sum(
            1
            for h in self.hunks
            for line in h.text.splitlines()[_header_len(h.text) :]
            if line[:1] in "+-" and not line.startswith(("+++", "---"))
        )


@dataclass(frozen=True)
class Series:
    name: str  # the commit prefix the series was written for
    directory: Path
    patches: tuple[Patch, ...]
    #: What the series was written for, for people ("NeMo RL v0.7.0"); from ``series.json``'s ``describes``.
    describes: str = ""
    #: The NeMo RL release the commit is (``nemo_rl.__version__`` without a local part, e.g. ``0.7.0``); None for a
    #: main commit (main's package_info lags its releases, so a version never identifies one).
    release: str | None = None
    #: Loops this version of NeMo RL does not have, said by ``rlix patch`` (``series.json``'s ``lacks``).
    lacks: str | None = None

    @property
    def touched_paths(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p for patch in self.patches for p in patch.touched_paths))

    def part(self, name: str) -> tuple[Patch, ...]:
        """The patches of one part (``""``: the series directory itself)."""
        return tuple(p for p in self.patches if p.part == name)


def _header_len(hunk_text: str) -> int:
    lines = hunk_text.splitlines()
    return next(i for i, line in enumerate(lines) if line.startswith("@@ "))


def parse_patch(path: Path, part: str = "") -> Patch:
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    files: list[tuple[list[str], list[list[str]]]] = []  # (file header, hunks)
    header: list[str] | None = None
    hunks: list[list[str]] = []
    for line in lines:
        if line.startswith("diff --git "):
            if header is not None:
                files.append((header, hunks))
            header, hunks = [line], []
        elif header is None:
            continue  # mail header, commit message, diffstat
        elif line == "-- \n" and hunks:
            files.append((header, hunks))  # format-patch signature: the end of the diff
            header, hunks = None, []
        elif line.startswith("@@ "):
            hunks.append([line])
        elif hunks:
            hunks[-1].append(line)
        else:
            header.append(line)
    if header is not None:
        files.append((header, hunks))
    if not files:
        raise PatchError(f"{path} contains no diff; a series holds `git format-patch` files")
    result: list[Hunk] = []
    for file_header, file_hunks in files:
        target = _target_path(file_header, path)
        if not file_hunks:
            raise PatchError(f"{path}: the diff of {target} has no hunks (mode-only or binary patches are not supported)")
        for i, hunk in enumerate(file_hunks, start=1):
            result.append(Hunk(target, i, len(file_hunks), hunk[0].rstrip("\n"), "".join(file_header + hunk)))
    return Patch(path.name, path, text, tuple(result), part)


def _target_path(file_header: list[str], patch_path: Path) -> str:
    for line in file_header:
        if line.startswith("+++ b/"):
            return line[6:].rstrip("\n")
    for line in file_header:
        if line.startswith("--- a/"):
            return line[6:].rstrip("\n")
    raise PatchError(f"{patch_path}: cannot find the file name in {file_header[0].strip()!r}")


def _patch_names(directory: Path) -> list[str]:
    names = sorted(p.name for p in directory.iterdir() if p.suffix == ".patch")
    bad = [n for n in names if not _PATCH_NAME.match(n)]
    if bad:
        raise PatchError(f"{directory}: patch names must look like 0001-what.patch, got {bad}")
    return names


def load_series(directory: Path) -> Series:
    names = _patch_names(directory)
    if not names:
        raise PatchError(f"{directory} holds no .patch files")
    patches = [parse_patch(directory / n) for n in names]
    for part in PARTS:
        if (directory / part).is_dir():
            patches += [parse_patch(directory / part / n, part) for n in _patch_names(directory / part)]
    describes, release, lacks = _about(directory)
    return Series(directory.name, directory, tuple(patches), describes, release, lacks)


def _about(directory: Path) -> tuple[str, str | None, str | None]:
    """``series.json``: ``{"describes": "NeMo RL v0.7.0", "release": "0.7.0", "lacks": "..."}`` (all optional)."""
    path = directory / SERIES_FILE
    if not path.is_file():
        return f"NeMo RL at {directory.name}", None, None
    try:
        about = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PatchError(f"{path}: not valid JSON ({exc}); reinstall rlix-plugins") from None
    release, lacks = about.get("release"), about.get("lacks")
    return (str(about.get("describes") or f"NeMo RL at {directory.name}"), None if release is None else str(release),
            None if lacks is None else str(lacks))


def discover_series(root: Path) -> list[Series]:
    """Every series under ``root`` (directories named by a commit prefix), newest name last."""
    if not root.is_dir():
        return []
    return [load_series(d) for d in sorted(root.iterdir()) if d.is_dir() and _SERIES_NAME.match(d.name)]
