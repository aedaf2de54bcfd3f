"""FSDP2 ranks on gloo (CPU) holding a tiny HF Qwen2 the way NeMo RL's DTensor policy worker (v1) holds it.

* :class:`DTensorWorkerShape` - the members rlix uses on NeMo RL's ``DTensorPolicyWorker``: ``rank``, ``model``,
  ``dtype``, ``cpu_offload`` and the checkpoint-engine refit triad, whose iterator is NeMo RL's
  ``dtensor_params_generator`` (``state_dict()`` → ``DTensor.full_tensor()`` → ``.to(dtype).contiguous()``).
* :func:`make_worker` with ``kind="v1"`` / ``"v2"`` (NeMo RL importable: the conformance venv, NEMO_RL_SRC on the
  path; v2 also needs nemo_automodel) gives NeMo RL's own ``DTensorPolicyWorkerImpl`` / ``DTensorPolicyWorkerV2Impl``.
  Their ``__init__`` cannot run on CPU (``ray.get_gpu_ids()``, ``init_process_group("nccl")``, v2: Automodel's
  CUDA model setup), so the instance is made with ``__new__`` and given the members ``__init__`` sets; every method
  the weight source calls is then NeMo RL's. v1's model is sharded by NeMo RL's own ``_parallelize_model``; v2's
  with the same layout by hand (an HF model, as Automodel loads Qwen2/Llama: no state-dict adapter).
* :func:`run_ranks` spawns ``world`` processes; each runs the real :func:`worker_ops.build_cache` (version 1), then
  the runtime's offload mark and a refused build (version 2), and writes what it holds to ``out_dir/rank<r>.pt``.
  ``python tests/nemo_rl/without_nemo/dtensor_ranks.py MODEL_DIR OUT_DIR --worker v1`` does the same from another venv.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

#: Small buckets: the tiny model (~0.9 MB in bf16) fills several.
BUCKET_BYTES = 320 << 10
WORLD = 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Worker kinds: the stand-in, NeMo RL's v1 and v2 DTensor policy workers.
KINDS = ("shape", "v1", "v2")


def shard_tiny_qwen2(model_dir: str, nemo_parallelizer: bool = False) -> Any:
    """NeMo RL's layout: float32 master weights, ``fully_shard`` per decoder layer then the root (mixed precision:
    bf16 parameters), tied embeddings re-tied. Needs the default process group."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    world = torch.distributed.get_world_size()
    if nemo_parallelizer:
        from nemo_rl.models.dtensor.parallelize import _parallelize_model

        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp", "tp"))
        model = _parallelize_model(model, mesh["dp"], mesh["tp"], param_dtype=torch.bfloat16)
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    model.tie_weights()
    return model


class DTensorWorkerShape:
    """The members of NeMo RL's ``DTensorPolicyWorkerImpl`` that rlix's DTensor weight source uses (see above)."""

    def __init__(self, rank: int, model: Any, dtype: Any) -> None:
        self.rank, self.model, self.dtype, self.cpu_offload = rank, model, dtype, False
        self.refits = 0

    def _prepare_checkpoint_engine_weight_send(self) -> None:
        self.refits += 1  # cpu_offload is off: NeMo RL onloads nothing

    def _checkpoint_engine_weight_iterator(self, kv_scales: Any = None) -> Iterator[tuple[str, Any]]:
        from torch.distributed.tensor import DTensor

        for name, tensor in self.model.state_dict().items():
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            yield name, full.to(self.dtype, non_blocking=True).contiguous()

    def _finalize_checkpoint_engine_weight_send(self) -> None:
        pass


class FsdpRankActor(DTensorWorkerShape):
    """One rank as a Ray actor, as NeMo RL runs its policy workers (``ray.remote(FsdpRankActor)``): the weight
    source reaches it with ``__ray_call__``. Joins the gloo group of ``WORLD`` ranks at ``port`` and shards
    ``model_dir``."""

    def __init__(self, rank: int, port: int, model_dir: str) -> None:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
        super().__init__(rank, shard_tiny_qwen2(model_dir), torch.bfloat16)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-3)  # NeMo RL's, states made at step 1

    def train_step(self) -> float:
        """One forward/backward/AdamW step through FSDP2's all-gathers and reduce-scatters (its process groups);
        the gradients freed afterwards, as NeMo RL's ``train()`` ends."""
        import torch

        self.model.train()
        ids = torch.arange(16).view(2, 8) % self.model.config.vocab_size
        with torch.autocast("cpu", dtype=self.dtype):  # as NeMo RL's train() (on "cuda")
            loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()
        return float(loss)

    def states(self) -> dict[str, Any]:
        """This rank's shards (clones) of every parameter and optimizer state, whether each lies in the rank's state
        arena, the arena's identity and the model's train/eval mode."""
        from torch.distributed.tensor import DTensor

        def local(t: Any) -> Any:
            return t._local_tensor if isinstance(t, DTensor) else t

        arena = getattr(self, "_rlix_arena", None)
        names = {id(p): n for n, p in self.model.named_parameters()}
        out = {f"param:{n}": local(p).detach().clone() for n, p in self.model.named_parameters()}
        out.update({f"state:{names[id(p)]}:{k}": local(v).clone() for p, st in self.optimizer.state.items()
                    for k, v in st.items()})
        held = {} if arena is None else {n: arena.holds(p) for n, p in self.model.named_parameters()}
        held.update({} if arena is None else {f"{names[id(p)]}:{k}": arena.holds(v)
                                               for p, st in self.optimizer.state.items() for k, v in st.items()
                                               if k != "step"})
        uneven = [n for n, p in self.model.named_parameters() if p.shape[0] % WORLD]
        return {"tensors": out, "held": held, "arena": id(arena) if arena is not None else None,
                "training": self.model.training, "uneven": uneven}

    def load_weights(self, model_dir: str) -> None:
        """Replace the sharded weights with ``model_dir``'s (NeMo RL's loader: ``set_model_state_dict``)."""
        import torch
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        full = {k: v.to(torch.float32) for k, v in load_file(f"{model_dir}/model.safetensors").items()}
        set_model_state_dict(self.model, full, options=StateDictOptions(full_state_dict=True, strict=False))
        self.model.tie_weights()


