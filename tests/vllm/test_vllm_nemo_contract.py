"""Our receiver vs NeMo RL's source at the pinned commit (read with ``ast``; NeMo RL is never imported).

Checks what the NeMo route relies on: NeMo's extension exposes ``_load_weights(self, weights)`` and a
``@contextmanager _weight_update_lifecycle(self, transport)``; ``_load_model`` forwards ``**vllm_kwargs``
into the engine arguments and does not set ``worker_cls`` (so ``vllm_kwargs.worker_cls`` is free); no name
of our mixin collides with NeMo's extension (vLLM asserts on collisions when it appends the extension).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

from rlix_plugins.vllm.receiver import RlixReceiverMixin

pytestmark = pytest.mark.nemo_rl

_VLLM_DIR = Path("nemo_rl") / "models" / "generation" / "vllm"


def _src() -> Path:
    src = Path(os.environ["NEMO_RL_SRC"]).expanduser().resolve()
    if not (src / _VLLM_DIR / "vllm_backend.py").is_file():
        pytest.fail(f"NEMO_RL_SRC={src} has no {_VLLM_DIR / 'vllm_backend.py'}")
    return src


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def test_nemo_extension_has_the_refit_contract_we_use() -> None:
    tree = ast.parse((_src() / _VLLM_DIR / "vllm_backend.py").read_text())
    ext = _class(tree, "VllmInternalWorkerExtension")
    methods = {n.name: n for n in ext.body if isinstance(n, ast.FunctionDef)}
    load = methods["_load_weights"]
    assert [a.arg for a in load.args.args] == ["self", "weights"]
    life = methods["_weight_update_lifecycle"]
    assert [a.arg for a in life.args.args] == ["self", "transport"]
    assert any(ast.unparse(d) == "contextmanager" for d in life.decorator_list)
    assert "__init__" not in methods  # vLLM never runs extension constructors anyway
    ours = {n for n in dir(RlixReceiverMixin) if not n.startswith("__")}
    assert not ours & set(methods), f"collision with NeMo's extension: {sorted(ours & set(methods))}"


def test_nemo_load_model_forwards_vllm_kwargs_and_leaves_worker_cls_free() -> None:
    text = (_src() / _VLLM_DIR / "vllm_worker.py").read_text()
    tree = ast.parse(text)
    load_model = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "_load_model")
    calls = [n for n in ast.walk(load_model) if isinstance(n, ast.Call) and ast.unparse(n.func) == "dict"
             and any(k.arg == "worker_extension_cls" for k in n.keywords)]
    assert len(calls) == 1, "llm_kwargs = dict(..., worker_extension_cls=...) not found in _load_model"
    keywords = calls[0].keywords
    assert any(k.arg is None and ast.unparse(k.value) == "vllm_kwargs" for k in keywords)
    assert not any(k.arg == "worker_cls" for k in keywords)
    assert "worker_cls" not in ast.unparse(load_model).replace("worker_extension_cls", "")
