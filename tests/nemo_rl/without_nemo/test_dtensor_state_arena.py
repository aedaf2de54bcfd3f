"""A DTensor trainer's offload into its state arena on CPU: 2 FSDP2 ranks (gloo) as Ray actors with a real AdamW,
reached with ``__ray_call__`` through :class:`PolicyWeightSource` as the runtime's offload reaches NeMo RL's policy
workers. A second pair of ranks on the same weights never offloads: the reference.

On CPU the arena is host memory that is not page-locked (no CUDA); what is checked is what the GPU path relies on:
every parameter shard and Adam moment ends up in the arena with its values, FSDP2 trains on from there exactly as the
reference does, and the next offload reuses the arena.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch

from rlix_plugins.nemo_rl.weights import PolicyWeightSource
from tests.nemo_rl.without_nemo.dtensor_ranks import BUCKET_BYTES, WORLD, FsdpRankActor, free_port

ENV = {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _ranks(model_dir: Path) -> list[Any]:
    port = free_port()
    cls = ray.remote(num_cpus=0)(FsdpRankActor).options(runtime_env={"env_vars": ENV})
    return [cls.remote(r, port, str(model_dir)) for r in range(WORLD)]


@pytest.fixture(scope="module")
def groups(ray_cluster: dict[str, float], model_dir: Path) -> Iterator[tuple[list[Any], list[Any]]]:
    """(offloaded, reference): two gloo groups of FSDP2 ranks on the same weights."""
    offloaded, reference = _ranks(model_dir), _ranks(model_dir)
    ray.get([a.__ray_ready__.remote() for a in offloaded + reference], timeout=300)
    yield offloaded, reference
    for a in offloaded + reference:
        ray.kill(a)


def _step(ranks: list[Any]) -> float:
    losses = ray.get([r.train_step.remote() for r in ranks], timeout=120)
    assert losses[0] == losses[1]
    return float(losses[0])


def _states(ranks: list[Any]) -> list[dict[str, Any]]:
    return ray.get([r.states.remote() for r in ranks], timeout=60)  # type: ignore[no-any-return]


def _same(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_a_dtensor_trainer_offloads_into_its_arena_and_trains_on_as_before(
        groups: tuple[list[Any], list[Any]]) -> None:
    offloaded, reference = groups
    assert _step(offloaded) == _step(reference)  # Adam's moments exist from here on
    source = PolicyWeightSource(offloaded, (0, 0), BUCKET_BYTES, "dtensor")
    before = _states(offloaded)

    reports = source.offload_to_arena(60.0)
    assert reports is not None and len(reports) == WORLD, reports
    after = _states(offloaded)
    for rank, (b, a, report) in enumerate(zip(before, after, reports, strict=True)):
        assert not _same(b["tensors"], a["tensors"]), rank  # nothing changed on the way
        outside = [n for n, held in a["held"].items() if not held]
        # only the shards FSDP2 re-pads (uneven over the ranks) stay outside; the tiny model has none
        assert outside == a["uneven"] == [] and report["repadded"] == 0, (outside, report)
        assert report["new_arena"] and report["bytes"] > 0 and not a["training"], report
        # every shard and moment counted once (the tied embedding is one parameter); Adam's step count takes no
        # slot: NeMo RL's onload moves it to the GPU, and a layout that followed it changed at the second offload
        slotted = [k for k in a["tensors"] if not k.endswith(":step")]
        assert len(slotted) < len(a["tensors"]) and report["tensors"] == len(slotted), (report, sorted(a["tensors"]))

    # FSDP2 trains on from the arena exactly as the ranks that never offloaded
    assert _step(offloaded) == _step(reference)
    for got, want in zip(_states(offloaded), _states(reference), strict=True):
        assert not _same(got["tensors"], want["tensors"])

    # the next offload reuses the arena
    again = source.offload_to_arena(60.0)
    assert again is not None and not any(r["new_arena"] for r in again), again
    assert [s["arena"] for s in _states(offloaded)] == [s["arena"] for s in after]
    assert _step(offloaded) == _step(reference)


def test_a_megatron_trainer_is_left_to_nemo_rls_offload(groups: tuple[list[Any], list[Any]]) -> None:
    """The arena is the DTensor path: for Megatron the runtime runs NeMo RL's own offload (None: nothing moved)."""
    assert PolicyWeightSource(groups[1], (0, 0), BUCKET_BYTES, "megatron").offload_to_arena(60.0) is None


def _uneven_rank(rank: int, port: int, out: str) -> None:
    """One of two gloo ranks: an FSDP2 model whose dim-0 sizes are odd (FSDP2 pads every shard), offloaded into the
    arena after an AdamW step, then trained on beside a twin that never offloads."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from rlix_plugins.nemo_rl.state_arena import offload_to_arena

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)

    def twin() -> tuple[Any, Any]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
        fully_shard(model, mesh=init_device_mesh("cpu", (2,)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def step(model: Any, optimizer: Any) -> float:
        loss = model(torch.linspace(-1, 1, 24).view(4, 6)).pow(2).sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return float(loss.detach())

    (model, opt), (ref, ref_opt) = twin(), twin()
    losses = [(step(model, opt), step(ref, ref_opt))]
    _, moved = offload_to_arena(model, opt, None)
    losses += [(step(model, opt), step(ref, ref_opt)) for _ in range(2)]
    same = all(torch.equal(p.to_local(), q.to_local())
               for p, q in zip(model.parameters(), ref.parameters(), strict=True))
    torch.save({"losses": losses, "repadded": moved.repadded, "same": same}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


def test_shards_fsdp2_pads_are_counted_and_stay_correct(tmp_path: Path) -> None:
    """FSDP2 pads a dim-0 shard that does not divide evenly over the ranks and re-pads such a shard into memory of
    its own when ``_apply`` hands it another tensor: those parameters stay outside the arena (counted in
    ``repadded``), and the model still trains on exactly as a twin that never offloaded."""
    import torch.multiprocessing as mp

    mp.start_processes(_uneven_rank, args=(free_port(), str(tmp_path)), nprocs=2, start_method="spawn", join=True)
    for rank, padded in ((0, 0), (1, 4)):  # rank 0 holds 3 of 5 rows and 2 of 3 (full shards), rank 1 2 and 1
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["repadded"] == padded and got["same"], got  # two weights and two biases of odd rows
        assert all(a == b for a, b in got["losses"]), got
