"""Bad input: every config and topology rlix rejects, one row each, with a message naming the field and the fix.

The table in README.md ("Bad input") lists these rows; ``CASES`` is its source. The CLI misuses at the bottom go
through the real entry point (``python -m rlix_plugins.cli``): nonzero exit, no traceback, the last stderr line
names the problem.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from rlix_plugins.control.registration import build_cluster_specs
from rlix_plugins.control.scheduling.config import SchedulerConfig, check_timeout, to_priority
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import load_run_config
from rlix_plugins.nemo_rl.recipe import layout, load_stock
from rlix_plugins.nemo_rl.topology import validate_topology
from rlix_plugins.pipeline.config import RuntimeConfig
from tests.test_cli import free_port, rlix

#: A NeMo RL master config that time-shares (two GPUs: train on 0, generate on 0 and 1).
GOOD: dict[str, Any] = {
    "rlix": {"train_devices": [0], "infer_devices": [0, 1]},
    "grpo": {"async_grpo": {"enabled": True}, "num_prompts_per_step": 4},
    "loss_fn": {"use_importance_sampling_correction": True},
    "policy": {"dtensor_cfg": {"enabled": True}, "megatron_cfg": {"enabled": False},
               "generation": {"backend": "vllm", "colocated": {"enabled": False},
                              "vllm_cfg": {"tensor_parallel_size": 1, "async_engine": True}}},
}


def _config(**changes: Any) -> dict[str, Any]:
    """GOOD with dotted keys changed (value ``...`` deletes the key)."""
    cfg = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, last = dotted.split("__")
        node = cfg
        for key in parents:
            node = node[key]
        if value is ...:
            node.pop(last, None)
        else:
            node[last] = value
    return cfg


def _run(**changes: Any) -> Callable[[], object]:
    return lambda: load_run_config(_config(**changes))


def _topology(**changes: Any) -> Callable[[], object]:
    def check() -> None:
        cfg = _config(**changes)
        validate_topology(cfg, load_run_config(cfg))
    return check


def _register(tp: dict[str, Any], mapping: dict[str, Any], pipeline_id: str = "p1") -> Callable[[], object]:
    return lambda: build_cluster_specs(pipeline_id, tp, mapping, num_gpus=4, gpus_per_node=4)


def _yaml(text: str) -> Callable[[Path], object]:
    def load(tmp: Path) -> object:
        path = tmp / "recipe.yaml"
        path.write_text(text)
        return load_stock(path)
    return load


#: (id, what is wrong, a zero-argument (or tmp_path) call that must raise, fragments the message must contain:
#: the bad field and the fix).
CASES: list[tuple[str, Callable[..., object], tuple[str, ...]]] = [
    ("no-rlix-section", _run(rlix=...), ("no 'rlix' section", "++rlix.train_devices=[0]")),
    ("train-devices-missing", _run(rlix__train_devices=...), ("rlix.train_devices is missing", "++rlix.train_devices=[0,1]")),
    ("devices-not-a-list", _run(rlix__infer_devices=3), ("rlix.infer_devices=3", "list of GPU ids, e.g. [0,1]")),
    ("negative-gpu-id", _run(rlix__train_devices=[-1]), ("rlix.train_devices=[-1]", "GPU ids >= 0")),
    ("gpu-listed-twice", _run(rlix__infer_devices=[0, 1, 1]), ("rlix.infer_devices=[0, 1, 1]", "list each GPU id once")),
    ("unknown-key-did-you-mean", _run(rlix__sleep_lvl=1), ("unknown rlix keys ['sleep_lvl']", "did you mean rlix.sleep_lvl -> rlix.sleep_level")),
    ("sleep-level-not-1-or-2", _run(rlix__sleep_level=3), ("rlix.sleep_level=3", "must be one of (1, 2)")),
    ("zero-timeout", _run(rlix__request_timeout_s=0), ("rlix.request_timeout_s=0", "must be a positive number of seconds")),
    ("negative-timeout", _run(rlix__sync_timeout_s=-5), ("rlix.sync_timeout_s=-5", "must be a positive number of seconds")),
    ("timeout-wrong-type", _run(rlix__drain_timeout_s="60s"), ("rlix.drain_timeout_s='60s'", "must be a positive number of seconds")),
    ("infer-tp-zero", _run(rlix__infer_tp=0), ("rlix.infer_tp=0", "must be a positive int")),
    ("verify-not-bool", _run(rlix__verify="yes"), ("rlix.verify='yes'", "must be true or false")),
    ("bucket-size-negative", _run(rlix__bucket_size_bytes=-1), ("rlix.bucket_size_bytes=-1", "must be a positive int")),
    ("heartbeat-lease-zero", _run(rlix__heartbeat_lease_s=0), ("rlix.heartbeat_lease_s=0", "must be a positive number of seconds")),
    ("runtime-step-target-estimate", lambda: RuntimeConfig(step_target_estimate=0), ("step_target_estimate=0", "must be an int >= 1")),
    ("train-not-subset-of-infer", _topology(rlix__train_devices=[2]), ("rlix.train_devices [2] must be a subset of rlix.infer_devices", "add them to rlix.infer_devices")),
    ("async-grpo-off", _topology(grpo__async_grpo={"enabled": False}), ("no time-shared GRPO loop selected", "grpo.async_grpo.enabled=true")),
    ("vllm-colocated", _topology(policy__generation__colocated={"enabled": True}), ("colocated", "policy.generation.colocated.enabled=false")),
    ("sleep-level-mismatch", _topology(policy__generation__vllm_cfg={"tensor_parallel_size": 1, "async_engine": True, "sleep_level": 1}),
     ("policy.generation.vllm_cfg.sleep_level=1 differs from rlix.sleep_level=2", "set both to the same value")),
    ("bad-pipeline-id", _register({"actor_infer": 1}, {"actor_infer": [0, 1]}, pipeline_id="a:b"), ("invalid pipeline_id 'a:b'", "no ':' or spaces")),
    ("gpu-out-of-range", _register({"actor_infer": 1}, {"actor_infer": [0, 7]}), ("GPU(s) [7] are not in the pool [0..3]", "use GPUs the Ray cluster has")),
    ("gpu-duplicated-in-mapping", _register({"actor_infer": 1}, {"actor_infer": [1, 1]}), ("lists GPU(s) [1] more than once", "list each GPU once")),
    ("train-gpus-not-in-infer", _register({"actor_train": 1, "actor_infer": 1}, {"actor_train": [3], "actor_infer": [0, 1]}),
     ("actor_train GPUs [3] are not in the actor_infer mapping", "add them to the inference mapping")),
    ("gpus-not-multiple-of-tp", _register({"actor_infer": 2}, {"actor_infer": [0, 1, 2]}), ("not a multiple of tp_size=2", "use 2 or 4 GPUs")),
    ("train-tp-not-1", _register({"actor_train": 2, "actor_infer": 1}, {"actor_train": [0, 1], "actor_infer": [0, 1, 2]}),
     ("cluster_tp_configs['actor_train']=2", "set cluster_tp_configs['actor_train']=1")),
    ("no-generation-cluster", _register({"actor_train": 1}, {"actor_train": [0]}), ("no 'actor_infer' cluster", "rlix.infer_devices=[0,1]")),
    ("unknown-cluster-name", _register({"actor_infer": 1, "actor_trian": 1}, {"actor_infer": [0, 1], "actor_trian": [0]}),
     ("unknown cluster name(s) ['actor_trian']", "valid names are")),
    ("priority-out-of-range", lambda: to_priority(99), ("unknown priority 99", "valid: INITIALIZATION=0")),
    ("priority-wrong-type", lambda: to_priority("high"), ("unknown priority 'high'", "GENERATION=6")),
    ("request-timeout-not-positive", lambda: check_timeout(0, 1800.0, "request_gpus(p1:actor_infer)"),
     ("request_gpus(p1:actor_infer): timeout_s=0", "a positive finite number of seconds")),
    ("scheduler-drift-threshold", lambda: SchedulerConfig(drift_threshold=1.5), ("SchedulerConfig.drift_threshold=1.5", "must be in (0, 1)")),
    ("recipe-malformed-yaml", _yaml("grpo: [unclosed\n"), ("is not valid YAML at line 2, column 1", "fix the recipe file")),
    ("recipe-not-a-mapping", _yaml("- a\n- b\n"), ("must be a YAML mapping", "a NeMo RL recipe")),
    ("recipe-too-many-pipelines", lambda: layout(27, [0, 1], 1), ("--pipelines 27", "at most 26")),
]


def test_good_config_passes() -> None:
    """The base every row changes in one place is itself accepted (so each row fails for its own reason)."""
    validate_topology(GOOD, load_run_config(GOOD))
    build_cluster_specs("p1", {"actor_train": 1, "actor_infer": 1}, {"actor_train": [0], "actor_infer": [0, 1]},
                        num_gpus=4, gpus_per_node=4)


def test_at_least_15_distinct_cases() -> None:
    assert len({case_id for case_id, _, _ in CASES}) == len(CASES) >= 15


@pytest.mark.parametrize(("make", "fragments"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_rejected_with_a_fix_it_message(make: Callable[..., object], fragments: tuple[str, ...], tmp_path: Path) -> None:
    with pytest.raises(RlixConfigError) as err:
        make(tmp_path) if make.__code__.co_argcount else make()
    for fragment in fragments:
        assert fragment in str(err.value), (fragment, str(err.value))


#: CLI misuse through the real entry point: (argv, fragment of the last stderr line). ``{tmp}``: a fresh directory.
CLI_MISUSE: list[tuple[str, list[str], str]] = [
    ("unknown-subcommand", ["nonsense"], "invalid choice: 'nonsense'"),
    ("no-subcommand", [], "the following arguments are required: COMMAND"),
    ("recipe-missing-args", ["recipe"], "the following arguments are required: STOCK.yaml, --gpus, --out"),
    ("recipe-bad-gpus", ["recipe", "x.yaml", "--gpus", "a,b", "--out", "{tmp}/o"], "expected GPU ids like 0 or 0,1, got 'a,b'"),
    ("recipe-missing-file", ["recipe", "{tmp}/nope.yaml", "--gpus", "0,1", "--out", "{tmp}/o"], "cannot read the recipe"),
    ("recipe-malformed-yaml", ["recipe", "{tmp}/bad.yaml", "--gpus", "0,1", "--out", "{tmp}/o"], "is not valid YAML"),
    ("status-no-cluster", ["status"], "no Ray cluster to act on: `rlix up` has not started one"),
    ("down-no-cluster", ["down"], "no Ray cluster to act on: `rlix up` has not started one"),
    ("status-unreachable", ["status", "--address", "127.0.0.1:{port}"], "no Ray cluster reachable at '127.0.0.1:"),
    ("up-zero-gpus", ["up", "--num-gpus", "0"], "expected a positive integer, got 0"),
    ("timeline-missing-out", ["timeline"], "the following arguments are required: --out"),
    ("patch-bad-action", ["patch", "explode", "--nemo-rl", "{tmp}"], "invalid choice: 'explode'"),
    ("demo-zero-steps", ["demo", "--steps", "0"], "expected a positive integer, got 0"),
]


@pytest.mark.parametrize(("argv", "fragment"), [c[1:] for c in CLI_MISUSE], ids=[c[0] for c in CLI_MISUSE])
def test_cli_misuse_is_one_error_line_never_a_traceback(argv: list[str], fragment: str, tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("grpo: [unclosed\n")
    args = [a.format(tmp=tmp_path, port=free_port()) for a in argv]
    res = rlix(*args, state_dir=tmp_path / "state")
    err = res.stderr.strip()
    assert res.returncode != 0 and "Traceback" not in err, err[-2000:]
    lines = err.splitlines()
    assert len(lines) == 1 or lines[0].startswith("usage: rlix"), err[-2000:]  # argparse: usage, then the error
    assert lines[-1].startswith("rlix") and fragment in lines[-1], err[-2000:]
    assert not (tmp_path / "o").exists()
