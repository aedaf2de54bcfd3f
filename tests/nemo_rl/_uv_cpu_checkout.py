"""A NeMo RL checkout whose uv project a CPU machine that reaches only PyPI can lock and sync.

NeMo RL's own ``pyproject.toml`` cannot be synced here: it asks for CPython 3.13.14 (uv downloads it from
GitHub), takes torch/torchvision/triton from ``download.pytorch.org/whl/cu130``, TransferQueue from GitHub (a
base dependency, so every worker venv needs it), and lists submodules (Gym, Megatron-Bridge, Automodel) as
workspace members and path sources. :func:`cpu_pyproject` rewrites only the project file of a *copy*: the same
project name, package and uv settings, NeMo RL's dependency list minus what cannot be fetched or is CUDA-only
(:data:`DROPPED`, each with its reason; :data:`REWRITTEN`: ``ray`` without the dashboard extra), ``requires-python`` relaxed to any 3.13 (this machine has 3.13.0).
NeMo RL's ``uv.lock`` stays beside it, so ``uv lock`` keeps its pinned versions for everything kept.
Everything else (``PY_EXECUTABLES``, the actor registry, ``create_local_venv``) is NeMo RL's code, unchanged.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

#: Base (and extra) requirements left out, by distribution name, with the reason.
DROPPED: dict[str, str] = {
    **dict.fromkeys(("torch", "torchvision", "triton"), "NeMo RL takes them from download.pytorch.org/whl/cu130 (unreachable; CUDA builds)"),
    **dict.fromkeys(("accelerate", "torchdata", "timm", "open-clip-torch", "tensordict"), "need torch"),
    **dict.fromkeys(
        ("nvidia-nvshmem-cu13", "nccl4py", "cuda-bindings", "cuda-python", "nixl", "nvidia-cudnn-cu13", "tilelang",
         "mooncake-transfer-engine-cuda13", "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache",
         "nvidia-cutlass-dsl"),
        "CUDA-only",
    ),
}

_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def _name(req: str) -> str:
    m = _NAME.match(req)
    assert m, req
    return re.sub(r"[-_.]+", "-", m.group(1)).lower()


#: Requirements kept in another form, with the reason.
REWRITTEN: dict[str, tuple[str, str]] = {
    "ray[default]": ("ray", "ray[default]'s dashboard agent takes ~4 s of CPU to start; on a loaded 2-core machine it "
                            "missed the raylet's fixed 15 s wait for its port file and Ray 2.56 aborted (node_manager.cc)"),
}


def _rewrite(req: str) -> str:
    for old, (new, _) in REWRITTEN.items():
        if req.replace(" ", "").lower().startswith(old):
            return new + req.replace(" ", "")[len(old):]
    return req


def keep(req: str) -> bool:
    """A requirement the CPU copy keeps: not in :data:`DROPPED`, not a direct URL (GitHub: unreachable)."""
    return _name(req) not in DROPPED and " @ " not in req and "@git+" not in req.replace(" ", "")


def _toml(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[\n" + "".join(f"  {_toml(v)},\n" for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{_key(k)} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(value)


def _key(k: str) -> str:
    return k if re.fullmatch(r"[A-Za-z0-9_-]+", k) else _toml(k)


def _table(name: str, body: dict) -> str:
    return f"[{name}]\n" + "".join(f"{_key(k)} = {_toml(v)}\n" for k, v in body.items()) + "\n"


def cpu_pyproject(checkout: Path) -> list[str]:
    """Rewrite ``checkout/pyproject.toml`` (a copy!) and ``.python-version`` as the module docstring says; returns
    the requirements left out (for the report)."""
    orig = tomllib.loads((checkout / "pyproject.toml").read_text())
    proj, uv = orig["project"], orig["tool"]["uv"]
    dropped = [r for r in proj["dependencies"] if not keep(r)]
    project = {
        "name": proj["name"],
        "dynamic": proj["dynamic"],
        "description": proj["description"],
        "requires-python": ">=3.13,<3.14",  # NeMo RL: >=3.13.14 (uv would download it from GitHub)
        "dependencies": [_rewrite(r) for r in proj["dependencies"] if keep(r)],
    }
    # Only the extra the actor of the test uses (PY_EXECUTABLES.VLLM = `uv run --locked --extra vllm`), filtered alike.
    extras = {"vllm": [r for r in proj["optional-dependencies"]["vllm"] if keep(r)]}
    groups = {g: [r for r in orig["dependency-groups"][g] if keep(r)] for g in uv["default-groups"]}
    tool_uv = {k: uv[k] for k in ("managed", "environments", "preview", "no-build-isolation-package",
                                  "default-groups", "link-mode", "exclude-dependencies") if k in uv}
    tool_uv["override-dependencies"] = [r for r in uv.get("override-dependencies", []) if keep(r)]
    tool_uv["constraint-dependencies"] = [r for r in uv.get("constraint-dependencies", []) if keep(r)]
    text = (
        "# CPU copy of NeMo RL's pyproject.toml for tests (tests/nemo_rl/_uv_cpu_checkout.py): its dependency\n"
        "# list minus what cannot be fetched from PyPI or is CUDA-only; no workspace members, sources or extra indexes.\n"
        + _table("build-system", orig["build-system"])
        + _table("tool.setuptools", {"packages": orig["tool"]["setuptools"]["packages"]})
        + _table("tool.setuptools.dynamic", orig["tool"]["setuptools"]["dynamic"])
        + _table("project", project)
        + _table("project.optional-dependencies", extras)
        + _table("dependency-groups", groups)
        + _table("tool.uv", tool_uv)
    )
    (checkout / "pyproject.toml").write_text(text)
    (checkout / ".python-version").write_text("3.13\n")
    return dropped
