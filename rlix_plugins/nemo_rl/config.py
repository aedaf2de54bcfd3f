"""The ``rlix:`` section of a NeMo RL config (``++rlix.train_devices=[0] ++rlix.infer_devices=[0,1]``).

Keys (all under ``rlix``; Hydra overrides ``++rlix.<key>=<value>`` work like any other NeMo RL key):

* ``train_devices`` (required): GPU ids of the pool the training workers use (one GPU per worker).
* ``infer_devices`` (required): GPU ids of the vLLM ranks; a superset of ``train_devices`` (partial overlap).
* ``infer_tp`` (optional): GPUs per vLLM DP rank; default ``policy.generation.vllm_cfg.tensor_parallel_size``.
* ``pipeline_id`` (optional): a fixed id; default: the orchestrator allocates ``ft_<12 hex>`` (in ``setup()`` when
  the shared placement runs, which writes it back here so the worker names and the registration agree).
* ``ray_address`` (optional): Ray cluster of the control plane; default: the cluster this driver runs on.
* ``bucket_size_bytes`` (optional, default 256 MiB): size of one CPU cache bucket (explicit: it must fit the VRAM
  left after a wake-up next to a co-tenant's KV cache; reference bug 5).
* ``sleep_level`` (optional, default 2): vLLM sleep level of scheduler-driven shrinks (1 keeps weights in host
  memory; debug #58). Must equal ``policy.generation.vllm_cfg.sleep_level`` (patch 0003) when that is set.
* timeouts (seconds, optional): ``request_timeout_s`` (1800), ``init_timeout_s`` (900), ``sync_timeout_s`` (150),
  ``drain_timeout_s`` (60), ``route_timeout_s`` (600), ``release_timeout_s`` (300), ``watchdog_interval_s`` (2).
* ``step_target_estimate`` (optional): GENERATION requests' estimate before progress exists; default
  ``grpo.num_prompts_per_step`` (>= 1, debug #27).
* ``verify`` (optional, default true): checksum-verify every target after each weight sync.

The device lists are checked against the pool by the orchestrator on registration (clear errors there); the
topology against the rest of the config by :mod:`rlix_plugins.nemo_rl.topology`.
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from rlix_plugins.errors import RlixConfigError

if TYPE_CHECKING:
    from rlix_plugins.pipeline.config import RuntimeConfig

SECTION: Final = "rlix"
_TIMEOUTS: Final = {
    "request_timeout_s": 1800.0, "init_timeout_s": 900.0, "sync_timeout_s": 150.0, "drain_timeout_s": 60.0,
    "route_timeout_s": 600.0, "release_timeout_s": 300.0, "watchdog_interval_s": 2.0,
}
_KNOWN_KEYS: Final = frozenset(
    {"train_devices", "infer_devices", "infer_tp", "pipeline_id", "ray_address", "bucket_size_bytes",
     "sleep_level", "step_target_estimate", "verify", *_TIMEOUTS}
)
DEFAULT_BUCKET_SIZE_BYTES: Final = 256 << 20


@dataclass(frozen=True)
class RlixRunConfig:
    train_devices: tuple[int, ...]
    infer_devices: tuple[int, ...]
    infer_tp: int
    pipeline_id: str | None = None
    request_timeout_s: float = 1800.0
    ray_address: str | None = None
    bucket_size_bytes: int = DEFAULT_BUCKET_SIZE_BYTES
    sleep_level: int = 2
    init_timeout_s: float = 900.0
    sync_timeout_s: float = 150.0
    drain_timeout_s: float = 60.0
    route_timeout_s: float = 600.0
    release_timeout_s: float = 300.0
    watchdog_interval_s: float = 2.0
    step_target_estimate: int = 1
    verify: bool = True

    def runtime_config(self) -> RuntimeConfig:
        """The shared pipeline runtime's knobs (validated again there)."""
        from rlix_plugins.pipeline.config import RuntimeConfig  # lazy: the package __init__ imports Ray

        return RuntimeConfig(
            sleep_level=self.sleep_level, request_timeout_s=self.request_timeout_s,
            init_timeout_s=self.init_timeout_s, sync_timeout_s=self.sync_timeout_s,
            drain_timeout_s=self.drain_timeout_s, route_timeout_s=self.route_timeout_s,
            release_timeout_s=self.release_timeout_s, watchdog_interval_s=self.watchdog_interval_s,
            step_target_estimate=self.step_target_estimate, verify=self.verify,
        )


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


