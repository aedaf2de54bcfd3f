"""GPU time-sharing seam for async GRPO (opt-in, off by default).

``setup()`` and ``async_grpo_train`` read ``RLIX_CONTROL_PLANE`` through :func:`load_rlix_hooks`:

* unset or empty: returns ``None`` and nothing else happens. No plugin is imported,
  pluggy is not imported, and the training loop runs exactly as without this file.
* ``rlix``: the GPU time-sharing mode. Implementations are discovered through the
  entry-point group :data:`ENTRY_POINT_GROUP`; at least one must be installed.
* any other value: ``ValueError`` (no silent fallback to standalone mode).

NeMo RL never imports an implementation by name: a plugin names it in that group (a class
is instantiated without arguments) and marks its methods with ``HookimplMarker(PROJECT_NAME)``.
"""

from __future__ import annotations

import inspect
import os
from typing import Any

from rlix_plugins.pipeline.versions import version_after_step

#: Environment variable that selects the control plane.
ENV_VAR = "RLIX_CONTROL_PLANE"
#: The only value that turns time-sharing on.
TIME_SHARING_VALUE = "rlix"
#: Entry-point group implementations register under.
ENTRY_POINT_GROUP = "nemo_rl.rlix_hooks"
#: pluggy project name (``HookimplMarker(PROJECT_NAME)`` marks implementations).
PROJECT_NAME = "nemo_rl_rlix"


class RLixHookSpec:
    """The hooks setup() and async GRPO call in time-sharing mode, in call order.

    Every hook is called with keyword arguments. ``rlix_placement`` and ``after_training`` are
    first-result; the others call every implementation. An exception in a hook fails the training run.
    """

    def rlix_placement(self, master_config: Any) -> Any:
        """In ``setup()``, before any cluster or worker exists (first result).

        Returns ``None`` (NeMo RL builds its own clusters) or ``(train_cluster,
        inference_cluster, policy_kwargs, generation_kwargs)``: clusters whose placement groups
        are shared with other pipelines, and extra keywords for ``Policy`` / ``VllmGeneration``
        (a per-pipeline ``name_prefix``). Then setup() creates no static refit NCCL world.
        """

    def rlix_pipeline_start(
        self, master_config: Any, policy: Any, policy_generation: Any, start_step: int
    ) -> None:
        """After setup, before the replay buffer and trajectory collector exist.

        Register the pipeline with the control plane and prepare ``policy_generation`` before it
        is pickled into the collector. May block until the pipeline is admitted.
        """

    def on_trajectory_collector_created(self, collector: Any, replay_buffer: Any) -> None:
        """Right after the collector actor is created, before collection starts. Replaces the
        initial refit: generation must hold real weights (vLLM starts with dummy ones) on return."""

    def before_training(self, step: int) -> None:
        """Before the first use of the training GPUs in ``step``; blocks until they are granted."""

    def before_weight_sync(self, step: int) -> None:
        """After ``policy.train`` of ``step``, while the parameters are still on the GPUs."""

    def after_training(self, step: int) -> int:
        """Replaces the refit block of ``step``. Returns the weight version the loop publishes
        (``>= 0``; the standalone loop publishes :func:`version_after_step`)."""

    def on_weight_version_published(self, step: int, weight_version: int) -> Any:
        """After the collector received ``weight_version``; may return ``rlix/`` step metrics."""

    def before_checkpoint(self, step: int) -> None:
        """Before ``policy.save_checkpoint`` of ``step`` (blocks until the training GPUs are held)."""

    def after_checkpoint(self, step: int) -> None:
        """After the checkpoint of ``step`` was written."""

    def on_pipeline_end(self) -> None:
        """In the ``finally`` of ``async_grpo_train``, before the actors are shut down."""


HOOK_NAMES = tuple(name for name in vars(RLixHookSpec) if not name.startswith("_"))


class NoOpRLixHooks:
    """The default implementation, registered last: the standalone weight-version rule.

    Hooks without any implementation do nothing; ``after_training`` answers
    :func:`version_after_step` unless a plugin answers first.
    """

    def after_training(self, step: int) -> int:
        return version_after_step(step)


