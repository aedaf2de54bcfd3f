"""The recipes in ``recipes/nemo_rl/``: overlays of NeMo RL's stock ``grpo_math_1B_megatron.yaml`` that add only the
rlix section and the async / non-colocated switches; each pair shares its inference GPUs and splits the training
GPUs; with NEMO_RL_SRC, NeMo RL's own config loader resolves them and our start-up validation accepts them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from rlix_plugins.nemo_rl.config import load_run_config
from rlix_plugins.nemo_rl.topology import validate_topology
from tests._repo import REPO

RECIPES = REPO / "recipes" / "nemo_rl"
PAIRS = [("two_pipelines_2gpu_a", "two_pipelines_2gpu_b"), ("two_pipelines_4gpu_a", "two_pipelines_4gpu_b")]
#: Every leaf an overlay may set (besides the whole rlix section).
ALLOWED = {
    "defaults", "grpo.async_grpo.enabled", "loss_fn.use_importance_sampling_correction",
    "policy.generation.colocated.enabled", "policy.generation.colocated.resources.gpus_per_node",
    "policy.generation.colocated.resources.num_nodes", "policy.generation.vllm_cfg.async_engine",
    "policy.generation.vllm_cfg.sleep_level", "policy.generation.vllm_cfg.detokenize",
    "policy.generation.vllm_kwargs.worker_cls", "cluster.gpus_per_node",
}


def _leaves(d: dict[str, Any], prefix: str = "") -> set[str]:
    out: set[str] = set()
    for k, v in d.items():
        key = f"{prefix}{k}"
        out |= _leaves(v, key + ".") if isinstance(v, dict) and k != "rlix" else {key}
    return out


def _overlay(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((RECIPES / f"{name}.yaml").read_text()))


@pytest.mark.parametrize("pair", PAIRS)
def test_overlays_add_only_the_time_sharing_switches(pair: tuple[str, str]) -> None:
    a, b = (_overlay(n) for n in pair)
    for cfg in (a, b):
        assert cfg["defaults"] == "../grpo_math_1B_megatron.yaml"
        assert _leaves(cfg) - {"rlix"} <= ALLOWED, _leaves(cfg) - ALLOWED
        assert cfg["policy"]["generation"]["vllm_cfg"]["sleep_level"] == cfg["rlix"]["sleep_level"]
    ra, rb = load_run_config(a), load_run_config(b)
    assert ra.infer_devices == rb.infer_devices  # both pipelines roll out on every GPU of the pool
    assert not set(ra.train_devices) & set(rb.train_devices)  # and train on disjoint halves
    assert set(ra.train_devices) | set(rb.train_devices) == set(ra.infer_devices)


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name", [n for pair in PAIRS for n in pair])
def test_nemo_rl_loads_and_we_validate(name: str, tmp_path: Path) -> None:
    from tests.nemo_rl._nemo_checkout import nemo_python, nemo_src

    src = nemo_src()
    configs = tmp_path / "configs"
    shutil.copytree(src / "examples" / "configs", configs, ignore=shutil.ignore_patterns("recipes"))
    (configs / "rlix").mkdir()
    shutil.copy(RECIPES / f"{name}.yaml", configs / "rlix")
    code = ("import json, sys; from omegaconf import OmegaConf; from nemo_rl.utils.config import load_config, register_omegaconf_resolvers; register_omegaconf_resolvers();"
            "print(json.dumps(OmegaConf.to_container(load_config(sys.argv[1]), resolve=True)))")
    env = {**os.environ, "PYTHONPATH": str(src)}
    run = subprocess.run([str(nemo_python()), "-c", code, str(configs / "rlix" / f"{name}.yaml")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = json.loads(run.stdout.strip().splitlines()[-1])
    assert cfg["policy"]["megatron_cfg"]["enabled"] is True  # the stock Megatron recipe underneath
    validate_topology(cfg, load_run_config(cfg))


#: The one-GPU pipelines of the loops GPU run: (recipe, stock recipe, `rlix recipe` flags, loop).
LOOPS = [("loops_1gpu_single_controller", "grpo_math_1B_megatron_single_controller.yaml", [], "single_controller"),
         ("loops_1gpu_data_plane", "grpo_math_1B.yaml", ["--data-plane"], "grpo_train_sync")]


@pytest.mark.parametrize("name,stock,flags,loop", LOOPS)
def test_loops_recipes_keep_their_loop_on_one_gpu(name: str, stock: str, flags: list[str], loop: str) -> None:
    from rlix_plugins.nemo_rl.topology import grpo_loop, is_one_gpu_topology

    cfg = _overlay(name)
    assert cfg["defaults"] == f"../{stock}"
    assert "async_grpo" not in cfg.get("grpo", {}) and "loss_fn" not in cfg  # no switch to async GRPO
    assert is_one_gpu_topology(load_run_config(cfg))
    if loop == "grpo_train_sync":
        assert grpo_loop(cfg) == loop  # the overlay itself turns the TransferQueue loop on


@pytest.mark.nemo_rl
@pytest.mark.parametrize("name,stock,flags,loop", LOOPS)
def test_loops_recipes_are_what_rlix_recipe_writes(name: str, stock: str, flags: list[str], loop: str,
                                                   tmp_path: Path) -> None:
    """`rlix recipe` on NeMo RL's stock recipe writes the checked-in overlay (below its two comment lines); NeMo RL's
    loader resolves it to the loop, and our start-up checks accept it."""
    from rlix_plugins.cli import main as rlix_main
    from rlix_plugins.nemo_rl.topology import grpo_loop
    from tests.nemo_rl._nemo_checkout import nemo_python, nemo_src

    if not (nemo_src() / "examples" / "configs" / stock).exists():  # v0.7.0 has no SingleController loop
        pytest.skip(f"this NeMo RL checkout has no examples/configs/{stock}")
    configs = tmp_path / "configs"
    shutil.copytree(nemo_src() / "examples" / "configs", configs, ignore=shutil.ignore_patterns("recipes"))
    assert rlix_main(["recipe", str(configs / stock), "--pipelines", "1", "--gpus", "0", "--out",
                      str(configs / "rlix"), *flags]) == 0
    written = configs / "rlix" / f"{Path(stock).stem}_rlix_a.yaml"
    checked_in = (RECIPES / f"{name}.yaml").read_text().split("\n", 3)[3]  # without the 3 lines about the GPU run
    assert written.read_text() == checked_in
    code = ("import json, sys; from omegaconf import OmegaConf; from nemo_rl.utils.config import load_config, "
            "register_omegaconf_resolvers; register_omegaconf_resolvers();"
            "print(json.dumps(OmegaConf.to_container(load_config(sys.argv[1]), resolve=True)))")
    run = subprocess.run([str(nemo_python()), "-c", code, str(written)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(nemo_src())})
    assert run.returncode == 0, run.stderr[-3000:]
    cfg = json.loads(run.stdout.strip().splitlines()[-1])
    assert grpo_loop(cfg) == loop
    validate_topology(cfg, load_run_config(cfg))
