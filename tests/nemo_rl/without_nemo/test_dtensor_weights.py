"""The DTensor (FSDP2) weight source: the CPU bucket cache built from 2 real FSDP2 ranks on gloo (CPU).

Each rank runs the real :func:`rlix_plugins.nemo_rl.worker_ops.build_cache` on a worker holding a fully_shard'ed
tiny Qwen2 (:mod:`tests.nemo_rl.without_nemo.dtensor_ranks`): a worker shaped like NeMo RL's ``DTensorPolicyWorker`` here,
NeMo RL's own class in the conformance venv (``nemo_rl`` marker). What the cache must hold: exactly the names and
bytes of the unsharded model's ``state_dict()`` cast to the policy dtype (what NeMo RL's own refit sends vLLM,
tied ``lm_head.weight`` included), on rank 0 only, with checksums that verify; a build after the offload is refused
on every rank (no rank left in an all-gather).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch

from rlix_plugins.errors import RlixConfigError, RlixError
from rlix_plugins.nemo_rl.config import policy_trainer
from rlix_plugins.nemo_rl.weights import PolicyWeightSource
from tests._repo import REPO
from tests.nemo_rl.without_nemo.dtensor_ranks import run_ranks


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rlix_plugins.demo.tiny_model import build_tiny_qwen2

    return build_tiny_qwen2(tmp_path_factory.mktemp("m") / "tiny", seed=0)


def _unsharded_as_sent(model_dir: Path) -> dict[str, torch.Tensor]:
    """The unsharded model's state_dict in NeMo RL's refit form: float32 master weights cast to bf16."""
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.tie_weights()
    return {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}


def _check(results: dict[int, dict[str, Any]], model_dir: Path, worker_class: str) -> None:
    expected = _unsharded_as_sent(model_dir)
    owner, peer = results[0], results[1]
    assert owner["worker_class"] == peer["worker_class"] == worker_class
    assert owner["version"] == 1 and peer["version"] is None
    assert list(owner["held"]) == list(expected)  # every HF name, in state_dict order
    assert "lm_head.weight" in owner["held"]  # tied: sent like NeMo RL's refit sends it
    for name, tensor in expected.items():
        held = owner["held"][name]
        assert held.dtype == tensor.dtype and held.shape == tensor.shape, name
        assert torch.equal(held.view(torch.uint8), tensor.view(torch.uint8)), name  # bit-exact
    assert owner["checksums_ok"] and owner["num_buffers"] >= 3
    assert peer["held"] == {} and peer["num_buffers"] == 0  # non-owners hold nothing
    for r in (owner, peer):
        assert "before_weight_sync" in r["refused"]
    assert owner["version_after_refusal"] == 1  # the refused build left the published version alone


def test_cache_from_fsdp2_ranks_holds_the_unsharded_model(model_dir: Path, tmp_path: Path) -> None:
    """Rank 0 holds exactly the unsharded bf16 state_dict; rank 1 nothing; checksums verify; offload refuses."""
    _check(run_ranks(str(model_dir), str(tmp_path)), model_dir, "DTensorWorkerShape")


def _nemo_env(kind: str) -> dict[str, str]:
    """PYTHONPATH for NeMo RL's venv: this checkout, NEMO_RL_SRC, and for v2 NeMo RL's Automodel submodule (the
    pinned nemo_automodel); then the caller's PYTHONPATH. Skips v2 when nemo_automodel cannot be imported."""
    from tests.nemo_rl._nemo_checkout import nemo_python, nemo_src

    src = nemo_src()
    paths = [str(REPO), str(src)]
    if kind == "v2":
        paths.append(str(src / "3rdparty" / "Automodel-workspace" / "Automodel"))
    env = {k: v for k, v in os.environ.items() if k not in ("RLIX_CONTROL_PLANE", "PYTEST_ADDOPTS")}
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [os.environ.get("PYTHONPATH")] if p])
    if kind == "v2":
        probe = subprocess.run([str(nemo_python()), "-c", "import nemo_rl.models.policy.workers.dtensor_policy_worker_v2"],
                               env=env, capture_output=True, text=True, timeout=300)
        if probe.returncode:
            pytest.skip("NeMo RL's v2 worker does not import in its venv (init NeMo RL's 3rdparty/Automodel-workspace "
                        f"submodule; its deps, e.g. torchao): {probe.stderr.strip().splitlines()[-1]}")
    return env


@pytest.mark.nemo_rl
@pytest.mark.slow  # ~90 s: NeMo RL's imports in 3 processes
@pytest.mark.parametrize(("kind", "worker_class"), [("v1", "DTensorPolicyWorkerImpl"),
                                                    ("v2", "DTensorPolicyWorkerV2Impl")])
def test_cache_from_nemo_rls_own_dtensor_worker(model_dir: Path, tmp_path: Path, kind: str, worker_class: str) -> None:
    """The same on NeMo RL's own DTensor worker classes (v1 sharded by its ``_parallelize_model``), in its venv."""
    from tests.nemo_rl._nemo_checkout import nemo_python

    env = _nemo_env(kind)
    script = Path(__file__).with_name("dtensor_ranks.py")  # by path: NeMo RL's checkout has its own `tests`
    proc = subprocess.run([str(nemo_python()), str(script), str(model_dir), str(tmp_path), "--worker", kind],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)}
    _check(results, model_dir, worker_class)


# ----------------------------------------------------------------------------------------- source selection
def _policy_cfg(megatron: bool | None, dtensor: bool | None) -> dict[str, Any]:
    policy: dict[str, Any] = {}
    if megatron is not None:
        policy["megatron_cfg"] = {"enabled": megatron}
    if dtensor is not None:
        policy["dtensor_cfg"] = {"enabled": dtensor, "_v2": True}
    return {"policy": policy}


class _Policy:
    def __init__(self) -> None:
        self.worker_group = type("WorkerGroup", (), {"workers": ["w0", "w1"]})()


@pytest.mark.parametrize(("megatron", "dtensor", "trainer"), [(True, False, "megatron"), (None, True, "dtensor"),
                                                              (False, True, "dtensor"), (True, None, "megatron")])
def test_source_follows_the_enabled_backend(megatron: bool | None, dtensor: bool | None, trainer: str) -> None:
    source = PolicyWeightSource.from_policy(_Policy(), _policy_cfg(megatron, dtensor), [2, 3], 1 << 20, 4)
    assert source.trainer == trainer and source.workers == ["w0", "w1"] and source.sender == (0, 2)


@pytest.mark.parametrize(("megatron", "dtensor"), [(True, True), (False, False), (None, None)])
def test_exactly_one_backend_or_a_config_error(megatron: bool | None, dtensor: bool | None) -> None:
    with pytest.raises(RlixConfigError, match="enable exactly one"):
        policy_trainer(_policy_cfg(megatron, dtensor))


def test_unknown_trainer_is_refused() -> None:
    with pytest.raises(RlixError, match="valid"):
        PolicyWeightSource(["w"], (0, 0), 1 << 20, "fsdp1")  # type: ignore[arg-type]

