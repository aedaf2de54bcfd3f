"""The ``rlix:`` section of a NeMo RL config (``++rlix.train_devices=[0] ++rlix.infer_devices=[0,1]``).

Its keys are the fields of :class:`RlixRunConfig` and of the runtime's
:class:`~rlix_plugins.pipeline.config.RuntimeConfig` (sleep level, every timeout, ...), each documented where it is
declared; Hydra overrides ``++rlix.<key>=<value>`` work like any other NeMo RL key. :func:`load_run_config` parses
the section once, into one record; the records' ``__post_init__`` validate every value (nothing else does).

The device lists are checked against the pool by the orchestrator on registration (clear errors there); the
topology against the rest of the config by :mod:`rlix_plugins.nemo_rl.topology`.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Final, Literal

from rlix_plugins.control.registration import parse_cluster_memory, pipeline_registration
from rlix_plugins.control.types import GENERATION_CLUSTER, TRAIN_CLUSTER
from rlix_plugins.errors import RlixConfigError
from rlix_plugins.pipeline.config import RuntimeConfig

if TYPE_CHECKING:  # the coordinator module imports Ray; hooks.py (and this module) must import without it
    from rlix_plugins.control.coordinator import CoordinatorConfig

SECTION: Final = "rlix"
DEFAULT_BUCKET_SIZE_BYTES: Final = 256 << 20


@dataclass(frozen=True)
class RlixRunConfig:
    """One time-shared NeMo RL run: the parsed ``rlix`` section (:func:`load_run_config`). Validated here, once."""

    #: GPU ids of the pool the training workers use (one GPU per worker); required.
    train_devices: tuple[int, ...]
    #: GPU ids of the vLLM ranks, a superset of ``train_devices`` (partial overlap); required.
    infer_devices: tuple[int, ...]
    #: GPUs per vLLM DP rank; default ``policy.generation.vllm_cfg.tensor_parallel_size``.
    infer_tp: int
    #: The shared runtime's knobs, read from the same section (``rlix.sleep_level``, ``rlix.sync_timeout_s``, ...);
    #: ``step_target_estimate`` defaults to ``grpo.num_prompts_per_step`` here.
    runtime: RuntimeConfig
    #: A fixed pipeline id; default: the orchestrator allocates ``ft_<12 hex>`` in ``setup()`` (the placement hook),
    #: which hands it to the loop's hooks with its registration (:func:`.placement.take_setup`).
    pipeline_id: str | None = None
    #: Ray cluster of the control plane; default: the cluster this driver runs on.
    ray_address: str | None = None
    #: Size of one CPU cache bucket (explicit: it must fit the VRAM left after a wake-up next to a co-tenant's KV
    #: cache; one ~1 GB bucket ran out of memory there).
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    #: The driver's heartbeat lease (``CoordinatorConfig.heartbeat_lease_s``): a driver that stops responding while
    #: it holds GPUs is failed after this and its GPUs return; default the coordinator's (120 s).
    heartbeat_lease_s: float | None = None
    #: What each cluster keeps on a GPU, by cluster name (``actor_train``/``actor_infer`` ->
    #: ``{gpu_gib, awake_gib, asleep_gib}``; ``rlix recipe`` writes it from the memory budget). With it this
    #: pipeline's rollout may run next to another pipeline's training step on a GPU where both fit (co-residence,
    #: DESIGN §4); without it, its turns on a GPU are exclusive.
    memory: Mapping[str, Mapping[str, float]] | None = None
    #: After each step the trainer's weights and optimizer states go to host memory (NeMo RL's
    #: ``offload_after_refit``: 9-15 s of every training grant at the Qwen2.5-1.5B shape on an H200). False: they
    #: stay on the GPU and only the allocator's free blocks are handed back; the GPU then keeps the trainer's states
    #: while the pipeline rolls out (``rlix recipe`` writes False, with the memory figures to match, where they fit
    #: the states there at no cost to what runs together; ``--trainer-offload`` / ``--no-trainer-offload`` decide).
    offload_trainer: bool = True

    def registration(self) -> dict[str, Any]:
        """The keyword arguments of ``ControlPlane.register_pipeline`` for this run (``pipeline_registration``)."""
        return pipeline_registration(self.train_devices, self.infer_devices, infer_tp=self.infer_tp,
                                     pipeline_id=self.pipeline_id, coordinator_config=self.coordinator_config(),
                                     cluster_memory=self.memory)

    def register(self, cp: Any) -> Any:
        """Register + admit this run's pipeline on the control plane ``cp`` (a ``client.ControlPlane``); returns
        its ``PipelineHandle``. The one way the NeMo RL host registers (setup()'s placement, the loop's hooks)."""
        return cp.register_pipeline(**self.registration())

    def coordinator_config(self) -> CoordinatorConfig | None:
        """The pipeline coordinator's config (None: the defaults)."""
        if self.heartbeat_lease_s is None:
            return None
        from rlix_plugins.control.coordinator import CoordinatorConfig

        return CoordinatorConfig(heartbeat_lease_s=self.heartbeat_lease_s)

    def __post_init__(self) -> None:
        for key in ("train_devices", "infer_devices"):
            object.__setattr__(self, key, _devices(key, getattr(self, key)))
        if not _is_int(self.infer_tp) or self.infer_tp <= 0:
            raise RlixConfigError(f"{SECTION}.infer_tp={self.infer_tp!r} must be a positive int (GPUs per vLLM DP rank)")
        if not _is_int(self.bucket_size_bytes) or self.bucket_size_bytes <= 0:
            raise RlixConfigError(f"{SECTION}.bucket_size_bytes={self.bucket_size_bytes!r} must be a positive int")
        if self.heartbeat_lease_s is not None:
            try:
                self.coordinator_config()
            except RlixConfigError as exc:
                raise RlixConfigError(f"{SECTION}.heartbeat_lease_s={self.heartbeat_lease_s!r}: {exc}") from None
        if not isinstance(self.offload_trainer, bool):
            raise RlixConfigError(f"{SECTION}.offload_trainer={self.offload_trainer!r} must be true or false")
        for key in ("pipeline_id", "ray_address"):
            value = getattr(self, key)
            if value is not None and not isinstance(value, str):
                raise RlixConfigError(f"{SECTION}.{key}={value!r} must be a string")
        if self.memory is not None:
            memory = dict(self.memory) if isinstance(self.memory, Mapping) else self.memory
            if not isinstance(memory, dict) or not set(memory) <= {TRAIN_CLUSTER, GENERATION_CLUSTER}:
                raise RlixConfigError(f"{SECTION}.memory={self.memory!r} must map {TRAIN_CLUSTER!r} and/or "
                                      f"{GENERATION_CLUSTER!r} to {{gpu_gib, awake_gib, asleep_gib}}")
            plain = {k: dict(v) if isinstance(v, Mapping) else v for k, v in memory.items()}
            for name, figures in plain.items():
                try:
                    parse_cluster_memory(name, figures)
                except RlixConfigError as exc:
                    raise RlixConfigError(f"{SECTION}.memory: {exc}") from None
            object.__setattr__(self, "memory", plain)


