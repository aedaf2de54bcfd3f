"""Pipeline registration: raw orchestrator input → canonical :class:`ClusterSpec` records, and the placement rules.

Pure Python, no Ray. Two layers, each raising :class:`RlixConfigError` with the offending cluster, the value and
the fix:

* :func:`build_cluster_specs` checks the *shape* of the caller's arguments (dicts with the same known cluster
  names, ints, lists of ints, ``actor_infer`` present, a valid pipeline id) and sorts the mappings;
* :func:`validate_cluster_specs` (built specs of one or more pipelines) and :func:`validate_spec` (one spec) hold
  every placement rule (duplicates, pool bounds, ``len % tp``, TP groups contiguous/on one node/aligned,
  ``actor_train`` ⊆ ``actor_infer``) in one place; the scheduler applies them when a pipeline registers. Specs
  are frozen: they are validated once and never again per scheduling cycle.
"""

from __future__ import annotations

import math
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any, Final

from rlix_plugins.control.types import (
    CLUSTER_NAMES,
    GENERATION_CLUSTER,
    TRAIN_CLUSTER,
    ClusterMemory,
    ClusterSpec,
    cluster_id,
)
from rlix_plugins.errors import RlixConfigError

_PIPELINE_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,99}$")


def pipeline_registration(
    train_devices: Iterable[int],
    infer_devices: Iterable[int],
    *,
    infer_tp: int = 1,
    pipeline_id: str | None = None,
    coordinator_config: Any = None,
    cluster_memory: Mapping[str, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """The keyword arguments of ``ControlPlane.register_pipeline`` for an rlix pipeline: its training cluster (TP 1)
    on ``train_devices`` and its generation cluster (TP ``infer_tp``) on ``infer_devices``. Every host builds its
    registration here (the demo's ``PipelineRuntime.register``, NeMo RL's ``RlixRunConfig.registration``)."""
    return {
        "cluster_tp_configs": {TRAIN_CLUSTER: 1, GENERATION_CLUSTER: infer_tp},
        "cluster_device_mappings": {TRAIN_CLUSTER: list(train_devices), GENERATION_CLUSTER: list(infer_devices)},
        "pipeline_id": pipeline_id,
        "coordinator_config": coordinator_config,
        "cluster_memory": None if cluster_memory is None else {k: dict(v) for k, v in cluster_memory.items()},
    }


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
    cluster_memory: Mapping[str, Any] | None = None,
) -> dict[str, ClusterSpec]:
    """Validate one registration and return its clusters by name (mappings sorted, canonical).

    ``cluster_memory``: optional memory figures by cluster name (``{"gpu_gib", "awake_gib", "asleep_gib"}``, GiB per
    GPU of its mapping; ``types.ClusterMemory``); a cluster without them never shares a GPU (co-residence)."""
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
            memory=_cluster_memory(pipeline_id, name, (cluster_memory or {}).get(name)),
        )

    extra = sorted(set(cluster_memory or {}) - tp_keys)
    if extra:
        raise RlixConfigError(f"pipeline {pipeline_id}: memory figures for clusters {extra} it does not register; "
                              f"give them for {sorted(tp_keys)} only")
    validate_cluster_specs(specs.values(), range(num_gpus), gpus_per_node)
    return specs


def _cluster_memory(pipeline_id: str, name: str, raw: Any) -> ClusterMemory | None:
    if raw is None:
        return None
    try:
        return parse_cluster_memory(name, raw)
    except RlixConfigError as exc:
        raise RlixConfigError(f"pipeline {pipeline_id}: {exc}") from None


