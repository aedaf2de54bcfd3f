"""``rlix patch apply|check|revert|drift --nemo-rl PATH``: the pinned NeMo RL patch series (``drift``:
``patch_drift``).

A series is a directory ``patches/nemo-rl/<commit prefix>/`` of numbered ``0001-*.patch`` files (git
format-patch output) applied in name order, then those of its ``loops/`` part (NeMo RL's TransferQueue and
SingleController GRPO loops); the parts are applied, checked and reverted together. One series per supported NeMo
RL version (the pinned main commit, the v0.7.0 release), chosen by the checkout's ``HEAD`` (the directory name is a
prefix of it); when ``HEAD`` is not a pinned commit, the series of the checkout's release (``series.json``'s
``release`` against ``nemo_rl/package_info.py``) comes first, then the others, and one is used only if it applies
(or is applied) cleanly, hunk for hunk. Otherwise the refusal lists the supported versions.

States (per patch and for the series): ``applied`` (the patch reverts cleanly), ``not applied`` (it
applies cleanly), ``drifted`` (neither; the report names the file and hunk). ``apply`` and ``revert`` are
all or nothing: one ``git apply`` call over every patch, which writes nothing when any hunk fails.
They refuse checkouts whose touched files carry uncommitted changes (``apply``) and partial states.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins import envs
from rlix_plugins._patch_series import Patch, Series, discover_series
from rlix_plugins.errors import PatchError

APPLIED = "applied"
NOT_APPLIED = "not applied"
DRIFTED = "drifted"
PARTIAL = "partially applied"

#: The series ships inside the package (wheel package data; ``patches/nemo-rl`` of a checkout links here);
#: ``RLIX_PATCHES_DIR`` overrides it.
DEFAULT_SERIES_ROOT = Path(__file__).resolve().parent / "patches" / "nemo-rl"
_GIT_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class PatchState:
    patch: Patch
    state: str  # APPLIED, NOT_APPLIED or DRIFTED
    #: For DRIFTED: one line per hunk that neither applies nor reverts ("file: hunk i/n @@ ... @@").
    drift: tuple[str, ...] = ()


@dataclass(frozen=True)
class SeriesStatus:
    checkout: Path
    head: str
    series: Series
    patches: tuple[PatchState, ...]
    #: True when HEAD is the commit the series was written for.
    at_pin: bool

    @property
    def state(self) -> str:
        states = {p.state for p in self.patches}
        if DRIFTED in states:
            return DRIFTED
        if states == {APPLIED}:
            return APPLIED
        if states == {NOT_APPLIED}:
            return NOT_APPLIED
        return PARTIAL

    def report(self) -> str:
        pin = "the pinned commit" if self.at_pin else f"not the pin {self.series.name} (series chosen by content)"
        lines = [f"NeMo RL checkout {self.checkout} at {self.head[:12]} ({pin}): series {self.series.name} {self.state}"]
        for p in self.patches:
            lines.append(f"  {p.patch.part + '/' if p.patch.part else ''}{p.patch.name}: {p.state}")
            lines.extend(f"    drifted: {d}" for d in p.drift)
        if self.series.lacks:
            lines.append(f"  not time-shared at this version: {self.series.lacks}")
        return "\n".join(lines)


def _git(checkout: Path, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", "-C", str(checkout), *args],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError:
        raise PatchError("`git` is not installed or not on PATH; rlix patch needs it") from None
    except subprocess.TimeoutExpired:
        raise PatchError(f"`git {' '.join(args)}` in {checkout} did not finish in {_GIT_TIMEOUT_S:.0f} s") from None


def find_checkout(path: str | os.PathLike[str]) -> tuple[Path, str]:
    """Returns (root, HEAD commit) of the NeMo RL git checkout at ``path``; PatchError if it is not one."""
    root = Path(path).expanduser().resolve()
    if not (root / "nemo_rl" / "algorithms" / "grpo.py").is_file():
        raise PatchError(
            f"{root} is not a NeMo RL checkout (no nemo_rl/algorithms/grpo.py); pass the repository root "
            "of a clone of https://github.com/NVIDIA-NeMo/RL"
        )
    top = _git(root, "rev-parse", "--show-toplevel")
    if top.returncode != 0 or Path(top.stdout.strip()).resolve() != root:
        raise PatchError(f"{root} is not the root of a git checkout (rlix patch needs git to apply and check)")
    head = _git(root, "rev-parse", "HEAD")
    if head.returncode != 0:
        raise PatchError(f"cannot read HEAD of {root}: {head.stderr.strip()}")
    return root, head.stdout.strip()


def _applies(checkout: Path, text: str, *, reverse: bool, context: int | None = None) -> bool:
    """Whether ``text`` applies (``reverse``: reverts); ``context``: with only that many lines of context matching."""
    args = ["apply", "--check", *(["--reverse"] if reverse else []), *([f"-C{context}"] if context is not None else []),
            "-"]
    return _git(checkout, *args, stdin=text).returncode == 0


def _patch_state(checkout: Path, patch: Patch) -> PatchState:
    if _applies(checkout, patch.text, reverse=True):
        return PatchState(patch, APPLIED)
    if _applies(checkout, patch.text, reverse=False):
        return PatchState(patch, NOT_APPLIED)
    drift = tuple(
        f"{h.path}: hunk {h.index}/{h.count} {h.header}"
        for h in patch.hunks
        if not _applies(checkout, h.text, reverse=False) and not _applies(checkout, h.text, reverse=True)
    )
    return PatchState(patch, DRIFTED, drift or ("hunks apply one by one but not together",))


def _states(checkout: Path, series: Series) -> tuple[PatchState, ...]:
    # Whole series first: later patches may build on earlier ones (same file), so one patch alone can look drifted.
    whole = "".join(p.text for p in series.patches)
    if _applies(checkout, "".join(p.text for p in reversed(series.patches)), reverse=True):
        return tuple(PatchState(p, APPLIED) for p in series.patches)
    if _applies(checkout, whole, reverse=False):
        return tuple(PatchState(p, NOT_APPLIED) for p in series.patches)
    return tuple(_patch_state(checkout, p) for p in series.patches)


def candidate_series(head: str, series_root: Path) -> tuple[Series | None, list[Series]]:
    """(the series pinned to ``head`` or None, every series under ``series_root``, newest name last)."""
    candidates = discover_series(series_root)
    if not candidates:
        raise PatchError(f"no patch series found under {series_root}; reinstall rlix-plugins")
    return next((s for s in candidates if head.startswith(s.name)), None), candidates


def series_status(checkout: Path, head: str, series_root: Path | None = None) -> SeriesStatus:
    """The state of the series matching ``head``; failing that, the one of the checkout's release
    (``nemo_rl/package_info.py``), then any one that fits the files. Each of the latter only if it applies or is
    applied cleanly, hunk for hunk."""
    pinned, candidates = candidate_series(head, series_root or _series_root())
    if pinned is not None:
        return SeriesStatus(checkout, head, pinned, _states(checkout, pinned), True)
    release = nemo_rl_release(checkout)
    of_release = [s for s in candidates if s.release is not None and s.release == release]
    fallback: SeriesStatus | None = None
    for series in of_release + [s for s in candidates if s not in of_release]:
        status = SeriesStatus(checkout, head, series, _states(checkout, series), False)
        if status.state in (APPLIED, NOT_APPLIED, PARTIAL):
            return status
        fallback = fallback or status
    assert fallback is not None
    drift = "; ".join(d for p in fallback.patches for d in p.drift)
    supported = "; ".join(f"{s.describes} (commit {s.name})" for s in candidates)
    if of_release:
        raise PatchError(
            f"NeMo RL {release} at HEAD {head[:12]} is not the v{release} release commit ({of_release[0].name}) and "
            f"its series does not apply cleanly (drift: {drift}); check out the release (`git checkout v{release}`) "
            "or move your own changes off the lines the series changes"
        )
    version = f" (nemo_rl {release})" if release else ""
    raise PatchError(
        f"unknown NeMo RL version: HEAD {head[:12]}{version} is not a pinned commit and no series applies cleanly "
        f"(drift against {fallback.series.name}: {drift}). Supported: {supported}; check out one of them or "
        "upgrade rlix-plugins"
    )


_VERSION_PART = re.compile(r"^(MAJOR|MINOR|PATCH|PRE_RELEASE)\s*=\s*(.+?)\s*$", re.MULTILINE)


def nemo_rl_release(checkout: Path) -> str | None:
    """``MAJOR.MINOR.PATCH`` + ``PRE_RELEASE`` from the checkout's ``nemo_rl/package_info.py`` (read, not imported:
    importing it runs git); None when the file or a part is missing."""
    try:
        text = (checkout / "nemo_rl" / "package_info.py").read_text(encoding="utf-8")
    except OSError:
        return None
    parts = {k: v.strip("\"'") for k, v in _VERSION_PART.findall(text)}
    if not {"MAJOR", "MINOR", "PATCH"} <= set(parts):
        return None
    return f"{parts['MAJOR']}.{parts['MINOR']}.{parts['PATCH']}{parts.get('PRE_RELEASE', '')}"


def _series_root() -> Path:
    return envs.patches_dir() or DEFAULT_SERIES_ROOT


def _dirty(checkout: Path, paths: Sequence[str]) -> list[str]:
    out = _git(checkout, "status", "--porcelain", "--untracked-files=all", "--", *paths)
    if out.returncode != 0:
        raise PatchError(f"git status failed in {checkout}: {out.stderr.strip()}")
    return [line[3:] for line in out.stdout.splitlines() if line.strip()]


def _run_git_apply(checkout: Path, patches: Sequence[Patch], *, reverse: bool) -> None:
    """One ``git apply`` over the concatenated patches: a single patch input is all or nothing (several patch
    files on one command line are NOT: git writes the ones before the first failure)."""
    ordered = list(reversed(patches)) if reverse else list(patches)
    args = ["apply", "--whitespace=nowarn", *(["--reverse"] if reverse else []), "-"]
    out = _git(checkout, *args, stdin="".join(p.text for p in ordered))
    if out.returncode != 0:
        what = "revert" if reverse else "apply"
        raise PatchError(f"git apply failed to {what} the series (nothing was changed): {out.stderr.strip()}")


def apply(checkout: Path, head: str, series_root: Path | None = None) -> SeriesStatus:
    status = series_status(checkout, head, series_root)
    if status.state == APPLIED:
        return status
    if status.state != NOT_APPLIED:
        raise PatchError(
            f"series {status.series.name} is {status.state} in {checkout}; "
            + ("run `rlix patch revert` first" if status.state == PARTIAL else "see `rlix patch check`")
        )
    dirty = _dirty(checkout, status.series.touched_paths)
    if dirty:
        raise PatchError(
            f"uncommitted changes in files the series touches: {', '.join(dirty)}; commit or discard them first"
        )
    _run_git_apply(checkout, status.series.patches, reverse=False)
    # Keep exactly what was applied, so a later rlix-plugins with a changed series can still revert it.
    record = _applied_record(checkout)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text("".join(p.text for p in status.series.patches), encoding="utf-8")
    return series_status(checkout, head, series_root)


def _applied_record(checkout: Path) -> Path:
    out = _git(checkout, "rev-parse", "--git-dir")
    if out.returncode != 0:
        raise PatchError(f"cannot find the git directory of {checkout}: {out.stderr.strip()}")
    return (checkout / out.stdout.strip()).resolve() / "rlix" / "applied-series.patch"


def revert(checkout: Path, head: str, series_root: Path | None = None) -> tuple[SeriesStatus, list[str]]:
    """Reverts the applied patches. Returns the new status and the touched files still modified."""
    status = series_status(checkout, head, series_root)
    record = _applied_record(checkout)
    if status.state == DRIFTED:
        # Applied by an earlier rlix-plugins whose series differs: revert exactly what it recorded.
        old = record.read_text(encoding="utf-8") if record.exists() else None
        if old is None or not _applies(checkout, old, reverse=True):
            raise PatchError(f"series {status.series.name} has drifted in {checkout}; see `rlix patch check`")
        out = _git(checkout, "apply", "--reverse", "--whitespace=nowarn", "-", stdin=old)
        if out.returncode != 0:
            raise PatchError(f"git apply failed to revert the recorded series (nothing was changed): {out.stderr}")
    else:
        applied = [p.patch for p in status.patches if p.state == APPLIED]
        if applied:
            _run_git_apply(checkout, applied, reverse=True)
    record.unlink(missing_ok=True)
    return series_status(checkout, head, series_root), _dirty(checkout, status.series.touched_paths)


def run_cli(*, action: str, nemo_rl: str) -> int:
    """``rlix patch``. Exit codes: 0 done / applied, 1 ``check``: not applied, 2 errors and drift (``drift``: see
    ``DriftReport.exit_code``)."""
    checkout, head = find_checkout(nemo_rl)
    if action == "drift":
        from rlix_plugins.patch_drift import drift

        report = drift(checkout, head, _series_root())
        print(report.report())
        return report.exit_code
    if action == "check":
        status = series_status(checkout, head)
        print(status.report())
        record = _applied_record(checkout)
        if status.state == DRIFTED and record.exists() and _applies(checkout, record.read_text(), reverse=True):
            print("note: an earlier rlix-plugins series is applied; `rlix patch revert` then `rlix patch apply`")
        return {APPLIED: 0, NOT_APPLIED: 1}.get(status.state, 2)
    if action == "apply":
        before = series_status(checkout, head).state
        status = apply(checkout, head)
        print(status.report() if before != APPLIED else f"already applied: {status.report()}")
        return 0
    if action == "revert":
        status, left = revert(checkout, head)
        print(status.report())
        if left:
            print(f"note: your other uncommitted changes in {', '.join(left)} were kept", file=sys.stderr)
        return 0
    raise PatchError(f"unknown action {action!r}; valid: apply, check, revert, drift")
