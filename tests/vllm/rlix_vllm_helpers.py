"""Constants and helpers shared by the vLLM receiver tests (tests/vllm is on sys.path; no package, so
that the directory name ``vllm`` can never shadow the real vLLM package)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

#: KV cache per CPU engine (the tiny model needs almost none).
KV_CACHE_BYTES = 64 << 20
#: Small buckets so that every sync moves several buckets (largest tensor: 256 KiB embeddings).
BUCKET_BYTES = 320 << 10
PROMPTS = ["hello world the model", "sync sleep wake gpu", "the cache memory bucket"]
MAX_TOKENS = 12
HERE = Path(__file__).resolve().parent


def build_cache(weights: Mapping, version: int, bucket_bytes: int = BUCKET_BYTES) -> Any:
    from rlix_plugins.transport import VersionedBucketCache

    cache = VersionedBucketCache(bucket_bytes)  # pinned when CUDA is available
    cache.build(version, sorted(weights.items()))
    return cache
