"""Real-shape local inputs for NeMo RL's stock GRPO recipe on a machine without a hub.

    python3 tools/gpu-offline/gpu/nemo_rl_real_data.py OUT_DIR [--shape qwen2.5-1.5b|qwen2.5-0.5b] [--prompts N]
      -> OUT_DIR/model/ (config, random bf16 weights, tokenizer), OUT_DIR/train.jsonl

The model has the stock recipe's real architecture (Qwen2.5-1.5B: 1,543,714,304 parameters, vocabulary 151,936;
or Qwen2.5-0.5B) with random weights (std 0.02), so every sampled answer runs to max_new_tokens: the rollout load
of a real run, not of a converged one. The tokenizer covers the whole vocabulary: a byte-level BPE whose 151,933
regular tokens are the 256 byte symbols and merges generated in a fixed order (byte pairs, then byte triples), plus
NeMo RL's special tokens; it encodes any text. Prompts are arithmetic questions in ResponseDataset's format.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import time
from pathlib import Path

SHAPES = {
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2),
}
VOCAB = 151936
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(out: Path) -> int:
    """A byte-level BPE of exactly ``VOCAB`` tokens; returns the eos id."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the 256 byte symbols
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    merges: list[tuple[str, str]] = []
    want = VOCAB - len(SPECIAL)
    # Pairs first (every byte pair), then triples (pair + byte): each merge's parts exist before it.
    pairs = ((a, b) for a, b in itertools.product(alphabet, repeat=2))
    triples = ((a + b, c) for a, b, c in itertools.product(alphabet, repeat=3))
    for left, right in itertools.chain(pairs, triples):
        if len(vocab) >= want:
            break
        vocab[left + right] = len(vocab)
        merges.append((left, right))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    assert len(fast) == VOCAB, len(fast)
    fast.save_pretrained(str(out))
    return int(fast.eos_token_id)


def build_model(out: Path, shape: str, eos: int, seed: int = 0) -> int:
    """Config + random bf16 weights of ``shape`` (tied embeddings, as both Qwen2.5 sizes); returns the parameters."""
    import torch
    from safetensors.torch import save_file
    from transformers import Qwen2Config

    dims = SHAPES[shape]
    config = Qwen2Config(architectures=["Qwen2ForCausalLM"], vocab_size=VOCAB, max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, bos_token_id=eos, eos_token_id=eos, torch_dtype="bfloat16",
                         max_window_layers=dims["num_hidden_layers"], **dims)
    config.save_pretrained(str(out))
    h, inter, heads, kv = dims["hidden_size"], dims["intermediate_size"], dims["num_attention_heads"], \
        dims["num_key_value_heads"]
    hd = h // heads
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    weights = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(dims["num_hidden_layers"]):
        p = f"model.layers.{i}."
        weights |= {
            p + "self_attn.q_proj.weight": rand(heads * hd, h), p + "self_attn.q_proj.bias": rand(heads * hd),
            p + "self_attn.k_proj.weight": rand(kv * hd, h), p + "self_attn.k_proj.bias": rand(kv * hd),
            p + "self_attn.v_proj.weight": rand(kv * hd, h), p + "self_attn.v_proj.bias": rand(kv * hd),
            p + "self_attn.o_proj.weight": rand(h, heads * hd),
            p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
            p + "mlp.down_proj.weight": rand(h, inter),
            p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return sum(t.numel() for t in weights.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-1.5b")
    ap.add_argument("--prompts", type=int, default=8192)
    args = ap.parse_args()
    out = Path(args.out)
    (out / "model").mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    eos = build_tokenizer(out / "model")
    params = build_model(out / "model", args.shape, eos)
    rng = random.Random(0)
    with open(out / "train.jsonl", "w") as f:
        for _ in range(args.prompts):
            a, b = rng.randint(1, 999), rng.randint(1, 999)
            f.write(json.dumps({"input": f"What is {a} + {b}? Show your work.", "output": str(a + b)}) + "\n")
    print(f"wrote {out}/model ({args.shape}, {params:,} parameters, vocabulary {VOCAB}) and {args.prompts} prompts "
          f"in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