_RUN_KEYS: Final = frozenset(f.name for f in fields(RlixRunConfig)) - {"runtime"}
_RUNTIME_KEYS: Final = frozenset(f.name for f in fields(RuntimeConfig))
_KNOWN_KEYS: Final = _RUN_KEYS | _RUNTIME_KEYS


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _devices(key: str, raw: Any) -> tuple[int, ...]:
    if raw is None:
        raise RlixConfigError(
            f"{SECTION}.{key} is missing; RLIX_CONTROL_PLANE=rlix needs it, e.g. ++{SECTION}.{key}=[0,1] "
            "(GPU ids of the shared pool)"
        )
    if isinstance(raw, str | bytes):
        raise RlixConfigError(f"{SECTION}.{key}={raw!r} must be a non-empty list of GPU ids, e.g. [0,1]")
    try:
        values = tuple(raw)
    except TypeError:
        raise RlixConfigError(f"{SECTION}.{key}={raw!r} must be a list of GPU ids, e.g. [0,1]") from None
    if not values or not all(_is_int(v) and v >= 0 for v in values):
        raise RlixConfigError(f"{SECTION}.{key}={list(values)!r} must be a non-empty list of GPU ids >= 0")
    if len(set(values)) != len(values):
        raise RlixConfigError(f"{SECTION}.{key}={list(values)!r} lists a GPU twice; list each GPU id once")
    return values


