"""Parse a raw pipeline registration (orchestrator input) into canonical :class:`ClusterSpec` records.

Pure Python, no Ray. This module checks the *shape* of the caller's arguments (dicts with the same known
cluster names, ints, lists of ints, ``actor_infer`` present, a valid pipeline id) and sorts the mappings;
every placement rule (duplicates, pool bounds, ``len % tp``, TP groups contiguous/on one node/aligned,
``actor_train`` ⊆ ``actor_infer``) lives in one place, :func:`rlix_plugins.control.scheduling.planner.validate_cluster_specs`,
which the scheduler also applies. Every problem raises :class:`RlixConfigError` with the value and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from rlix_plugins.control._registration import validate_cluster_specs
from rlix_plugins.control.types import (
    CLUSTER_NAMES,
    GENERATION_CLUSTER,
    ClusterSpec,
    cluster_id,
)
from rlix_plugins.errors import RlixConfigError

_PIPELINE_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


def validate_pipeline_id(pipeline_id: Any) -> str:
    if not isinstance(pipeline_id, str) or not _PIPELINE_ID_RE.match(pipeline_id):
        raise RlixConfigError(
            f"invalid pipeline_id {pipeline_id!r}: use letters, digits, '_', '-', '.' only (no ':' or spaces), "
            "at most 100 characters; get one from Orchestrator.allocate_pipeline_id()"
        )
    return pipeline_id


def build_cluster_specs(
    pipeline_id: str,
    cluster_tp_configs: Mapping[str, Any],
    cluster_device_mappings: Mapping[str, Any],
    *,
    num_gpus: int,
    gpus_per_node: int,
) -> dict[str, ClusterSpec]:
    """Validate one registration and return its clusters by name (mappings sorted, canonical)."""
    validate_pipeline_id(pipeline_id)
    if not isinstance(cluster_tp_configs, Mapping) or not isinstance(cluster_device_mappings, Mapping):
        raise RlixConfigError(
            "cluster_tp_configs and cluster_device_mappings must be dicts keyed by cluster name, e.g. "
            "{'actor_train': 1, 'actor_infer': 2} and {'actor_train': [0], 'actor_infer': [0, 1, 2, 3]}"
        )
    tp_keys, map_keys = set(cluster_tp_configs), set(cluster_device_mappings)
    if tp_keys != map_keys:
        raise RlixConfigError(
            f"pipeline {pipeline_id}: cluster_tp_configs has clusters {sorted(tp_keys)} but "
            f"cluster_device_mappings has {sorted(map_keys)}; give both dicts the same cluster names"
        )
    unknown = sorted(k for k in tp_keys if k not in CLUSTER_NAMES)
    if unknown:
        raise RlixConfigError(
            f"pipeline {pipeline_id}: unknown cluster name(s) {unknown}; valid names are {sorted(CLUSTER_NAMES)}"
        )
    if GENERATION_CLUSTER not in tp_keys:
        raise RlixConfigError(
            f"pipeline {pipeline_id}: no {GENERATION_CLUSTER!r} cluster; every rlix pipeline registers its vLLM "
            f"GPUs as {GENERATION_CLUSTER!r} (e.g. rlix.infer_devices=[0,1])"
        )
    if gpus_per_node <= 0 or num_gpus <= 0:
        raise RlixConfigError(f"the GPU pool is empty (num_gpus={num_gpus}, gpus_per_node={gpus_per_node})")

    specs: dict[str, ClusterSpec] = {}
    for name in sorted(tp_keys):
        tp = _check_tp(pipeline_id, name, cluster_tp_configs[name])
        mapping = _parse_mapping(pipeline_id, name, cluster_device_mappings[name])
        specs[name] = ClusterSpec(
            cluster_id=cluster_id(pipeline_id, name),
            pipeline_id=pipeline_id,
            name=name,
            device_mapping=mapping,
            tp_size=tp,
        )

    validate_cluster_specs(specs.values(), range(num_gpus), gpus_per_node)
    return specs


def _check_tp(pipeline_id: str, name: str, tp: Any) -> int:
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise RlixConfigError(
            f"pipeline {pipeline_id}: cluster_tp_configs[{name!r}]={tp!r} must be a positive int "
            "(vLLM tensor_parallel_size for actor_infer, 1 otherwise)"
        )
    if not CLUSTER_NAMES[name] and tp != 1:
        raise RlixConfigError(
            f"pipeline {pipeline_id}: cluster_tp_configs[{name!r}]={tp}; non-generation clusters register one GPU "
            f"per worker (tp_size=1) whatever their model parallelism; set cluster_tp_configs[{name!r}]=1"
        )
    return tp


def _parse_mapping(pipeline_id: str, name: str, raw: Any) -> tuple[int, ...]:
    where = f"pipeline {pipeline_id}: cluster_device_mappings[{name!r}]"
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
        raise RlixConfigError(f"{where}={raw!r} must be a list of GPU ids, e.g. [0, 1]")
    values = list(raw)
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise RlixConfigError(f"{where} has non-integer entries {bad!r}; use GPU ids (ints)")
    return tuple(sorted(values))
