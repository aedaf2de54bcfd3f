"""Tiny local inputs for NeMo RL's stock GRPO recipes on a machine without a hub: a random Qwen2 with a locally
trained tokenizer (rlix_plugins.demo.tiny_model) and a jsonl of arithmetic prompts in ResponseDataset's format.

    python3 tools/gpu-offline/gpu/nemo_rl_data.py OUT_DIR        -> OUT_DIR/model/, OUT_DIR/train.jsonl
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from rlix_plugins.demo.tiny_model import build_tiny_qwen2

out = Path(sys.argv[1])
build_tiny_qwen2(out / "model", seed=0, max_position_embeddings=1024)
rng = random.Random(0)
with open(out / "train.jsonl", "w") as f:
    for _ in range(256):
        a, b = rng.randint(1, 50), rng.randint(1, 50)
        f.write(json.dumps({"input": f"What is {a} + {b}?", "output": str(a + b)}) + "\n")
print("wrote", out / "model", out / "train.jsonl")