def parse_cluster_memory(name: str, raw: Any) -> ClusterMemory:
    """The memory figures of cluster ``name`` from ``{"gpu_gib", "awake_gib", "asleep_gib"}`` (GiB per GPU)."""
    keys = ("gpu_gib", "awake_gib", "asleep_gib")
    if not isinstance(raw, Mapping) or set(raw) != set(keys):
        raise RlixConfigError(f"memory figures of {name!r} must be a dict with exactly {list(keys)} (GiB per GPU), "
                              f"got {raw!r}")
    try:
        gpu, awake, asleep = (float(raw[k]) for k in keys)
    except (TypeError, ValueError):
        raise RlixConfigError(f"memory figures of {name!r} must be numbers, got {raw!r}") from None
    if not (0 <= asleep <= awake <= gpu) or not math.isfinite(gpu):
        raise RlixConfigError(f"memory figures of {name!r} need 0 <= asleep_gib <= awake_gib <= gpu_gib (finite), "
                              f"got {dict(raw)}")
    return ClusterMemory(gpu, awake, asleep)


def pipeline_clusters(
    pipeline_id: str, train: Iterable[int] | None, infer: Iterable[int], tp: int = 1
) -> dict[str, ClusterSpec]:
    """The clusters of a pipeline that trains on ``train`` (None: rollout only) and rolls out on ``infer`` in
    bundles of ``tp`` GPUs, by cluster id in registration order (mappings sorted). Unchecked, for the simulator,
    benchmarks and tests: their placements may break registration rules on purpose (the simulator's baselines
    train on GPUs their rollout does not use); check with :func:`validate_spec` where the rules must hold."""
    infer_spec = ClusterSpec(cluster_id(pipeline_id, GENERATION_CLUSTER), pipeline_id, GENERATION_CLUSTER,
                             tuple(sorted(infer)), tp)
    out = {infer_spec.cluster_id: infer_spec}
    if train is not None:
        train_spec = ClusterSpec(cluster_id(pipeline_id, TRAIN_CLUSTER), pipeline_id, TRAIN_CLUSTER,
                                 tuple(sorted(train)), 1)
        out[train_spec.cluster_id] = train_spec
    return out


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


def bundle_problem(spec: ClusterSpec, gpus_per_node: int) -> str | None:
    """Why the TP bundles of ``spec`` are invalid (not contiguous, crossing a node, misaligned), or None."""
    tp = spec.tp_size
    if tp <= 1:
        return None
    for r in range(spec.num_dp_ranks):
        b = spec.bundle(r)
        if any(b[i + 1] != b[i] + 1 for i in range(len(b) - 1)):
            return (
                f"TP group {list(b)} (DP rank {r}) is not contiguous; a vLLM TP group must be tp_size={tp} "
                f"consecutive GPU ids, e.g. [{b[0]}..{b[0] + tp - 1}]"
            )
        if b[0] // gpus_per_node != b[-1] // gpus_per_node:
            return (
                f"TP group {list(b)} (DP rank {r}) crosses a node boundary (gpus_per_node={gpus_per_node}); "
                f"start each group of {tp} GPUs inside one node"
            )
        if gpus_per_node % tp == 0 and (b[0] % gpus_per_node) % tp != 0:
            return (
                f"TP group {list(b)} (DP rank {r}) is not aligned to tp_size={tp}: it would partially overlap "
                f"the TP groups of other pipelines; start every group at a multiple of {tp} within its node"
            )
    return None


