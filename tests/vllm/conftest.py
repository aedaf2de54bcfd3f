"""Fixtures for the vLLM receiver tests: a tiny Qwen2 built locally (no hub), weight sets, cache helpers.

Engines are started by the test modules (one or two per module, module-scoped) - each costs ~3-25 s and
~1-2 GiB of RAM on CPU.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")



@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("models") / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def variant_model_dir(tiny_model_dir: Path) -> Path:
    """Same architecture and tokenizer, weights of seed 1: a fresh engine on these is the reference."""
    from rlix_plugins.demo.tiny_model import write_tiny_qwen2_variant

    return write_tiny_qwen2_variant(tiny_model_dir, tiny_model_dir.parent / "tiny-qwen2-seed1", seed=1)


@pytest.fixture(scope="session")
def weight_sets(tiny_model_dir: Path) -> dict[str, dict]:
    """HF-named state dicts: ``orig`` (what the engine starts with), ``seed1`` (= the variant dir), ``seed2``."""
    from safetensors.torch import load_file

    from rlix_plugins.demo.tiny_model import tiny_qwen2_weights

    return {
        "orig": load_file(str(tiny_model_dir / "model.safetensors")),
        "seed1": tiny_qwen2_weights(tiny_model_dir, 1),
        "seed2": tiny_qwen2_weights(tiny_model_dir, 2),
    }
