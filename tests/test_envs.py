"""``rlix_plugins.envs``: the one reader of environment variables. A bad value of an rlix variable is a one-line
``RlixConfigError`` naming it, raised where production code reads it; and no other module reads ``os.environ``."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from rlix_plugins import envs
from rlix_plugins.errors import RlixConfigError
from tests._repo import REPO

PACKAGE = REPO / "rlix_plugins"

#: (module, source line) -> why it may touch ``os.environ`` itself. Everything else reads through ``envs``.
ALLOWED = {
    ("rlix_plugins/envs.py", None): "the one reader",
    ("rlix_plugins/nemo_rl/hookspec.py", 'value = os.environ.get(ENV_VAR, "")'):
        "the source of NeMo RL's seam file (patch 0001), which never imports rlix_plugins",
    ("rlix_plugins/vllm/plugin.py", 'return os.environ.get(CONTROL_PLANE_ENV) == "rlix"'):
        "vLLM's entry point, imported in standalone processes too, where nothing else of ours may be imported",
    ("rlix_plugins/nemo_rl/megatron_nccl.py",
     "previous = env.get(key, (os.environ if inherited is None else inherited).get(key))"):
        "the environment a Ray worker inherits, as a mapping, to build that worker's env",
    ("rlix_plugins/control/admin/local_cluster.py", "env = dict(os.environ)"): "builds `ray start`'s environment",
    ("rlix_plugins/demo/engine.py", "os.environ.update(env)"): "write: the engine's env before vLLM",
    ("rlix_plugins/vllm/engine_actor.py", "os.environ.update(env or {})"): "write: the engine's env before vLLM",
    ("rlix_plugins/demo/run.py", 'os.environ.setdefault("HF_HUB_OFFLINE", "1")'): "write: the demo runs offline",
    ("rlix_plugins/transport/_place.py", "os.environ.update({envs.RLIX_NODE_ID: found[0], envs.RLIX_NODE_IP: found[1]})"):
        "write: a Ray process's node, for the child processes it starts",
    ("rlix_plugins/vllm/ports.py", "os.environ.update({envs.VLLM_PORT: str(port)})"):
        "write: the engine's own port window, before vLLM picks ports",
    ("rlix_plugins/control/admin/ray_auth.py", 'os.environ[MODE_ENV] = "token"'):
        "write: token mode on Ray 2.56, what Ray 2.60's _enable_token_auth does",
}


def _environ_uses(path: Path) -> list[str]:
    """The source lines of ``path`` that touch ``os.environ`` / ``os.getenv`` (or import them from ``os``)."""
    source = path.read_text(encoding="utf-8")
    lines = source.splitlines()
    hits = []
    names = ("environ", "getenv", "environb", "getenvb")
    for node in ast.walk(ast.parse(source)):
        attr = isinstance(node, ast.Attribute) and node.attr in names and isinstance(node.value, ast.Name) \
            and node.value.id == "os"
        imported = isinstance(node, ast.ImportFrom) and node.module == "os" and any(a.name in names for a in node.names)
        if attr or imported:
            hits.append(lines[node.lineno - 1].strip())
    return hits


def test_no_module_reads_the_environment_but_envs() -> None:
    seen, offenders = set(), []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        for line in _environ_uses(path):
            key = (rel, None) if (rel, None) in ALLOWED else (rel, line)
            if key in ALLOWED:
                seen.add(key)
            else:
                offenders.append(f"{rel}: {line}")
    assert not offenders, "read environment variables through rlix_plugins.envs:\n" + "\n".join(offenders)
    assert seen == set(ALLOWED), f"stale allowances: {set(ALLOWED) - seen}"


def test_every_rlix_variable_in_the_package_is_in_the_table() -> None:
    table = {v.name for v in envs.VARIABLES}
    named = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("RLIX_") \
                    and node.value.isupper() and node.value != "RLIX_NAMESPACE":  # a Python name, not a variable
                named.add(node.value)
    assert named and named <= table, sorted(named - table)


@pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
def test_a_bad_init_timeout_fails_the_start_gate_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                                     value: str) -> None:
    """Through the production reader: a vLLM worker's start-up gate reads RLIX_INIT_TIMEOUT_S before it connects."""
    from rlix_plugins.control.start_gate import hold_start_grant

    monkeypatch.setenv("RLIX_PIPELINE_ID", "ft_000000000001")
    monkeypatch.setenv("RLIX_INIT_TIMEOUT_S", value)  # after import: read when used
    with pytest.raises(RlixConfigError, match=rf"RLIX_INIT_TIMEOUT_S='{value}' is not a positive number of seconds"):
        hold_start_grant()


def test_values_are_read_when_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RLIX_INIT_TIMEOUT_S", raising=False)
    assert envs.init_timeout_s() == envs.DEFAULT_INIT_TIMEOUT_S
    monkeypatch.setenv("RLIX_INIT_TIMEOUT_S", "12.5")
    assert envs.init_timeout_s() == 12.5
    monkeypatch.setenv("RLIX_PROFILE_PULL", "x")
    with pytest.raises(RlixConfigError, match="RLIX_PROFILE_PULL='x' is not an int >= 0"):
        envs.profile_pull()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    assert envs.time_sharing()
    monkeypatch.setenv("RLIX_CONTROL_PLANE", "other")  # the NeMo RL seam rejects it; our readers mean standalone
    assert not envs.time_sharing()
