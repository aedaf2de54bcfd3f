"""The tensor shapes of a Hugging Face decoder (Qwen2 / Llama family), from its ``config.json``, never the network.

``rlix recipe`` sizes ``rlix.bucket_size_bytes`` from the model's largest tensor (:func:`bucket_size_for`): a
bucket that holds it keeps every bucket at one size. A larger tensor would still travel, alone in a bucket of its
own (``rlix_plugins.transport.iter_buckets``); sizing the bucket to it just makes that the rule, not the exception.

Where the shape comes from (:func:`model_shape`), first found wins:

1. ``<model>/config.json`` when ``model`` is a local directory;
2. the local Hugging Face cache for a hub id such as ``Qwen/Qwen2.5-1.5B`` (``huggingface_hub``'s offline cache
   lookup when it is installed, else ``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``);
3. :data:`KNOWN_SHAPES`, the models NeMo RL's stock GRPO recipes train.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from rlix_plugins import envs
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import DEFAULT_BUCKET_SIZE_BYTES

__all__ = ["KNOWN_SHAPES", "ModelShape", "bucket_size_for", "model_shape", "read_config"]

MiB: Final = 1 << 20
#: ``model_type``s whose layers are the Qwen2 / Llama shape computed here (other decoders differ: MoE experts,
#: per-head norms, ...).
SUPPORTED_MODEL_TYPES: Final = frozenset({"qwen2", "llama", "mistral"})


@dataclass(frozen=True)
class ModelShape:
    """A Qwen2 / Llama-style decoder: embedding, per layer attention (q/k/v/o) + gated MLP + two RMSNorms,
    final norm, lm_head unless tied to the embedding. Names are the Hugging Face parameter names."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    tie_word_embeddings: bool
    #: per-head width; ``hidden_size // num_attention_heads`` unless the config says otherwise
    head_dim: int
    #: biases on q/k/v (Qwen2 always; Llama with ``attention_bias``)
    qkv_bias: bool = False
    #: bias on o_proj (Llama with ``attention_bias``; never on Qwen2)
    o_bias: bool = False
    #: biases on gate/up/down (Llama's ``mlp_bias``)
    mlp_bias: bool = False

    def tensor_shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(name, shape)`` of every parameter, in ``named_parameters()`` order (a tied lm_head is not listed)."""
        h, q, kv, ff = (self.hidden_size, self.num_attention_heads * self.head_dim,
                        self.num_key_value_heads * self.head_dim, self.intermediate_size)
        linear = {"self_attn.q_proj": (q, h, self.qkv_bias), "self_attn.k_proj": (kv, h, self.qkv_bias),
                  "self_attn.v_proj": (kv, h, self.qkv_bias), "self_attn.o_proj": (h, q, self.o_bias),
                  "mlp.gate_proj": (ff, h, self.mlp_bias), "mlp.up_proj": (ff, h, self.mlp_bias),
                  "mlp.down_proj": (h, ff, self.mlp_bias)}
        out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (self.vocab_size, h))]
        for i in range(self.num_hidden_layers):
            prefix = f"model.layers.{i}."
            for name, (rows, cols, bias) in linear.items():
                out.append((f"{prefix}{name}.weight", (rows, cols)))
                if bias:
                    out.append((f"{prefix}{name}.bias", (rows,)))
            out += [(f"{prefix}input_layernorm.weight", (h,)), (f"{prefix}post_attention_layernorm.weight", (h,))]
        out.append(("model.norm.weight", (h,)))
        if not self.tie_word_embeddings:
            out.append(("lm_head.weight", (self.vocab_size, h)))
        return out

    @property
    def num_parameters(self) -> int:
        """Parameters of the model (a tied lm_head counted once, as ``model.num_parameters()`` does)."""
        return sum(math.prod(shape) for _, shape in self.tensor_shapes())

    def largest_tensor(self, dtype_bytes: int = 2) -> tuple[str, tuple[int, ...], int]:
        """``(name, shape, bytes)`` of the largest parameter at ``dtype_bytes`` per element (bf16: 2)."""
        name, shape = max(self.tensor_shapes(), key=lambda t: math.prod(t[1]))
        return name, shape, math.prod(shape) * dtype_bytes


def _qwen25(hidden: int, layers: int, ff: int, heads: int, kv: int, vocab: int, tied: bool) -> ModelShape:
    return ModelShape(vocab, hidden, layers, ff, heads, kv, tied, hidden // heads, qkv_bias=True)


_QWEN25: Final = {
    "Qwen/Qwen2.5-0.5B": _qwen25(896, 24, 4864, 14, 2, 151936, tied=True),  # 494,032,768 parameters
    "Qwen/Qwen2.5-1.5B": _qwen25(1536, 28, 8960, 12, 2, 151936, tied=True),  # 1,543,714,304
    "Qwen/Qwen2.5-7B": _qwen25(3584, 28, 18944, 28, 4, 152064, tied=False),  # 7,615,616,512
}
#: Shapes of the models NeMo RL's stock GRPO recipes train, for when no config.json is found locally.
KNOWN_SHAPES: Final[dict[str, ModelShape]] = {
    **_QWEN25,
    **{f"{name}-Instruct": shape for name, shape in _QWEN25.items()},
    # 8,030,261,248 parameters
    "meta-llama/Llama-3.1-8B-Instruct": ModelShape(128256, 4096, 32, 14336, 32, 8, False, 128),
}


def read_config(config: dict[str, Any]) -> ModelShape | None:
    """The shape a ``config.json`` describes; None for a model type or a config this module cannot read."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        return None
    try:
        hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
        shape = ModelShape(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            num_hidden_layers=int(config["num_hidden_layers"]),
            intermediate_size=int(config["intermediate_size"]),
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            # the default of transformers' Qwen2Config / LlamaConfig when the file does not say
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            head_dim=int(config.get("head_dim") or hidden // heads),
            qkv_bias=model_type == "qwen2" or bool(config.get("attention_bias", False)),
            o_bias=model_type != "qwen2" and bool(config.get("attention_bias", False)),
            mlp_bias=bool(config.get("mlp_bias", False)),
        )
    except (KeyError, TypeError, ValueError):
        return None
    return shape


def _hub_cache() -> Path:
    """The hub cache directory, from the environment as it is now (``huggingface_hub`` reads it once, at import)."""
    hub, home = envs.hf_hub_cache(), envs.hf_home()
    if hub:
        return Path(hub).expanduser()
    if home:
        return Path(home).expanduser() / "hub"
    xdg = envs.xdg_cache_home() or "~/.cache"
    return Path(xdg).expanduser() / "huggingface" / "hub"


def _cached_config(repo_id: str) -> Path | None:
    """``config.json`` of ``repo_id`` in the local hub cache (the ``main`` snapshot first), without the network."""
    cache = _hub_cache()
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        pass
    else:
        try:
            found = try_to_load_from_cache(repo_id, "config.json", cache_dir=cache)
        except ValueError:  # not a valid repo id
            return None
        return Path(found) if isinstance(found, str) else None
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    ref = repo / "refs" / "main"
    if ref.is_file():
        main = repo / "snapshots" / ref.read_text().strip() / "config.json"
        if main.is_file():
            return main
    snapshots = sorted((repo / "snapshots").glob("*/config.json"), key=lambda p: p.stat().st_mtime)
    return snapshots[-1] if snapshots else None


def model_shape(model: str | os.PathLike[str]) -> ModelShape | None:
    """The shape of ``model`` (a local directory or a hub id; see the module docstring); None when unknown."""
    path = Path(model).expanduser()
    config = path / "config.json" if path.is_dir() else None
    if config is None and str(model).count("/") == 1 and not str(model).startswith(("/", ".", "~")):
        config = _cached_config(str(model))
    if config is None or not config.is_file():
        return KNOWN_SHAPES.get(str(model))
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError) as exc:
        raise RlixConfigError(f"cannot read the model config {config}: {exc}; fix or re-download it") from None
    return read_config(data) if isinstance(data, dict) else None


