"""The packages' public ``__init__``s: every name they offer resolves, and importing a package pulls in none of the
heavy dependencies (vLLM imports ``rlix_plugins`` in every process, NeMo RL's loader and Ray workers import
``rlix_plugins.nemo_rl``; standalone NeMo RL must never pay for us)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys

import pytest

from tests._repo import REPO

PACKAGES = ["rlix_plugins", "rlix_plugins.pipeline", "rlix_plugins.nemo_rl", "rlix_plugins.vllm", "rlix_plugins.demo"]
HEAVY = {"ray", "torch", "vllm", "nemo_rl", "pluggy", "transformers", "numpy"}

_TOP_LEVEL_IMPORTED = (
    "import importlib, json, sys; importlib.import_module(sys.argv[1]); "
    "print(json.dumps(sorted({m.split('.')[0] for m in sys.modules})))"
)


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_a_package_imports_nothing_heavy(package: str) -> None:
    run = subprocess.run([sys.executable, "-c", _TOP_LEVEL_IMPORTED, package], cwd=REPO, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    heavy = set(json.loads(run.stdout)) & HEAVY
    assert not heavy, f"importing {package} imported {sorted(heavy)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_resolves(package: str) -> None:
    module = importlib.import_module(package)
    for name in module.__all__:
        value = getattr(module, name)
        if isinstance(value, type) or callable(value):  # the defining module's object, not a look-alike
            assert value.__module__.startswith(package), (name, value.__module__)
            assert getattr(importlib.import_module(value.__module__), name) is value, name
    with pytest.raises(AttributeError, match=f"module '{package}' has no attribute 'no_such_name'"):
        _ = module.no_such_name
