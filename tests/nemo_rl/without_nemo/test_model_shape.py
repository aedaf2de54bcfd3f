"""Model shapes for ``rlix recipe``'s bucket size: the built-in table, a local config.json, the local hub cache."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import DEFAULT_BUCKET_SIZE_BYTES
from rlix_plugins.nemo_rl.model_shape import KNOWN_SHAPES, bucket_size_for, model_shape

MiB = 1 << 20


@pytest.fixture(autouse=True)
def empty_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache of this test only (a real ``~/.cache/huggingface`` must not change the results)."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


@pytest.mark.parametrize(("name", "params", "embedding"), [
    ("Qwen/Qwen2.5-0.5B", 494_032_768, (151936, 896)),
    ("Qwen/Qwen2.5-0.5B-Instruct", 494_032_768, (151936, 896)),
    ("Qwen/Qwen2.5-1.5B", 1_543_714_304, (151936, 1536)),
    ("Qwen/Qwen2.5-1.5B-Instruct", 1_543_714_304, (151936, 1536)),
    ("Qwen/Qwen2.5-7B", 7_615_616_512, (152064, 3584)),
    ("Qwen/Qwen2.5-7B-Instruct", 7_615_616_512, (152064, 3584)),
])
def test_builtin_shapes_of_the_stock_recipes_models(name: str, params: int, embedding: tuple[int, int]) -> None:
    shape = model_shape(name)  # nothing in the (empty) hub cache: the built-in table
    assert shape is KNOWN_SHAPES[name] and shape.num_parameters == params
    assert shape.largest_tensor() == ("model.embed_tokens.weight", embedding, embedding[0] * embedding[1] * 2)
    assert shape.largest_tensor(dtype_bytes=4)[2] == embedding[0] * embedding[1] * 4


_TINY: dict[str, Any] = {
    "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
    "num_hidden_layers": 3, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 128, "rms_norm_eps": 1e-6,
}


@pytest.mark.parametrize("config", [
    {**_TINY, "tie_word_embeddings": True},
    {**_TINY, "tie_word_embeddings": False},
    {**_TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": False,
     "attention_bias": True, "mlp_bias": True, "head_dim": 8},
    {**_TINY, "model_type": "llama", "architectures": ["LlamaForCausalLM"], "tie_word_embeddings": True,
     "num_key_value_heads": None},
], ids=["qwen2-tied", "qwen2-untied", "llama-biases-head-dim", "llama-tied-mha"])
def test_local_config_json_matches_transformers(config: dict[str, Any], tmp_path: Path) -> None:
    """Every parameter name and shape, the count and the largest tensor equal what transformers builds (on the
    meta device: no memory) from the same config."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    shape = model_shape(model_dir)
    assert shape is not None and shape.tie_word_embeddings is config["tie_word_embeddings"]
    cls = transformers.Qwen2ForCausalLM if config["model_type"] == "qwen2" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(transformers.AutoConfig.from_pretrained(model_dir))
    want = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    assert shape.tensor_shapes() == want
    assert shape.num_parameters == model.num_parameters() == sum(p.numel() for p in model.parameters())
    name, dims, nbytes = shape.largest_tensor()
    assert dims == max((s for _, s in want), key=math.prod)
    assert nbytes == dims[0] * dims[1] * 2 and name == "model.embed_tokens.weight"


def _cache_config(hub: Path, repo_id: str, config: dict[str, Any], sha: str = "0123abcd") -> None:
    repo = hub / f"models--{repo_id.replace('/', '--')}"
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "snapshots" / sha / "config.json").write_text(json.dumps(config))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(sha)


@pytest.mark.parametrize("hub_library", [True, False], ids=["huggingface_hub", "own-lookup"])
def test_hub_id_reads_the_local_hub_cache(hub_library: bool, empty_hub_cache: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A hub id is looked up in the local cache (through huggingface_hub when it is installed, else by the cache's
    layout); a cached config wins over the built-in table."""
    if hub_library:
        pytest.importorskip("huggingface_hub")
    else:
        monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    _cache_config(empty_hub_cache, "Org/Tiny", {**_TINY, "tie_word_embeddings": False})
    _cache_config(empty_hub_cache, "Qwen/Qwen2.5-1.5B", {**_TINY, "vocab_size": 5})
    tiny = model_shape("Org/Tiny")
    assert tiny is not None and (tiny.vocab_size, tiny.num_hidden_layers, tiny.tie_word_embeddings) == (1000, 3, False)
    qwen = model_shape("Qwen/Qwen2.5-1.5B")
    assert qwen is not None and qwen.vocab_size == 5
    assert model_shape("Org/Missing") is None


def test_unknown_models(tmp_path: Path) -> None:
    assert model_shape("nobody/nothing") is None and model_shape("tiny") is None
    other = tmp_path / "moe"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({**_TINY, "model_type": "qwen2_moe"}))
    assert model_shape(other) is None  # not the Qwen2 / Llama layer shape
    (other / "config.json").write_text("{not json")
    with pytest.raises(RlixConfigError, match=r"cannot read the model config .*config\.json"):
        model_shape(other)


def test_bucket_size_from_the_largest_tensor(tmp_path: Path) -> None:
    size, reason = bucket_size_for("Qwen/Qwen2.5-1.5B")
    assert size == 446 * MiB >= 151936 * 1536 * 2  # 445.1 MiB rounded up to a whole MiB
    assert "model.embed_tokens.weight" in reason and "445.1 MiB" in reason and "\n" not in reason
    size, reason = bucket_size_for("Qwen/Qwen2.5-0.5B")
    assert size == 260 * MiB and "259.7 MiB" in reason
    (tmp_path / "config.json").write_text(json.dumps(_TINY))
    size, reason = bucket_size_for(str(tmp_path))
    assert size == DEFAULT_BUCKET_SIZE_BYTES and "1000 x 64 bf16" in reason and "the default holds it" in reason
    for unknown in ("tiny", None, ""):
        size, reason = bucket_size_for(unknown)
        assert size == DEFAULT_BUCKET_SIZE_BYTES and "a bucket of its own" in reason
