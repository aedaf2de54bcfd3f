"""A vLLM engine at the share `rlix recipe` sizes for it vs a larger share: same rollout, same speed? (GPU only)

`rlix recipe` sizes each engine's ``gpu_memory_utilization`` to what a step's rollout keeps in flight
(``rlix_plugins.nemo_rl.recipe.sized_utilization``) so that more phases fit on a GPU beside it. This runs the
rollout of a stock GRPO step on one engine per share, one after the other, each in a process of its own, and
prints the KV cache each got, its start-up, and its decode throughput, as a ratio to the first share given:

    python benchmarks/engine_share.py MODEL_DIR [--shares 0.5,sized,sized@128/2048,sized:nolp] [--requests 1024]
        [--new-tokens 512]

MODEL_DIR: a Hugging Face model directory (``tools/gpu-offline/gpu/nemo_rl_real_data.py`` writes the stock recipe's
real shapes with random weights). ``sized``: the share ``rlix recipe`` writes for the stock ``grpo_math_1B`` batch
(32 prompts x 16 generations, two steps in flight under async GRPO, ``max_total_sequence_length``
``--new-tokens`` + 512). ``SHARE@SEQS/TOKENS``: that engine with vLLM's ``max_num_seqs`` / ``max_num_batched_tokens``
(default: what `rlix recipe` writes, 1,024 / 4,096; ``@128/2048`` is vLLM's async engine left at its defaults).
Every request decodes exactly ``--new-tokens`` tokens (``ignore_eos``), so every engine does the same work, and asks
the sampled token's logprob as NeMo RL does (``logprobs=0``). Suffixes change how (they combine, e.g. ``sized:flat:notext``):
``:nolp`` asks no logprobs; ``:flat`` returns them flat (``flat_logprobs``: a few lists per request instead of a dict
and an object per token); ``:notext`` turns detokenization off (``detokenize=False``: no text, and no decoded text
of each logprob's token, which vLLM's front-end otherwise makes per request and token). Two more set the engine up
as NeMo RL's time-shared ranks run: ``:eager`` (no CUDA graphs, ``enforce_eager``) and ``:sleep`` (sleep mode on, and
a sleep and a wake after the warm-up, before the rollout); ``:expandable`` runs the engine with torch's expandable
segments (``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``; vLLM turns them off inside its sleep-mode pools only),
to tell fragmentation from memory in use: a sleep-mode engine grew 6.4 GiB at its first rollout, one without none. Each engine's GPU memory (NVML, its process tree) is
read after start-up and at its peak during the rollout: what it holds beyond its share is what the scheduler's figure
for an awake engine must add (a 1.5B engine of 1,024 sequences / 16,384 tokens held ~14 GiB more under NeMo RL).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from typing import Any

PROMPT_TOKENS = 64


def sized_share(model: str, new_tokens: int, gpu_gib: float) -> float:
    from rlix_plugins.nemo_rl.recipe import sized_utilization

    stock = {"policy": {"model_name": model, "max_total_sequence_length": new_tokens + 512,
                        "generation": {"vllm_cfg": {"gpu_memory_utilization": 0.6}}},
             "grpo": {"num_prompts_per_step": 32, "num_generations_per_prompt": 16,
                      "async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}}}
    sized = sized_utilization(stock, gpu_gib)
    if sized is None:
        raise SystemExit(f"{model}: rlix recipe cannot size an engine for it (shape unknown)")
    print(f"sized: {sized[0]} ({sized[1]})", flush=True)
    return sized[0]


FLAGS = ("nolp", "flat", "notext", "eager", "sleep", "expandable")


def one_engine(model: str, share: float, requests: int, new_tokens: int, seqs: int, tokens: int,
               flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """In a process of its own: start an engine at ``share`` running ``seqs`` sequences and ``tokens`` tokens a
    step at most, run the rollout (asking each sampled token's logprob as ``flags`` say), report."""
    import random
    import threading

    from vllm import LLM, SamplingParams

    from rlix_plugins.pipeline.gpu_memory import process_tree_gpu_bytes

    t0 = time.perf_counter()
    llm = LLM(model=model, gpu_memory_utilization=share, max_model_len=new_tokens + 512, enforce_eager="eager" in flags,
              seed=0, enable_prefix_caching=False, max_num_seqs=seqs, max_num_batched_tokens=tokens,
              enable_sleep_mode="sleep" in flags)
    start_s = time.perf_counter() - t0
    cache = llm.llm_engine.vllm_config.cache_config
    kv_tokens = int((cache.num_gpu_blocks or 0) * cache.block_size)
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    prompts = [{"prompt_token_ids": [rng.randrange(vocab // 100, vocab // 2) for _ in range(PROMPT_TOKENS)]}
               for _ in range(requests)]
    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True, temperature=1.0,
                            logprobs=None if "nolp" in flags else 0, flat_logprobs="flat" in flags,
                            detokenize="notext" not in flags)
    llm.generate(prompts[:8], params, use_tqdm=False)  # warm-up
    if "sleep" in flags:  # level 1 keeps the weights (level 2, as time-sharing runs, would need them reloaded)
        llm.sleep(level=1)
        llm.wake_up()
    started = process_tree_gpu_bytes() or 0
    peak, done = [started], threading.Event()

    def sample() -> None:
        while not done.wait(0.1):
            peak[0] = max(peak[0], process_tree_gpu_bytes() or 0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    gen_s = time.perf_counter() - t0
    done.set()
    sampler.join(timeout=5)
    decoded = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"share": share, "max_num_seqs": seqs, "max_num_batched_tokens": tokens, "flags": list(flags),
            "start_s": round(start_s, 1),
            "kv_tokens": kv_tokens, "requests": requests, "tokens": decoded, "generate_s": round(gen_s, 2),
            "tokens_per_s": round(decoded / gen_s), "started_gib": round(started / 2**30, 2),
            "peak_gib": round(peak[0] / 2**30, 2)}


def parse_engine(spec: str) -> tuple[str, int, int, tuple[str, ...]]:
    """``SHARE[@SEQS/TOKENS][:FLAG...]`` -> (share, max_num_seqs, max_num_batched_tokens, flags: :data:`FLAGS`)."""
    from rlix_plugins.nemo_rl.memory_budget import ENGINE_BATCH_TOKENS, ENGINE_MAX_SEQS

    spec, *flags = spec.split(":")
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        raise SystemExit(f"--shares {spec}:{':'.join(flags)}: unknown suffix {unknown[0]!r}; the suffixes are "
                         + ", ".join(f"':{f}'" for f in FLAGS))
    share, _, batch = spec.partition("@")
    seqs, _, tokens = batch.partition("/")
    return share, int(seqs or ENGINE_MAX_SEQS), int(tokens or ENGINE_BATCH_TOKENS), tuple(flags)


def gpu_memory_gib() -> float:
    from rlix_plugins.nemo_rl.memory_budget import local_gpu_memory_gib

    gib = local_gpu_memory_gib()
    if gib is None:
        raise SystemExit("engine_share.py measures engines on a GPU: NVML finds none on this machine")
    return gib


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model")
    ap.add_argument("--shares", default="0.5,sized")
    ap.add_argument("--requests", type=int, default=1024)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per engine (start-up and rollout)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child: one engine, SHARE@SEQS/TOKENS
    args = ap.parse_args()
    if args.one is not None:
        share, seqs, tokens, flags = parse_engine(args.one)
        if "expandable" in flags:  # before torch starts, here and in vLLM's engine process (it inherits it)
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
        print("RESULT " + json.dumps(one_engine(args.model, float(share), args.requests, args.new_tokens, seqs,
                                                tokens, flags)), flush=True)
        return 0
    gib = gpu_memory_gib()
    engines = []
    for spec in args.shares.split(","):
        share, seqs, tokens, flags = parse_engine(spec)
        engines.append((sized_share(args.model, args.new_tokens, gib) if share == "sized" else float(share), seqs,
                        tokens, flags))
    need_tokens = args.requests * (args.new_tokens + 512)
    results = []
    for share, seqs, tokens, flags in engines:
        cmd = [sys.executable, __file__, args.model, "--one", ":".join((f"{share}@{seqs}/{tokens}", *flags)),
               "--requests", str(args.requests), "--new-tokens", str(args.new_tokens)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"share {share}: no result within {args.timeout:.0f} s", flush=True)
            return 1
        found = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not found:
            print(f"share {share}: the engine failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}", flush=True)
            return 1
        r = json.loads(found[-1][len("RESULT "):])
        if not r["kv_tokens"]:  # the engine's own log line, where its front-end does not expose the figure
            logged = re.findall(r"KV cache size: ([\d,]+) tokens", proc.stdout + proc.stderr)
            r["kv_tokens"] = int(logged[-1].replace(",", "")) if logged else 0
        results.append(r)
        print(json.dumps(r), flush=True)
    base = results[0]
    print(f"\nGPU {gib:.1f} GiB; the rollout: {args.requests} requests x {args.new_tokens} new tokens "
          f"(KV for all at once: {need_tokens:,} tokens of {args.new_tokens + 512}-token requests)")
    print(f"{'share':>6} {'GiB':>6} {'seqs/tokens':>24} {'KV tokens':>11} {'holds all':>9} {'start s':>8} "
          f"{'tok/s':>8} {'vs first':>8} {'held GiB':>9} {'peak GiB':>9} {'over share':>10}")
    for r in results:
        batch = " ".join((f"{r['max_num_seqs']}/{r['max_num_batched_tokens']}", *r["flags"]))
        print(f"{r['share']:>6g} {r['share'] * gib:>6.1f} {batch:>24} {r['kv_tokens']:>11,} "
              f"{'yes' if r['kv_tokens'] >= need_tokens else 'no':>9} {r['start_s']:>8.1f} {r['tokens_per_s']:>8,} "
              f"{r['tokens_per_s'] / base['tokens_per_s']:>7.2f}x {r['started_gib']:>9.1f} {r['peak_gib']:>9.1f} "
              f"{r['peak_gib'] - r['share'] * gib:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