def bucket_size_for(model: Any) -> tuple[int, str]:
    """``rlix.bucket_size_bytes`` for ``model`` (``policy.model_name``) and the reason ``rlix recipe`` writes with it.

    The model's largest tensor (bf16) rounded up to a whole MiB, never below the default
    (``DEFAULT_BUCKET_SIZE_BYTES``): the bucket bounds the GPU scratch a sync needs next to a co-tenant's KV cache,
    so it grows only as far as the largest tensor needs (a power of two would waste up to half of it).
    """
    default_mib = DEFAULT_BUCKET_SIZE_BYTES // MiB
    shape = model_shape(model) if isinstance(model, str) and model else None
    if shape is None:
        return DEFAULT_BUCKET_SIZE_BYTES, (
            f"{default_mib} MiB per bucket: must fit next to a co-tenant's KV cache; the shape of {model!r} is not "
            "known here (no Qwen2/Llama config.json found locally), a larger tensor travels in a bucket of its own")
    name, dims, nbytes = shape.largest_tensor(dtype_bytes=2)
    size = max(DEFAULT_BUCKET_SIZE_BYTES, -(-nbytes // MiB) * MiB)
    tensor = f"{name}, {' x '.join(map(str, dims))} bf16 = {nbytes / MiB:.1f} MiB"
    how = "rounded up to a whole MiB" if size > DEFAULT_BUCKET_SIZE_BYTES else "the default holds it"
    return size, (f"{size // MiB} MiB per bucket (the largest tensor of {model}: {tensor}; {how}): "
                  "must fit next to a co-tenant's KV cache")