def _spec_problem(spec: ClusterSpec, pool: frozenset[int], gpus_per_node: int) -> str | None:
    if spec.name not in CLUSTER_NAMES:
        return f"unknown cluster name {spec.name!r}; valid names: {sorted(CLUSTER_NAMES)}"
    if not spec.pipeline_id or ":" in spec.pipeline_id:
        return f"pipeline id {spec.pipeline_id!r} must be non-empty and must not contain ':'"
    if spec.cluster_id != cluster_id(spec.pipeline_id, spec.name):
        return f"cluster id must be {cluster_id(spec.pipeline_id, spec.name)!r}"
    if not isinstance(spec.tp_size, int) or isinstance(spec.tp_size, bool) or spec.tp_size < 1:
        return f"tp_size must be a positive integer, got {spec.tp_size!r}"
    if not spec.is_generation and spec.tp_size != 1:
        return f"tp_size must be 1 for the non-generation cluster {spec.name!r} (one GPU per worker), got {spec.tp_size}"
    m = spec.device_mapping
    if not m:
        return "device mapping is empty; list the GPU ids this cluster may use"
    if any(not isinstance(g, int) or isinstance(g, bool) for g in m):
        return f"device mapping must contain integer GPU ids, got {list(m)}"
    if len(set(m)) != len(m):
        dups = sorted({g for g in m if m.count(g) > 1})
        return f"device mapping {list(m)} lists GPU(s) {dups} more than once; list each GPU once"
    if list(m) != sorted(m):
        return f"device mapping {list(m)} is not sorted; build specs with build_cluster_specs (it sorts)"
    if len(m) % spec.tp_size:
        return (
            f"device mapping has {len(m)} GPUs, not a multiple of tp_size={spec.tp_size}; "
            f"use {len(m) - len(m) % spec.tp_size} or {len(m) + spec.tp_size - len(m) % spec.tp_size} GPUs"
        )
    outside = sorted(set(m) - pool)
    if outside:
        return f"GPU(s) {outside} are not in the pool {_fmt_pool(pool)}; use GPUs the Ray cluster has"
    return bundle_problem(spec, gpus_per_node)


def _fmt_pool(pool: frozenset[int]) -> str:
    if not pool:
        return "(empty)"
    lo, hi = min(pool), max(pool)
    return f"[{lo}..{hi}]" if len(pool) == hi - lo + 1 else str(sorted(pool))


def validate_spec(spec: ClusterSpec, gpus: Collection[int], gpus_per_node: int) -> None:
    """Validate ONE spec on its own (name, id, tp, mapping, pool, TP bundles), without the per-pipeline rules of
    :func:`validate_cluster_specs` (the simulator's baseline placements train on GPUs their rollout does not use)."""
    if gpus_per_node < 1:
        raise RlixConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    problem = _spec_problem(spec, frozenset(gpus), gpus_per_node)
    if problem:
        raise RlixConfigError(f"cluster {spec.cluster_id!r}: {problem}")


def validate_cluster_specs(specs: Iterable[ClusterSpec], gpus: Collection[int], gpus_per_node: int) -> None:
    """Validate registration specs of one or more pipelines against a pool of ``gpus``.

    Checks: known cluster names and ids, positive tp (1 for training clusters), non-empty sorted mappings without
    duplicates, ``len % tp == 0``, GPUs in the pool, TP groups contiguous / inside one node / aligned to tp (so
    they never partially overlap other pipelines' groups), one ``actor_infer`` per pipeline, and
    ``actor_train ⊆ actor_infer`` (partial overlap). Raises ``RlixConfigError`` naming the fix.
    """
    if gpus_per_node < 1:
        raise RlixConfigError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    pool = frozenset(gpus)
    by_pipeline: dict[str, dict[str, ClusterSpec]] = {}
    seen: set[str] = set()
    for spec in specs:
        problem = _spec_problem(spec, pool, gpus_per_node)
        if problem:
            raise RlixConfigError(f"cluster {spec.cluster_id!r}: {problem}")
        if spec.cluster_id in seen:
            raise RlixConfigError(f"cluster {spec.cluster_id!r} is registered twice; register each cluster once")
        seen.add(spec.cluster_id)
        by_pipeline.setdefault(spec.pipeline_id, {})[spec.name] = spec
    for pid, named in by_pipeline.items():
        infer = named.get(GENERATION_CLUSTER)
        if infer is None:
            raise RlixConfigError(
                f"pipeline {pid!r} has no {GENERATION_CLUSTER!r} cluster; register the vLLM cluster's mapping and tp"
            )
        train = named.get(TRAIN_CLUSTER)
        if train is not None:
            extra = sorted(set(train.device_mapping) - set(infer.device_mapping))
            if extra:
                raise RlixConfigError(
                    f"pipeline {pid!r}: {TRAIN_CLUSTER} GPUs {extra} are not in the {GENERATION_CLUSTER} mapping "
                    f"{list(infer.device_mapping)}; partial overlap needs train GPUs ⊆ infer GPUs (add them to "
                    f"the inference mapping or remove them from the training mapping)"
                )
