"""Registration-time validation of cluster specs (pure). Called by the orchestrator before a pipeline exists.

``validate_cluster_specs(specs, gpus, gpus_per_node)`` validates built specs of one or more pipelines (the raw
argument checks and canonical sorting live in ``registration.build_cluster_specs``); ``validate_spec`` checks one
spec on its own. Specs are frozen: they are validated once, here, and never again per scheduling cycle.

Both raise ``RlixConfigError`` whose message names the offending cluster, the value, and how to fix it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from rlix_plugins.control.types import (
    CLUSTER_NAMES,
    GENERATION_CLUSTER,
    TRAIN_CLUSTER,
    ClusterSpec,
    cluster_id,
)
from rlix_plugins.errors import RlixConfigError


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