def cfg_get(obj: Any, key: str) -> Any:
    """``obj[key]`` for mappings, ``obj.key`` for NeMo RL's pydantic configs (``extra="allow"``); else None."""
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    value = getattr(obj, key, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(key)
    return value


def cfg_path(obj: Any, dotted: str) -> Any:
    for key in dotted.split("."):
        obj = cfg_get(obj, key)
    return obj


def cfg_set(obj: Any, dotted: str, value: Any) -> None:
    """Write ``value`` at ``dotted`` in NeMo RL's config (mappings or attribute objects such as its ``MasterConfig``),
    creating missing mapping levels."""
    *parents, leaf = dotted.split(".")
    for key in parents:
        child = cfg_get(obj, key)
        if child is None:
            child = {}
            cfg_set(obj, key, child)
        obj = child
    if isinstance(obj, MutableMapping):
        obj[leaf] = value
    else:
        setattr(obj, leaf, value)


#: NeMo RL's training backends whose workers the CPU bucket cache is built in (``policy.<name>_cfg.enabled``).
Trainer = Literal["megatron", "dtensor"]


def policy_trainer(master_config: Any) -> Trainer:
    """The training backend NeMo RL's ``Policy`` builds its workers with (the same rule as its ``lm_policy.py``:
    exactly one of ``policy.megatron_cfg.enabled`` / ``policy.dtensor_cfg.enabled``)."""
    megatron = bool(cfg_path(master_config, "policy.megatron_cfg.enabled"))
    dtensor = bool(cfg_path(master_config, "policy.dtensor_cfg.enabled"))
    if megatron == dtensor:
        raise RlixConfigError(
            f"policy.megatron_cfg.enabled={megatron} and policy.dtensor_cfg.enabled={dtensor}: enable exactly one "
            "training backend (the weight cache is built in its workers)")
    return "megatron" if megatron else "dtensor"


#: Prefix of a pipeline's TransferQueue Ray namespace (:func:`scope_data_plane`).
TQ_NAMESPACE_PREFIX: Final = "rlix_tq_"


def scope_data_plane(master_config: Any, pipeline_id: str) -> str | None:
    """With ``data_plane.enabled``: write ``data_plane.rlix_namespace`` (the Ray namespace of this pipeline's
    TransferQueue controller and storage actors, patch 0007; every NeMo RL process gets it with the data-plane
    config) and return it; else None. NeMo RL's own processes read it, and it names the pipeline there
    (:func:`data_plane_pipeline_id`)."""
    section = cfg_get(master_config, "data_plane")
    if section is None or not cfg_get(section, "enabled"):
        return None
    namespace = f"{TQ_NAMESPACE_PREFIX}{pipeline_id}"
    cfg_set(section, "rlix_namespace", namespace)
    return namespace


def data_plane_pipeline_id(master_config: Any) -> str | None:
    """The pipeline id :func:`scope_data_plane` wrote into ``master_config`` (a copy in another process, such as
    the SingleController's actor), else None."""
    namespace = cfg_path(master_config, "data_plane.rlix_namespace")
    if isinstance(namespace, str) and namespace.startswith(TQ_NAMESPACE_PREFIX):
        return namespace[len(TQ_NAMESPACE_PREFIX):]
    return None


def load_run_config(master_config: Any) -> RlixRunConfig:
    """Parses the ``rlix`` section of NeMo RL's master config once (not the topology: see topology.py)."""
    raw = cfg_get(master_config, SECTION)
    if raw is None:
        raise RlixConfigError(
            f"RLIX_CONTROL_PLANE=rlix but the config has no '{SECTION}' section; add e.g. "
            f"++{SECTION}.train_devices=[0] ++{SECTION}.infer_devices=[0,1] (or unset RLIX_CONTROL_PLANE)"
        )
    section = dict(raw) if isinstance(raw, Mapping) else dict(vars(raw))
    unknown = sorted(set(section) - _KNOWN_KEYS)
    if unknown:
        hints = [f"{SECTION}.{k} -> {SECTION}.{m[0]}" for k in unknown
                 if (m := difflib.get_close_matches(k, _KNOWN_KEYS, n=1, cutoff=0.6))]
        raise RlixConfigError(f"unknown {SECTION} keys {unknown}"
                              + (f" (did you mean {', '.join(hints)}?)" if hints else "")
                              + f"; valid: {sorted(_KNOWN_KEYS)}")
    runtime = {k: v for k, v in section.items() if k in _RUNTIME_KEYS}
    runtime.setdefault("step_target_estimate", cfg_path(master_config, "grpo.num_prompts_per_step") or 1)
    run = {k: v for k, v in section.items() if k in _RUN_KEYS}
    if run.get("infer_tp") is None:
        run["infer_tp"] = cfg_path(master_config, "policy.generation.vllm_cfg.tensor_parallel_size") or 1
    try:
        runtime_config = RuntimeConfig(**runtime)
    except RlixConfigError as exc:  # its messages start with the field: name the key a NeMo RL user sets
        raise RlixConfigError(f"{SECTION}.{exc}") from None
    return RlixRunConfig(**{"train_devices": None, "infer_devices": None, **run}, runtime=runtime_config)
