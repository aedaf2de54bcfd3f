"""Validation of a pipeline registration (orchestrator input) into canonical :class:`ClusterSpec` records.

Pure Python, no Ray. Every rule raises :class:`RlixConfigError` with the offending value and the fix. Rules:

* ``pipeline_id`` is a non-empty token without ``:`` or whitespace (``ft_<12 hex>`` from ``allocate_pipeline_id``);
* ``cluster_tp_configs`` and ``cluster_device_mappings`` have the same keys, all in ``CLUSTER_NAMES``,
  and include ``actor_infer`` (the generation cluster every rlix pipeline time-shares);
* TP sizes are positive ints; non-generation clusters use ``tp_size=1`` (one GPU per training worker);
* mappings are non-empty lists of ints, without duplicates (duplicates = overlapping TP groups), inside the
  pool ``0..G-1``, with ``len % tp == 0``;
* generation TP groups (consecutive bundles of the sorted mapping) are contiguous GPU ids on one node;
* ``actor_train`` is a subset of ``actor_infer`` (partial overlap: training GPUs are lent by rollout ranks).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Mapping
from typing import Any, Final

from rlix_plugins.control.types import (
    CLUSTER_NAMES,
    GENERATION_CLUSTER,
    TRAIN_CLUSTER,
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
        mapping = _check_mapping(pipeline_id, name, cluster_device_mappings[name], tp, num_gpus)
        if CLUSTER_NAMES[name]:
            _check_tp_groups(pipeline_id, name, mapping, tp, gpus_per_node)
        specs[name] = ClusterSpec(
            cluster_id=cluster_id(pipeline_id, name),
            pipeline_id=pipeline_id,
            name=name,
            device_mapping=mapping,
            tp_size=tp,
        )

    if TRAIN_CLUSTER in specs:
        extra = sorted(set(specs[TRAIN_CLUSTER].device_mapping) - set(specs[GENERATION_CLUSTER].device_mapping))
        if extra:
            raise RlixConfigError(
                f"pipeline {pipeline_id}: {TRAIN_CLUSTER} GPUs {extra} are not in {GENERATION_CLUSTER} "
                f"{list(specs[GENERATION_CLUSTER].device_mapping)}; training GPUs must be a subset of the "
                f"inference GPUs (partial overlap): add them to the inference mapping or train on inference GPUs"
            )
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


def _check_mapping(pipeline_id: str, name: str, raw: Any, tp: int, num_gpus: int) -> tuple[int, ...]:
    where = f"pipeline {pipeline_id}: cluster_device_mappings[{name!r}]"
    if isinstance(raw, (str, bytes)) or not hasattr(raw, "__iter__"):
        raise RlixConfigError(f"{where}={raw!r} must be a list of GPU ids, e.g. [0, 1]")
    values = list(raw)
    if not values:
        raise RlixConfigError(f"{where} is empty; list the GPU ids this cluster runs on, e.g. [0, 1]")
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, int)]
    if bad:
        raise RlixConfigError(f"{where} has non-integer entries {bad!r}; use GPU ids (ints)")
    dups = sorted({v for v in values if values.count(v) > 1})
    if dups:
        raise RlixConfigError(
            f"{where}={values} lists GPU(s) {dups} more than once, so TP groups/workers would overlap; "
            "list every GPU once"
        )
    outside = sorted(v for v in values if v < 0 or v >= num_gpus)
    if outside:
        raise RlixConfigError(
            f"{where} has GPU(s) {outside} outside the pool 0..{num_gpus - 1} ({num_gpus} GPUs in the Ray "
            "cluster); use ids in that range or start Ray with more GPUs"
        )
    if len(values) % tp:
        raise RlixConfigError(
            f"{where} has {len(values)} GPUs, not a multiple of tp_size={tp}; give a multiple of {tp} GPUs "
            f"or change cluster_tp_configs[{name!r}]"
        )
    return tuple(sorted(values))


def _check_tp_groups(pipeline_id: str, name: str, mapping: tuple[int, ...], tp: int, gpus_per_node: int) -> None:
    for rank in range(len(mapping) // tp):
        group = mapping[rank * tp : (rank + 1) * tp]
        contiguous = all(b - a == 1 for a, b in itertools.pairwise(group))
        one_node = len({g // gpus_per_node for g in group}) == 1
        if not (contiguous and one_node):
            raise RlixConfigError(
                f"pipeline {pipeline_id}: {name} TP group of DP rank {rank} is GPUs {list(group)}; each group "
                f"of tp_size={tp} consecutive GPUs (of the sorted mapping) must be contiguous ids on one node "
                f"({gpus_per_node} GPUs per node); e.g. [0, 1, 2, 3] with tp_size=2"
            )
