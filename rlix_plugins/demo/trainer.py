"""Demo training side: a real policy-gradient step on a tiny Qwen2 (HF transformers, CPU) and the cache owner.

:class:`DemoTrainer` is a Ray actor holding the fp32 master model, its optimizer and the
:class:`~rlix_plugins.transport.VersionedBucketCache` (it is the only training rank, hence the owner). The
cache holds bf16 copies under HF names (what vLLM serves). ``sync`` runs
:func:`rlix_plugins.vllm.driver.sync_engines` HERE, where the cache lives; engine handles travel in.

Training step (GRPO-shaped): reward = fraction of generated tokens in a target set (ids divisible by
``target_mod``: verifiable, no model needed); advantages normalised within each prompt's group; loss =
-mean(advantage x mean token log-prob of the completion). :class:`ActorWeightSource` is the picklable
:class:`~rlix_plugins.pipeline.protocols.WeightSource` over the actor.
"""

from __future__ import annotations

import time
from typing import Any

from rlix_plugins.control.rpc import ray_get
from rlix_plugins.pipeline.protocols import SyncResult

__all__ = ["ActorWeightSource", "DemoTrainer", "token_reward"]


def token_reward(tokens: list[int], target_mod: int) -> float:
    """Fraction of ``tokens`` whose id is divisible by ``target_mod`` (0 for an empty completion)."""
    return sum(1 for t in tokens if t % target_mod == 0) / len(tokens) if tokens else 0.0


class DemoTrainer:
    """See the module docstring. ``sender`` is the (node, gpu) of the training GPU (for the comm plan)."""

    def __init__(self, model_dir: str, bucket_size_bytes: int, sender: tuple[int, int], *, lr: float = 3e-3,
                 target_mod: int = 8, seed: int = 0) -> None:
        import torch
        from transformers import Qwen2ForCausalLM

        from rlix_plugins.transport import VersionedBucketCache

        torch.set_num_threads(1)
        torch.manual_seed(seed)
        self.model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
        self.tied = bool(self.model.config.tie_word_embeddings)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=lr)
        self.cache = VersionedBucketCache(bucket_size_bytes, pin_memory=False)
        self.sender = tuple(sender)
        self.target_mod = target_mod
        self.built: list[tuple[int, dict[str, list[int]]]] = []  # (version, checksums) of every cache build
        self.syncs: list[dict[str, Any]] = []
        self.offloaded = False
        #: what the trainer is doing now ("idle", "train", "build_cache", "sync"): fault injection and diagnostics
        self.phase = "idle"

    def _named_weights(self) -> Any:
        import torch

        for name, tensor in self.model.state_dict().items():
            if self.tied and name == "lm_head.weight":
                continue
            yield name, tensor.detach().to(torch.bfloat16)

    # ------------------------------------------------------------------ WeightSource (remote half)
    def build_cache(self, version: int) -> int:
        if self.offloaded and version >= 0:
            # A cache built from offloaded parameters would read empty storage: refuse loudly.
            raise RuntimeError(f"build_cache({version}) after offload: build it in before_weight_sync")
        self.phase = "build_cache"
        try:
            built = self.cache.build(version, self._named_weights())
            with self.cache.read(60.0) as snap:
                self.built.append((version, dict(snap.checksums)))
        finally:
            self.phase = "idle"
        return int(built if built is not None else version)

    def pid(self) -> int:
        import os

        return os.getpid()

    def sync(self, targets: dict[int, tuple[Any, list[tuple[int, int]]]], timeout_s: float, verify: bool,
             wake_tags: list[str] | None = None) -> SyncResult:
        from rlix_plugins.transport import build_comm_plan
        from rlix_plugins.vllm.driver import sync_engines

        t0 = time.perf_counter()
        plan = build_comm_plan(self.sender, {dp: devs for dp, (_, devs) in targets.items()},
                               same_gpu_transport="host_pull")
        report = sync_engines(self.cache, plan, {dp: rpc for dp, (rpc, _) in targets.items()},
                              staging_device="cpu", backend="gloo", timeout_s=timeout_s, verify=verify,
                              wake_tags=wake_tags)
        result = SyncResult.of_report(report, targets, time.perf_counter() - t0)
        self.syncs.append({"version": result.version, "ranks": list(result.dp_ranks), "verified": result.verified,
                           "params": len(self.built[-1][1]) if self.built else 0})
        return result

    # ------------------------------------------------------------------ training
    def onload(self) -> None:
        self.offloaded = False

    def offload(self) -> None:
        """On a GPU trainer this frees the device (params, grads, optimizer, NCCL groups); here it marks the
        state so that a cache build after it is refused (on a GPU it would read empty storage)."""
        self.offloaded = True

    def train_step(self, groups: list[dict[str, Any]]) -> dict[str, float]:
        import torch

        self.offloaded = False
        seqs: list[list[int]] = []
        prompt_lens: list[int] = []
        advs: list[float] = []
        rewards: list[float] = []
        for g in groups:
            rs = [token_reward(c, self.target_mod) for c in g["completions"]]
            rewards += rs
            mean = sum(rs) / len(rs)
            std = (sum((r - mean) ** 2 for r in rs) / len(rs)) ** 0.5
            for c, r in zip(g["completions"], rs, strict=True):
                if c:
                    seqs.append(list(g["prompt"]) + list(c))
                    prompt_lens.append(len(g["prompt"]))
                    advs.append((r - mean) / (std + 1e-6))
        if not seqs:
            return {"loss": 0.0, "reward": 0.0, "samples": 0.0}
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros(len(seqs), width, dtype=torch.long)
        comp = torch.zeros(len(seqs), width - 1)
        for i, (s, p) in enumerate(zip(seqs, prompt_lens, strict=True)):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
            comp[i, p - 1 : len(s) - 1] = 1.0  # positions that predict completion tokens
        self.model.train()
        logits = self.model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        per_seq = (logp * comp).sum(-1) / comp.sum(-1).clamp(min=1.0)
        loss = -(torch.tensor(advs) * per_seq).mean()
        self.opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        return {"loss": float(loss.item()), "reward": sum(rewards) / len(rewards), "samples": float(len(seqs))}

    def history(self) -> dict[str, Any]:
        return {"built": [(v, len(c)) for v, c in self.built], "syncs": list(self.syncs)}

    def checksums(self, version: int) -> dict[str, list[int]]:
        for v, c in reversed(self.built):
            if v == version:
                return c
        raise KeyError(f"version {version} was never built; built: {[v for v, _ in self.built]}")


class ActorWeightSource:
    """Picklable :class:`~rlix_plugins.pipeline.protocols.WeightSource` over a :class:`DemoTrainer` actor."""

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def _get(self, ref: Any, what: str, timeout_s: float) -> Any:
        return ray_get(ref, f"trainer: {what}", timeout_s, dead="the trainer actor died")


    def build_cache(self, version: int, timeout_s: float) -> int:
        return int(self._get(self.trainer.build_cache.remote(version), f"build_cache({version})", timeout_s))

    def sync(self, targets: dict[int, tuple[Any, list[tuple[int, int]]]], timeout_s: float, verify: bool,
             wake_tags: list[str] | None = None) -> SyncResult:
        result: SyncResult = self._get(self.trainer.sync.remote(targets, timeout_s, verify, wake_tags), "weight sync",
                                       timeout_s * 4 + 30)
        return result