def make_worker(rank: int, model_dir: str, kind: str) -> Any:
    import torch

    model = shard_tiny_qwen2(model_dir, nemo_parallelizer=kind == "v1")
    if kind == "shape":
        return DTensorWorkerShape(rank, model, torch.bfloat16)
    if kind == "v1":
        from nemo_rl.models.policy.workers.dtensor_policy_worker import DTensorPolicyWorkerImpl as cls
    else:
        from nemo_rl.models.policy.workers.dtensor_policy_worker_v2 import DTensorPolicyWorkerV2Impl as cls
    worker = cls.__new__(cls)
    worker.rank, worker.model, worker.dtype, worker.cpu_offload = rank, model, torch.bfloat16, False
    return worker


def held_tensors(worker: Any) -> dict[str, Any]:
    """What the worker's cache holds (clones, in bucket order); empty when it holds nothing."""
    from rlix_plugins.transport import unpack_bucket

    cache = worker._rlix_cache
    if cache.version is None:
        return {}
    with cache.read(timeout_s=30) as snap:
        return {n: t.clone() for b in snap.buckets for n, t in unpack_bucket(b.meta, b.buffer)}


def _rank_main(rank: int, port: int, model_dir: str, out_dir: str, kind: str) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist

    from rlix_plugins.nemo_rl import worker_ops
    from rlix_plugins.transport import compute_checksums, verify_checksums

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    worker = make_worker(rank, model_dir, kind)
    t0 = time.perf_counter()
    version = worker_ops.build_cache(worker, "dtensor", 1, BUCKET_BYTES, 60.0)
    build_s = time.perf_counter() - t0
    held = held_tensors(worker)
    cache = worker._rlix_cache
    checksums_ok = False
    if held:
        with cache.read(timeout_s=30) as snap:
            verify_checksums(snap.checksums, compute_checksums(held.items()), context="cache vs its bytes")
            checksums_ok = set(snap.checksums) == set(held)
    worker_ops.mark_offloaded(worker, True)  # what the runtime does right after policy.offload_after_refit()
    try:
        worker_ops.build_cache(worker, "dtensor", 2, BUCKET_BYTES, 60.0)
        refused = ""
    except RuntimeError as exc:
        refused = str(exc)
    dist.barrier()  # a rank that did not refuse would hang here in its all-gather instead
    torch.save({"version": version, "held": held, "checksums_ok": checksums_ok, "num_buffers": cache.num_buffers,
                "version_after_refusal": cache.version, "refused": refused, "build_s": build_s,
                "worker_class": type(worker).__name__},
               Path(out_dir) / f"rank{rank}.pt")
    dist.destroy_process_group()


def run_ranks(model_dir: str, out_dir: str, kind: str = "shape", timeout_s: float = 240.0) -> dict[int, dict[str, Any]]:
    """Spawn the ranks (bounded: killed after ``timeout_s``) and return what each wrote."""
    import torch
    import torch.multiprocessing as mp

    ctx = mp.start_processes(_rank_main, args=(free_port(), model_dir, out_dir, kind), nprocs=WORLD,
                             start_method="spawn", join=False)
    deadline = time.monotonic() + timeout_s
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            raise TimeoutError(f"the {WORLD} FSDP2 ranks did not finish within {timeout_s:.0f} s")
    return {r: torch.load(Path(out_dir) / f"rank{r}.pt") for r in range(WORLD)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--worker", choices=KINDS, default="shape", help="v1/v2: NeMo RL's own worker classes")
    args = parser.parse_args()
    run_ranks(args.model_dir, args.out_dir, args.worker)
