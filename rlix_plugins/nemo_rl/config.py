"""The ``rlix:`` section of a NeMo RL config (``++rlix.train_devices=[0] ++rlix.infer_devices=[0,1]``).

Keys (all under ``rlix``):

* ``train_devices`` (required): GPU ids of the pool the training workers use (one GPU per worker).
* ``infer_devices`` (required): GPU ids of the vLLM ranks; a superset of ``train_devices`` (partial overlap).
* ``infer_tp`` (optional): GPUs per vLLM DP rank; default ``policy.generation.vllm_cfg.tensor_parallel_size``.
* ``pipeline_id`` (optional): a fixed id; default: the orchestrator allocates ``ft_<12 hex>``.
* ``request_timeout_s`` (optional, default 1800): bound of every blocking GPU request.
* ``ray_address`` (optional): Ray cluster of the control plane; default: the cluster this driver runs on.

The device lists are checked against the pool by the orchestrator on registration (clear errors there).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from rlix_plugins.errors import RlixConfigError

SECTION: Final = "rlix"
_KNOWN_KEYS: Final = frozenset(
    {"train_devices", "infer_devices", "infer_tp", "pipeline_id", "request_timeout_s", "ray_address"}
)


@dataclass(frozen=True)
class RlixRunConfig:
    train_devices: tuple[int, ...]
    infer_devices: tuple[int, ...]
    infer_tp: int
    pipeline_id: str | None = None
    request_timeout_s: float = 1800.0
    ray_address: str | None = None


def _get(obj: Any, key: str) -> Any:
    """``obj[key]`` for mappings, ``obj.key`` for NeMo RL's pydantic configs (``extra="allow"``); else None."""
    if isinstance(obj, Mapping):
        return obj.get(key)
    value = getattr(obj, key, None)
    if value is None:
        extra = getattr(obj, "model_extra", None) or {}
        value = extra.get(key)
    return value


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
    return values


def load_run_config(master_config: Any) -> RlixRunConfig:
    """Reads and validates the ``rlix`` section of NeMo RL's master config."""
    raw = _get(master_config, SECTION)
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
        vllm_cfg = (_get(_get(_get(master_config, "policy"), "generation") or {}, "vllm_cfg")) or {}
        tp = _get(vllm_cfg, "tensor_parallel_size") or 1
    if not isinstance(tp, int) or isinstance(tp, bool) or tp <= 0:
        raise RlixConfigError(f"{SECTION}.infer_tp={tp!r} must be a positive int (GPUs per vLLM DP rank)")
    timeout = section.get("request_timeout_s", 1800.0)
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout <= 0:
        raise RlixConfigError(f"{SECTION}.request_timeout_s={timeout!r} must be a positive number of seconds")
    pid = section.get("pipeline_id")
    address = section.get("ray_address")
    return RlixRunConfig(
        train_devices=_devices(section, "train_devices"),
        infer_devices=_devices(section, "infer_devices"),
        infer_tp=tp,
        pipeline_id=str(pid) if pid is not None else None,
        request_timeout_s=float(timeout),
        ray_address=str(address) if address is not None else None,
    )
