"""The hook specification has one source, ``rlix_plugins.nemo_rl.hookspec``: patch 0001 is generated from it, and
the seam checks every implementation against it when it registers it. CI, no NeMo RL checkout needed."""

from __future__ import annotations

import importlib.util
import inspect
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pluggy
import pytest

from rlix_plugins import _seam_patch
from rlix_plugins.nemo_rl import hookspec
from rlix_plugins.nemo_rl.hooks import NemoRLHooks
from rlix_plugins.pipeline.versions import version_after_step
from tests.nemo_rl._nemo_checkout import SEAM_PATCH, seam_from_patch

impl = pluggy.HookimplMarker(hookspec.PROJECT_NAME)


@pytest.fixture
def seam(tmp_path: Path) -> ModuleType:
    """The seam exactly as NeMo RL gets it (materialised from the shipped patch 0001)."""
    spec = importlib.util.spec_from_file_location("rlix_hooks_seam_spec_test", seam_from_patch(tmp_path))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_patch_0001_is_generated_from_the_hookspec_module() -> None:
    """Edit the hookspec (or the version rule) and forget `python -m rlix_plugins._seam_patch`: this fails."""
    assert SEAM_PATCH.resolve() == _seam_patch.SEAM_PATCH.resolve()
    assert SEAM_PATCH.read_text(encoding="utf-8") == _seam_patch.seam_patch_text(), (
        "patches/nemo-rl/7ea279a/0001 differs from rlix_plugins/nemo_rl/hookspec.py: "
        "run `python -m rlix_plugins._seam_patch`")
    assert _seam_patch.main(["--check"]) == 0


def test_the_seam_imports_nothing_of_ours_and_uses_the_one_version_rule(seam: ModuleType) -> None:
    text = inspect.getsource(seam)
    assert "rlix_plugins" not in text.replace("Defined in rlix_plugins.pipeline.versions", "")
    assert inspect.getsource(seam.version_after_step) == inspect.getsource(version_after_step)
    assert [seam.NoOpRLixHooks().after_training(step=s) for s in (0, 4)] == [1, 5]
    assert seam.HOOK_NAMES == hookspec.HOOK_NAMES


class Defaulted:
    @impl
    def on_trajectory_collector_created(self, collector: Any, replay_buffer: Any = None) -> None:
        """The 2026-11-24 bug: pluggy never passes ``replay_buffer``."""


class Misspelt:
    @impl
    def before_trainig(self, step: int) -> None: ...


class Extra:
    @impl
    def before_training(self, step: int, gpus: list[int]) -> None: ...


@pytest.mark.parametrize(
    ("plugin", "match"),
    [
        (Defaulted(), r"bad: on_trajectory_collector_created\(collector: 'Any', replay_buffer: 'Any' = None\).*"
                      r"has defaults for \['replay_buffer'\]: pluggy never passes them"),
        (Misspelt(), r"bad: before_trainig\(step: 'int'\).*is not a hook of RLixHookSpec \(hooks: rlix_placement"),
        (Extra(), r"Argument\(s\) \{'gpus'\} are declared in the hookimpl but can not be found in the hookspec"),
    ],
)
def test_registration_refuses_what_the_spec_does_not_allow(seam: ModuleType, plugin: Any, match: str) -> None:
    """Rejected when registered (the seam's ``register``, which its loader uses for every entry point), and the
    manager is left as it was."""
    pm = seam.plugin_manager()
    with pytest.raises(pluggy.PluginValidationError, match=match):
        seam.register(pm, plugin, "bad")
    assert pm.get_plugin("bad") is None and pm.is_registered(plugin) is False


def test_our_hooks_register_cleanly(seam: ModuleType) -> None:
    pm = seam.plugin_manager()
    seam.register(pm, NemoRLHooks(), "rlix")
    ours = {c.name for c in pm.get_hookcallers(pm.get_plugin("rlix"))}
    assert ours == set(seam.HOOK_NAMES)
