"""``rlix patch drift --nemo-rl PATH``: how far a NeMo RL checkout has moved from what a patch series was written for.

``rlix patch check`` says whether the series applies; this says what stands in the way where it does not, before a
pin moves or a new NeMo RL version is supported. Two reports, read only (nothing in the checkout is written):

* **hunks**: every hunk of every patch, alone, against the checkout: ``applied`` (it reverts cleanly), ``clean``,
  ``fuzz`` (it applies only with one line of context: the lines it changes are there, their neighbours moved) or
  ``conflict`` (the lines it changes are gone or different), with the function or class it sits in;
* **APIs**: the NeMo RL functions and classes the series patches or rlix-plugins calls, whose signatures were
  recorded at the pin (the series' ``apis.json``, written by :func:`record_apis`): ``changed`` (old and new
  signature) or ``gone``.

Signatures are read from the source (``ast``), never by importing NeMo RL (its imports need GPUs and packages a
checkout alone does not have).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from rlix_plugins._patch_series import Hunk, Series
from rlix_plugins.errors import PatchError

APPLIED = "applied"
CLEAN = "clean"
FUZZ = "fuzz"
CONFLICT = "conflict"

#: The series' record of signatures at its pin (next to its patches; shipped with them).
APIS_FILE = "apis.json"

#: NeMo RL functions rlix-plugins calls (file -> qualified names), recorded next to those the patches change.
CALLED_APIS: Mapping[str, tuple[str, ...]] = {
    "nemo_rl/algorithms/grpo.py": ("setup", "async_grpo_train"),
    "nemo_rl/algorithms/grpo_sync.py": ("grpo_train_sync",),
    "nemo_rl/models/generation/vllm/vllm_generation.py": (
        "VllmGeneration.prepare_for_generation", "VllmGeneration.finish_generation",
        "VllmGeneration.attach_fleet_health", "VllmGeneration.get_step_metrics", "VllmGeneration.get_logger_metrics"),
    "nemo_rl/distributed/worker_groups.py": ("RayWorkerGroup.get_dp_leader_worker_idx",
                                             "RayWorkerGroup.run_single_worker_single_data"),
    "nemo_rl/algorithms/async_utils/trajectory_collector.py": ("AsyncTrajectoryCollector.set_weight_version",),
    "nemo_rl/algorithms/async_utils/replay_buffer.py": ("ReplayBufferImpl.__init__",),
}

#: Called only where the checkout has them (``hasattr``): NeMo RL main's fleet-health seam; v0.7.0 has none, and
#: its series' patch 0004 reads the router from an attribute instead (``rlix_plugins/nemo_rl/generation.py``).
OPTIONAL_APIS: frozenset[str] = frozenset({"VllmGeneration.attach_fleet_health"})

_OLD_RANGE = re.compile(r"^@@ -(\d+)(?:,(\d+))? ")


@dataclass(frozen=True)
class HunkDrift:
    patch: str
    hunk: Hunk
    state: str  # APPLIED, CLEAN, FUZZ or CONFLICT

    def line(self) -> str:
        return f"{self.state}: {self.patch} {self.hunk.path} hunk {self.hunk.index}/{self.hunk.count} {self.hunk.header}"


@dataclass(frozen=True)
class ApiDrift:
    path: str
    name: str
    old: str
    new: str | None  # None: gone (or its file is)

    def line(self) -> str:
        if self.new is None:
            return f"{self.path} {self.name}: gone (was {self.name}{self.old})"
        return f"{self.path} {self.name}: changed\n      was {self.name}{self.old}\n      now {self.name}{self.new}"


@dataclass(frozen=True)
class DriftReport:
    checkout: Path
    head: str
    series: Series
    hunks: tuple[HunkDrift, ...]
    apis: tuple[ApiDrift, ...]
    #: False when the series ships no record of signatures (APIs not compared).
    apis_recorded: bool

    def count(self, state: str) -> int:
        return sum(h.state == state for h in self.hunks)

    @property
    def exit_code(self) -> int:
        """0: every hunk applies cleanly (or is applied) and no API changed; 1: fuzz or changed APIs only;
        2: a hunk conflicts."""
        if self.count(CONFLICT):
            return 2
        return 1 if self.count(FUZZ) or self.apis else 0

    def report(self) -> str:
        counts = ", ".join(f"{self.count(s)} {s}" for s in (APPLIED, CLEAN, FUZZ, CONFLICT))
        lines = [f"NeMo RL checkout {self.checkout} at {self.head[:12]} against series {self.series.name} "
                 f"({len(self.hunks)} hunks: {counts})"]
        lines += [f"  {h.line()}" for h in self.hunks if h.state in (FUZZ, CONFLICT)]
        if not self.apis_recorded:
            lines.append(f"APIs: not compared (series {self.series.name} has no {APIS_FILE})")
        elif self.apis:
            lines.append(f"APIs changed since {self.series.name}: {len(self.apis)}")
            lines += [f"  {a.line()}" for a in self.apis]
        else:
            lines.append(f"APIs: every recorded signature is unchanged since {self.series.name}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ signatures
def signatures(source: str) -> dict[str, str]:
    """Qualified name -> signature of every function and class of a module's source (nested functions left out).
    A function's is its parameters and return annotation; a class's its bases and annotated fields (TypedDicts,
    dataclasses)."""
    out: dict[str, str] = {}

    def visit(body: Iterable[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                ret = f" -> {ast.unparse(node.returns)}" if node.returns else ""
                out[prefix + node.name] = f"({ast.unparse(node.args)}){ret}"
            elif isinstance(node, ast.ClassDef):
                bases = ", ".join(ast.unparse(b) for b in [*node.bases, *node.keywords])
                fields = "; ".join(f"{ast.unparse(s.target)}: {ast.unparse(s.annotation)}"
                                   for s in node.body if isinstance(s, ast.AnnAssign))
                out[prefix + node.name] = f"({bases})" + (f" {{{fields}}}" if fields else "")
                visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source).body, "")
    return out


def _definitions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and class of a module's source, outer ones first
    (nested functions left out, as in :func:`signatures`)."""
    out: list[tuple[int, int, str]] = []

    def visit(body: Iterable[ast.stmt], prefix: str) -> None:
        for node in body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                out.append((start, node.end_lineno or node.lineno, prefix + node.name))
                if isinstance(node, ast.ClassDef):
                    visit(node.body, f"{prefix}{node.name}.")

    visit(ast.parse(source).body, "")
    return out


