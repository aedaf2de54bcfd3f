"""The control package's public face: every re-exported name is the defining module's object, the records and the
pure planner import without Ray, and no module of the package imports NeMo RL, vLLM or torch."""

from __future__ import annotations

import importlib
import json
import pkgutil
import subprocess
import sys

import rlix_plugins.control as control


def test_every_public_name_is_the_object_its_module_defines() -> None:
    for name in control.__all__:
        obj = getattr(control, name)
        home = importlib.import_module(obj.__module__ if name[0].islower() or not name.isupper()
                                       else "rlix_plugins.control.types")  # constants: strings of types.py
        assert home.__name__.startswith("rlix_plugins.control."), (name, home.__name__)
        assert getattr(home, name) is obj, name
    assert control.connect is importlib.import_module("rlix_plugins.control.client").connect
    assert control.ray_get is importlib.import_module("rlix_plugins.control.rpc").ray_get


def _loaded_after(code: str) -> dict[str, bool]:
    probe = code + (
        "\nimport json, sys\n"
        "print(json.dumps({m: any(k == m or k.startswith(m + '.') for k in sys.modules)"
        " for m in ('ray', 'vllm', 'nemo_rl', 'torch')}))\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_records_and_pure_planner_import_without_ray() -> None:
    loaded = _loaded_after("from rlix_plugins.control import Priority, ClusterSpec, plan_cycle, build_cluster_specs, "
                           "SchedulerConfig")
    assert loaded == {"ray": False, "vllm": False, "nemo_rl": False, "torch": False}
    assert _loaded_after("from rlix_plugins.control import ray_get")["ray"]  # the lazy path really imports


def test_no_control_module_imports_nemo_rl_vllm_or_torch() -> None:
    names = [m.name for m in pkgutil.walk_packages(control.__path__, "rlix_plugins.control.")]
    assert {"rlix_plugins.control.scheduling.scheduler", "rlix_plugins.control.admin.commands",
            "rlix_plugins.control.capacity.comparison", "rlix_plugins.control.rpc"} <= set(names)
    loaded = _loaded_after("import importlib\n" + "".join(f"importlib.import_module({n!r})\n" for n in names))
    assert loaded == {"ray": True, "vllm": False, "nemo_rl": False, "torch": False}