class RLixHooks:
    """Calls every registered implementation; built only by :func:`load_rlix_hooks`."""

    def __init__(self, plugin_manager: Any) -> None:
        #: The pluggy PluginManager (``get_plugin(name)`` returns an implementation).
        self.plugin_manager = plugin_manager
        self._hook = plugin_manager.hook

    def __getattr__(self, name: str) -> Any:
        if name in HOOK_NAMES:  # keyword arguments only, as pluggy requires
            return getattr(self._hook, name)
        raise AttributeError(name)

    def after_training(self, *, step: int) -> int:
        version = self._hook.after_training(step=step)
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise RuntimeError(
                f"after_training(step={step}) returned {version!r}; a plugin must return the "
                "weight version to publish, an int >= 0 (never the bootstrap version -1)."
            )
        return version

    def on_weight_version_published(self, **kwargs: Any) -> dict[str, Any]:
        results = self._hook.on_weight_version_published(**kwargs)
        return {k: v for r in results if r for k, v in r.items()}


def time_sharing_requested() -> bool:
    """Whether ``RLIX_CONTROL_PLANE`` selects time-sharing. Raises ``ValueError`` on unknown values."""
    value = os.environ.get(ENV_VAR, "")
    if value == "":
        return False
    if value == TIME_SHARING_VALUE:
        return True
    raise ValueError(
        f"{ENV_VAR}={value!r} is not a known control plane; valid values: "
        f"{TIME_SHARING_VALUE!r} (GPU time-sharing) or unset (standalone NeMo RL)."
    )


def register(pm: Any, plugin: Any, name: str) -> None:
    """Registers ``plugin`` and checks it against :class:`RLixHookSpec` where pluggy does not: a
    hook the spec lacks, and a parameter with a default (pluggy never passes it)."""
    import pluggy

    pm.register(plugin, name=name)
    for caller in pm.get_hookcallers(plugin) or ():
        for impl in caller.get_hookimpls():
            if impl.plugin is not plugin:
                continue
            if caller.name not in HOOK_NAMES:
                problem = f"is not a hook of RLixHookSpec (hooks: {', '.join(HOOK_NAMES)})"
            elif impl.kwargnames:
                problem = f"has defaults for {list(impl.kwargnames)}: pluggy never passes them"
            else:
                continue
            pm.unregister(plugin)
            signature = f"{caller.name}{inspect.signature(impl.function)}"
            raise pluggy.PluginValidationError(plugin, f"{name}: {signature} {problem}")


def plugin_manager() -> Any:
    """A pluggy PluginManager with the spec and the no-op default, and no plugin yet."""
    import pluggy

    pm = pluggy.PluginManager(PROJECT_NAME)
    spec = pluggy.HookspecMarker(PROJECT_NAME)
    for name in HOOK_NAMES:
        spec(firstresult=name in ("rlix_placement", "after_training"))(getattr(RLixHookSpec, name))
    pm.add_hookspecs(RLixHookSpec)
    pluggy.HookimplMarker(PROJECT_NAME)(trylast=True)(NoOpRLixHooks.after_training)
    register(pm, NoOpRLixHooks(), "nemo_rl.noop")
    return pm


def load_rlix_hooks() -> RLixHooks | None:
    """Returns ``None`` in standalone mode, else the hooks of every installed implementation."""
    if not time_sharing_requested():
        return None
    from importlib.metadata import entry_points

    try:
        pm = plugin_manager()
    except ImportError as e:
        raise RuntimeError(
            f"{ENV_VAR}={TIME_SHARING_VALUE} needs the 'pluggy' package: pip install pluggy "
            "(it comes with rlix-plugins), or unset the variable."
        ) from e
    found = list(entry_points(group=ENTRY_POINT_GROUP))
    if not found:
        raise RuntimeError(
            f"{ENV_VAR}={TIME_SHARING_VALUE} but no implementation is registered under the "
            f"entry-point group {ENTRY_POINT_GROUP!r}: install one in this environment "
            "(pip install rlix-plugins) or unset the variable."
        )
    for ep in found:
        try:
            obj = ep.load()
        except Exception as e:
            raise RuntimeError(
                f"{ENV_VAR}={TIME_SHARING_VALUE}: cannot load the {ENTRY_POINT_GROUP!r} entry point "
                f"{ep.name} = {ep.value} ({type(e).__name__}: {e}); reinstall the plugin or unset "
                "the variable."
            ) from e
        register(pm, obj() if isinstance(obj, type) else obj, ep.name)
    return RLixHooks(pm)