def remember_pipeline_id(master_config: Any, pipeline_id: str) -> None:
    """Write ``rlix.pipeline_id`` into NeMo RL's config (a mapping, or an object such as a pydantic model)."""
    raw = cfg_get(master_config, SECTION)
    if raw is None:
        raise RlixConfigError(f"the config has no '{SECTION}' section to record pipeline id {pipeline_id!r} in")
    if isinstance(raw, MutableMapping):
        raw["pipeline_id"] = pipeline_id
    else:
        raw.pipeline_id = pipeline_id


def scope_data_plane(master_config: Any, pipeline_id: str) -> str | None:
    """With ``data_plane.enabled``: write ``data_plane.rlix_namespace`` (the Ray namespace of this pipeline's
    TransferQueue controller and storage actors, patch 0007; every NeMo RL process gets it with the data-plane
    config) and return it; else None."""
    section = cfg_get(master_config, "data_plane")
    if section is None or not cfg_get(section, "enabled"):
        return None
    namespace = f"rlix_tq_{pipeline_id}"
    if isinstance(section, MutableMapping):
        section["rlix_namespace"] = namespace
    else:
        section.rlix_namespace = namespace
    return namespace


def _devices(section: Mapping[str, Any], key: str) -> tuple[int, ...]:
    raw = section.get(key)
    if raw is None:
        raise RlixConfigError(
            f"{SECTION}.{key} is missing; RLIX_CONTROL_PLANE=rlix needs it, e.g. ++{SECTION}.{key}=[0,1] "
            "(GPU ids of the shared pool)"
        )
    try:
        values = tuple(raw)
    except TypeError:
        raise RlixConfigError(f"{SECTION}.{key}={raw!r} must be a list of GPU ids, e.g. [0,1]") from None
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise RlixConfigError(f"{SECTION}.{key}={list(values)!r} must be a non-empty list of GPU ids >= 0")
    if len(set(values)) != len(values):
        raise RlixConfigError(f"{SECTION}.{key}={list(values)!r} lists a GPU twice")
    return values


def _positive_int(section: Mapping[str, Any], key: str, default: int) -> int:
    value = section.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise RlixConfigError(f"{SECTION}.{key}={value!r} must be a positive int")
    return value


def _seconds(section: Mapping[str, Any], key: str, default: float) -> float:
    value = section.get(key, default)
    if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
        raise RlixConfigError(f"{SECTION}.{key}={value!r} must be a positive number of seconds")
    return float(value)


def load_run_config(master_config: Any) -> RlixRunConfig:
    """Reads and validates the ``rlix`` section of NeMo RL's master config (not the topology: see topology.py)."""
    raw = cfg_get(master_config, SECTION)
    if raw is None:
        raise RlixConfigError(
            f"RLIX_CONTROL_PLANE=rlix but the config has no '{SECTION}' section; add e.g. "
            f"++{SECTION}.train_devices=[0] ++{SECTION}.infer_devices=[0,1] (or unset RLIX_CONTROL_PLANE)"
        )
    section = dict(raw) if isinstance(raw, Mapping) else dict(vars(raw))
    unknown = sorted(set(section) - _KNOWN_KEYS)
    if unknown:
        raise RlixConfigError(f"unknown {SECTION} keys {unknown}; valid: {sorted(_KNOWN_KEYS)}")
    tp = section.get("infer_tp")
    if tp is None:
        tp = cfg_path(master_config, "policy.generation.vllm_cfg.tensor_parallel_size") or 1
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise RlixConfigError(f"{SECTION}.infer_tp={tp!r} must be a positive int (GPUs per vLLM DP rank)")
    level = section.get("sleep_level", 2)
    if level not in (1, 2) or isinstance(level, bool):
        raise RlixConfigError(f"{SECTION}.sleep_level={level!r} must be 1 or 2 (2 frees weights and KV cache)")
    estimate = section.get("step_target_estimate")
    if estimate is None:
        estimate = cfg_path(master_config, "grpo.num_prompts_per_step") or 1
    verify = section.get("verify", True)
    if not isinstance(verify, bool):
        raise RlixConfigError(f"{SECTION}.verify={verify!r} must be true or false")
    pid = section.get("pipeline_id")
    address = section.get("ray_address")
    return RlixRunConfig(
        train_devices=_devices(section, "train_devices"),
        infer_devices=_devices(section, "infer_devices"),
        infer_tp=tp,
        pipeline_id=str(pid) if pid is not None else None,
        ray_address=str(address) if address is not None else None,
        bucket_size_bytes=_positive_int(section, "bucket_size_bytes", DEFAULT_BUCKET_SIZE_BYTES),
        sleep_level=int(level),
        step_target_estimate=_positive_int({"step_target_estimate": estimate}, "step_target_estimate", 1),
        verify=verify,
        **{k: _seconds(section, k, d) for k, d in _TIMEOUTS.items()},
    )