def _enclosing(definitions: list[tuple[int, int, str]], line: int) -> str | None:
    """The qualified name of the innermost definition whose lines hold ``line`` (1-based)."""
    holding = [(start, name) for start, end, name in definitions if start <= line <= end]
    return max(holding)[1] if holding else None  # deeper definitions start later: the innermost wins


def _changed_lines(hunk: Hunk) -> tuple[list[int], list[int]]:
    """Old-file line numbers a hunk removes, and those it inserts before (from its body, not its context)."""
    m = _OLD_RANGE.match(hunk.header)
    if not m:
        return [], []
    old = int(m.group(1))
    removed: list[int] = []
    inserted: list[int] = []
    lines = hunk.text.splitlines()
    for line in lines[lines.index(hunk.header) + 1:]:
        if line.startswith("-"):
            removed.append(old)
            old += 1
        elif line.startswith("+"):
            inserted.append(old)
        elif not line.startswith("\\"):  # context ("\ No newline at end of file" is neither)
            old += 1
    return removed, inserted


def _hunk_names(series: Series, checkout: Path) -> dict[str, set[str]]:
    """File -> the functions and classes the series' hunks change, as the files stand in ``checkout``: those holding
    a removed line, and those holding the line an insertion follows."""
    out: dict[str, set[str]] = {}
    parsed: dict[str, list[tuple[int, int, str]]] = {}
    for patch in series.patches:
        for h in patch.hunks:
            path = checkout / h.path
            removed, inserted = _changed_lines(h)
            if not path.is_file() or h.header.startswith("@@ -0,0 "):
                continue  # a new file: nothing of NeMo RL's there
            if h.path not in parsed:
                parsed[h.path] = _definitions(path.read_text(encoding="utf-8"))
            names = {_enclosing(parsed[h.path], n) for n in removed}
            names |= {_enclosing(parsed[h.path], n - 1) for n in inserted}
            if names - {None}:
                out.setdefault(h.path, set()).update(n for n in names if n)
    return out


def record_apis(checkout: Path, series: Series,
                called: Mapping[str, Iterable[str]] = CALLED_APIS) -> dict[str, object]:
    """The signatures a series depends on, read from the unpatched checkout at its pin: the functions and classes
    its hunks change and ``called`` (what rlix-plugins calls). What ``apis.json`` holds: ``apis`` (at the pin) and
    ``patched`` (those the series itself changes, in their patched form)."""
    from rlix_plugins.patching import find_checkout

    root, head = find_checkout(checkout)
    if not head.startswith(series.name):
        raise PatchError(f"record the APIs of series {series.name} at its pin, not at {head[:12]}")
    wanted = _hunk_names(series, root)
    for path, names in called.items():
        wanted.setdefault(path, set()).update(names)
    after_series = _patched_signatures(root, series)
    apis: dict[str, dict[str, str]] = {}
    patched: dict[str, dict[str, str]] = {}
    for path, names in sorted(wanted.items()):
        found = signatures((root / path).read_text(encoding="utf-8"))
        names = {n for n in names if n in found or n not in OPTIONAL_APIS}
        missing = sorted(n for n in names if n not in found)
        if missing:
            raise PatchError(f"{path} at the pin has no {missing}: fix the list of called APIs")
        apis[path] = {n: found[n] for n in sorted(names)}
        after = after_series.get(path, found)
        changed = {n: after[n] for n in sorted(names) if after.get(n) != found[n]}
        if changed:
            patched[path] = changed
    return {"commit": head, "apis": apis, "patched": patched}


def _patched_signatures(root: Path, series: Series) -> dict[str, dict[str, str]]:
    """The signatures of the files the series touches once it is applied: they are copied from ``root`` into a
    temporary git tree, the series applied there, read, and the tree removed."""
    import shutil
    import tempfile

    from rlix_plugins.patching import _git

    tmp = Path(tempfile.mkdtemp(prefix="rlix-apis-"))
    try:
        for path in series.touched_paths:
            if (root / path).is_file():
                (tmp / path).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(root / path, tmp / path)
        if _git(tmp, "init", "-q").returncode != 0:
            raise PatchError(f"git init failed in {tmp}")
        out = _git(tmp, "apply", "--whitespace=nowarn", "-", stdin="".join(p.text for p in series.patches))
        if out.returncode != 0:
            raise PatchError(f"the series does not apply to the pin's files: {out.stderr.strip()}")
        return {path: signatures((tmp / path).read_text(encoding="utf-8")) for path in series.touched_paths
                if path.endswith(".py")}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ the report
def _hunk_state(checkout: Path, hunk: Hunk) -> str:
    from rlix_plugins.patching import _applies

    if _applies(checkout, hunk.text, reverse=True):
        return APPLIED
    if _applies(checkout, hunk.text, reverse=False):
        return CLEAN
    if _applies(checkout, hunk.text, reverse=False, context=1):
        return FUZZ
    return CONFLICT


def _api_drift(checkout: Path, recorded: Mapping[str, Mapping[str, str]],
               patched: Mapping[str, Mapping[str, str]]) -> list[ApiDrift]:
    """Recorded signatures that differ in ``checkout`` (one the series itself changes counts as unchanged in its
    patched form, in a checkout where it is applied)."""
    out: list[ApiDrift] = []
    for path, names in sorted(recorded.items()):
        file = checkout / path
        now = signatures(file.read_text(encoding="utf-8")) if file.is_file() else {}
        for name, old in sorted(names.items()):
            new = now.get(name)
            if new != old and (new is None or new != patched.get(path, {}).get(name)):
                out.append(ApiDrift(path, name, old, new))
    return out


def drift(checkout: Path, head: str, series_root: Path) -> DriftReport:
    """The drift of ``checkout`` from the series pinned to its HEAD, else from the newest series."""
    from rlix_plugins.patching import candidate_series

    pinned, candidates = candidate_series(head, series_root)
    series = pinned or candidates[-1]
    hunks = tuple(HunkDrift(f"{p.part + '/' if p.part else ''}{p.name}", h, _hunk_state(checkout, h))
                  for p in series.patches for h in p.hunks)
    record = series.directory / APIS_FILE
    if not record.is_file():
        return DriftReport(checkout, head, series, hunks, (), False)
    try:
        data = json.loads(record.read_text(encoding="utf-8"))
        recorded, patched = data["apis"], data.get("patched", {})
    except (ValueError, KeyError, TypeError) as exc:
        raise PatchError(f"{record} is not a record of signatures ({exc}); reinstall rlix-plugins") from None
    return DriftReport(checkout, head, series, hunks, tuple(_api_drift(checkout, recorded, patched)), True)
