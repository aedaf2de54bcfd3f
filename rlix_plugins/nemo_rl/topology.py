"""Start-up validation of a time-shared NeMo RL run (GPU topology, plus the switches async GRPO needs).

Called by ``NemoRLHooks.rlix_pipeline_start`` before anything is registered (the reference defined these checks
but never called them). Every violation is collected and reported in ONE :class:`RlixConfigError` whose lines
each say what to change (a Hydra override where one fixes it).

Two topologies are accepted:

* **partial overlap** (the general case): ``train ⊂ infer``, at least 2 inference DP ranks
  (``len(infer) / vllm_tp``) and at least one FULL DP rank outside the training GPUs
  (``len(infer - train) >= vllm_tp``), so one rank keeps generating while the pipeline trains;
* **one rank** (:func:`is_one_rank_topology`): ``train == infer`` = the GPUs of ONE vLLM DP rank: one GPU
  (:func:`is_one_gpu_topology`, TP 1) or one tensor-parallel rank of TP GPUs; its docstring says why it is safe and
  what it costs.

Checks common to both:

* ``len(infer) % vllm_tp == 0`` and ``len(train) % (TP·PP·CP·EP) == 0`` (Megatron; DTensor: TP·CP);
* with vLLM TP > 1, ``train`` lists whole rollout ranks of ``infer`` (each rank's GPUs together, in their order):
  a rank's GPUs are one placement group, and NeMo RL puts a training worker on every bundle of a group it is given
  (:func:`.placement.cover`);
* not both ``policy.megatron_cfg.enabled`` and ``policy.dtensor_cfg.enabled`` (the weight cache is built in the
  workers of the one NeMo RL builds; neither set is left to NeMo RL's own error, and to its unit-test mocks);
* one of the GRPO loops the patch series drives (:func:`grpo_loop`): ``async_grpo_train``
  (``grpo.async_grpo.enabled``), the TransferQueue loop ``grpo_train_sync`` (``data_plane.enabled``) or the
  SingleController (an ``async_rl`` section with ``data_plane.enabled``);
* ``policy.generation.colocated.enabled == false`` (non-colocated vLLM), ``vllm_cfg.async_engine`` (per-request
  routing needs the async engine; the TransferQueue loop's rollout actor then generates per request too), vLLM
  backend; for async GRPO ``loss_fn.use_importance_sampling_correction`` (trajectories from older weights are
  corrected; the TransferQueue loop is on-policy, the SingleController validates its own staleness rules);
* the SingleController on one GPU: ``async_rl.min_groups_for_streaming_train == grpo.num_prompts_per_step`` (its
  training grant spans a step's chunks, and its only rollout rank sleeps meanwhile wherever it does not fit beside
  the step; one chunk per step);
* ``vllm_cfg.sleep_level`` (patch 0003), when set, equals ``rlix.sleep_level`` (scheduler shrinks pass
  ``rlix.sleep_level`` per call; two different configured levels would only confuse);
* ``vllm_cfg.tensor_parallel_size`` equals ``rlix.infer_tp``;
* vLLM ``pipeline_parallel_size`` 1 and ``expert_parallel_size`` at most the TP size (:func:`vllm_parallel_problems`:
  NeMo RL itself would only fail at engine start, or not at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import RlixRunConfig, cfg_path

__all__ = ["ASYNC_GRPO", "DATA_PLANE", "SINGLE_CONTROLLER", "grpo_loop", "is_one_gpu_topology", "is_one_rank_topology",
           "rank_slices", "topology_problems", "training_parallel_size", "validate_topology", "vllm_parallel_problems"]

#: The GRPO loops the patch series drives (:func:`grpo_loop`).
ASYNC_GRPO, DATA_PLANE, SINGLE_CONTROLLER = "async_grpo_train", "grpo_train_sync", "single_controller"


def grpo_loop(master_config: Any) -> str | None:
    """Which patched NeMo RL loop ``master_config`` drives, as NeMo RL's entry points choose it: the SingleController
    (``examples/run_grpo_single_controller.py``: its config has an ``async_rl`` section, and needs the data plane),
    ``async_grpo_train`` (``run_grpo.py`` with ``grpo.async_grpo.enabled``: checked first there), the TransferQueue
    loop ``grpo_train_sync`` (``run_grpo.py`` with ``data_plane.enabled``); None: the sync ``grpo_train``, which
    time-sharing does not drive."""
    data_plane = bool(cfg_path(master_config, "data_plane.enabled"))
    if cfg_path(master_config, "async_rl") is not None and data_plane:
        return SINGLE_CONTROLLER
    if cfg_path(master_config, "grpo.async_grpo.enabled"):
        return ASYNC_GRPO
    return DATA_PLANE if data_plane else None


def training_parallel_size(master_config: Any) -> tuple[int, str]:
    """GPUs one model replica of the trainer spans, and how that was computed (for messages)."""
    if cfg_path(master_config, "policy.megatron_cfg.enabled"):
        sizes = {k: int(cfg_path(master_config, f"policy.megatron_cfg.{k}") or 1) for k in (
            "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
            "expert_model_parallel_size")}
        prod = 1
        for v in sizes.values():
            prod *= v
        return prod, "Megatron TP·PP·CP·EP = " + "·".join(str(v) for v in sizes.values())
    tp = int(cfg_path(master_config, "policy.dtensor_cfg.tensor_parallel_size") or 1)
    cp = int(cfg_path(master_config, "policy.dtensor_cfg.context_parallel_size") or 1)
    return tp * cp, f"DTensor TP·CP = {tp}·{cp}"


def is_one_gpu_topology(run: RlixRunConfig) -> bool:
    """The one-rank topology on one GPU: ``rlix.train_devices == rlix.infer_devices == [g]`` (vLLM TP 1)."""
    return run.infer_tp == 1 and is_one_rank_topology(run)


def is_one_rank_topology(run: RlixRunConfig) -> bool:
    """The one-rank topology: ``rlix.train_devices == rlix.infer_devices``, the GPUs of one vLLM DP rank (one GPU
    with TP 1, or a tensor-parallel rank of TP GPUs).

    The pipeline trains and rolls out on the same GPUs. Where the memory figures (``rlix.memory``) show that its
    rollout fits beside its own training step, the rank keeps generating while it trains and the in-flight refresh
    after the step updates it (co-residence, DESIGN §4). Otherwise, and without figures, its only rollout rank is
    slept while it trains (the ACTOR_TRAINING grant preempts every GENERATION rank on its mapping that does not
    fit, its own included), and while a co-tenant's step it does not fit beside runs there. Why it cannot
    deadlock when the rank sleeps:

    * the training grant never waits for rollout: GENERATION is preemptable by every other priority, so
      ``before_training`` gets the GPU once the rank is aborted, drained and slept; the collector's requests
      meanwhile block in routing (bounded by ``rlix.route_timeout_s``) and are re-run once a rank is back;
    * the in-flight refresh after training has no active rank to update (it records an empty refresh); the
      published version is set on the resizer inside the resize lock, so the expand that wakes the rank after
      training syncs and publishes the new version, never the old one;
    * GENERATION demand outlives the grant: the scheduler keeps a standing GENERATION request for an open
      generation cluster without active ranks (and the runtime's watchdog re-asks), so the rank is granted back
      after training; among pipelines waiting for the same GPU the one that has waited longest is woken first,
      so co-tenants take turns instead of one starving until the other finishes.

    What sleeping costs: no overlap of generation and training for that pipeline (async GRPO still generates the
    next batch ahead, with weights one step old, whenever the GPU is its), and every step pays one sleep + wake +
    weight sync of the rank: one 1.5 B pipeline alone on an H200 made 30 steps/h that way, 53 with its rollout
    awake beside its step (DESIGN §9). On more GPUs prefer partial overlap (a rank outside the training GPUs).
    """
    return len(run.infer_devices) == run.infer_tp and tuple(run.train_devices) == tuple(run.infer_devices)


_ONE_GPU_HINT = ("; or train and roll out on the GPUs of one rank: rlix.train_devices = rlix.infer_devices = [g] with "
                 "vLLM TP 1 (or TP GPUs of one node with vLLM TP > 1)")


def rank_slices(gpus: Sequence[int], tp: int) -> list[tuple[int, ...]]:
    """The GPUs of each vLLM DP rank: ``tp`` consecutive entries of ``gpus`` each (NeMo RL's order of DP ranks)."""
    return [tuple(gpus[i:i + tp]) for i in range(0, len(gpus), tp)]


def _whole_rank_problems(run: RlixRunConfig) -> list[str]:
    """With vLLM TP > 1, the training GPUs must be whole rollout ranks (see the module docstring)."""
    tp, infer, train = run.infer_tp, list(run.infer_devices), list(run.train_devices)
    if tp == 1 or len(infer) % tp or not set(train) <= set(infer):
        return []  # nothing to split, or reported by another rule
    ranks = [list(r) for r in rank_slices(infer, tp)]
    i = 0
    while i < len(train):
        rank = next((r for r in ranks if train[i] in r), None)
        if rank is None or train[i:i + tp] != rank:
            return [f"rlix.train_devices {train} splits a vLLM tensor-parallel rank: with TP {tp} the ranks are "
                    f"{ranks}, each one placement group, and NeMo RL puts a training worker on every GPU of a group "
                    f"it is given; list whole ranks, each in that order (e.g. rlix.train_devices={ranks[0]})"]
        i += tp
    return []


def _partial_overlap_problems(run: RlixRunConfig) -> list[str]:
    """The rank rules of the general topology: one full DP rank must keep generating while the pipeline trains."""
    problems: list[str] = []
    train, infer, tp = set(run.train_devices), set(run.infer_devices), run.infer_tp
    if len(infer) % tp == 0 and len(infer) // tp < 2:
        problems.append(f"{len(infer) // tp} inference DP rank (infer devices {sorted(infer)} / vLLM TP {tp}); "
                        f"time-sharing needs >= 2: list at least {2 * tp} GPUs in rlix.infer_devices"
                        + _ONE_GPU_HINT)
    if len(infer - train) < tp:
        problems.append(f"only {len(infer - train)} inference GPU(s) outside the training GPUs; at least one full "
                        f"DP rank ({tp} GPU(s)) must keep generating while the pipeline trains: add GPUs to "
                        "rlix.infer_devices that are not in rlix.train_devices" + _ONE_GPU_HINT)
    return problems


def _streaming_on_one_rank(master_config: Any) -> list[str]:
    """The SingleController holds the training grant from a step's first chunk to its publish; on one rank's GPUs its
    only rollout rank sleeps meanwhile wherever it does not fit beside the step (without memory figures, or a
    co-tenant's step takes its room), so a step must be one chunk (an unresolved interpolation is not judged)."""
    groups = cfg_path(master_config, "async_rl.min_groups_for_streaming_train")
    per_step = cfg_path(master_config, "grpo.num_prompts_per_step")
    if isinstance(groups, int) and isinstance(per_step, int) and groups < per_step:
        return [f"async_rl.min_groups_for_streaming_train={groups} < grpo.num_prompts_per_step={per_step}: with one "
                "rollout rank on the training GPUs the SingleController's rollout may sleep while it trains, so a streamed step never gets its later "
                "chunks; set async_rl.min_groups_for_streaming_train=${grpo.num_prompts_per_step} (one chunk per step), "
                "or give the pipeline an inference GPU outside rlix.train_devices"]
    return []


def vllm_parallel_problems(pp: Any, ep: Any, tp: Any) -> list[str]:
    """vLLM parallel sizes time-sharing cannot run (None: unset, i.e. 1), each with its fix.

    * PP > 1: the scheduler grants, sleeps and wakes a vLLM DP rank as one bundle of TP GPUs, and NeMo RL counts
      DP ranks as GPUs / (TP·PP); a rank of TP·PP GPUs would be split by the grants (and NeMo RL builds a PP engine
      only in a unified cross-node placement group, which the shared per-GPU groups do not provide).
    * EP > TP: vLLM's EP is its internal DP x TP, so NeMo RL runs several DP ranks inside one engine, which it allows
      only without the async engine; rlix routes requests per engine over the async engine (and 1 < EP < TP, not a
      multiple of TP, is refused by NeMo RL only when the engine starts).
    """
    problems: list[str] = []
    tp_i = int(tp or 1)
    if pp is not None and int(pp) > 1:
        problems.append(f"policy.generation.vllm_cfg.pipeline_parallel_size={pp}: time-sharing grants vLLM GPUs per DP "
                        "rank of tensor_parallel_size GPUs and cannot hold a pipeline-parallel engine; set "
                        "policy.generation.vllm_cfg.pipeline_parallel_size=1 (fit the model with tensor parallelism, "
                        "or more data-parallel ranks)")
    if ep is not None and int(ep) > tp_i:
        problems.append(f"policy.generation.vllm_cfg.expert_parallel_size={ep} > tensor_parallel_size={tp_i}: vLLM "
                        "would run data-parallel ranks inside one engine, which needs NeMo RL's non-async engine; "
                        f"time-sharing routes per engine with the async engine: set expert_parallel_size={tp_i} (or 1) "
                        "and scale out with more rlix.infer_devices (DP ranks) instead")
    elif ep is not None and 1 < int(ep) < tp_i:
        problems.append(f"policy.generation.vllm_cfg.expert_parallel_size={ep} < tensor_parallel_size={tp_i}: NeMo RL "
                        f"needs EP to be a multiple of TP when EP > 1; set expert_parallel_size={tp_i} (or 1)")
    return problems


def topology_problems(master_config: Any, run: RlixRunConfig) -> list[str]:
    """Every violated rule, each with its fix (empty list: the run may start)."""
    problems: list[str] = []
    train, infer, tp = set(run.train_devices), set(run.infer_devices), run.infer_tp
    if not train <= infer:
        problems.append(
            f"rlix.train_devices {sorted(train)} must be a subset of rlix.infer_devices {sorted(infer)} "
            f"(GPUs {sorted(train - infer)} are not inference GPUs): add them to rlix.infer_devices"
        )
    if len(infer) % tp:
        problems.append(f"rlix.infer_devices has {len(infer)} GPUs, not a multiple of the vLLM tensor parallel size "
                        f"{tp}: use a multiple of {tp} GPUs")
    if not is_one_rank_topology(run):
        problems += _partial_overlap_problems(run)
    problems += _whole_rank_problems(run)
    if cfg_path(master_config, "policy.megatron_cfg.enabled") and cfg_path(master_config, "policy.dtensor_cfg.enabled"):
        problems.append("policy.megatron_cfg.enabled and policy.dtensor_cfg.enabled are both true: enable one training "
                        "backend (e.g. policy.megatron_cfg.enabled=false for the DTensor policy)")
    size, how = training_parallel_size(master_config)
    if len(train) % size:
        problems.append(f"rlix.train_devices has {len(train)} GPUs, not a multiple of {how}: use a multiple of "
                        f"{size} GPUs or change the parallel sizes")
    vllm_tp = cfg_path(master_config, "policy.generation.vllm_cfg.tensor_parallel_size")
    if vllm_tp is not None and int(vllm_tp) != tp:
        problems.append(f"rlix.infer_tp={tp} differs from policy.generation.vllm_cfg.tensor_parallel_size="
                        f"{vllm_tp}: drop rlix.infer_tp or make them equal")
    problems += vllm_parallel_problems(cfg_path(master_config, "policy.generation.vllm_cfg.pipeline_parallel_size"),
                                       cfg_path(master_config, "policy.generation.vllm_cfg.expert_parallel_size"),
                                       vllm_tp if vllm_tp is not None else tp)
    loop = grpo_loop(master_config)
    if loop is None:
        problems.append("no time-shared GRPO loop selected: set grpo.async_grpo.enabled=true (async_grpo_train) or "
                        "data_plane.enabled=true (the TransferQueue loop, or the SingleController's entry point)")
    backend = cfg_path(master_config, "policy.generation.backend")
    if backend is not None and backend != "vllm":
        problems.append(f"policy.generation.backend={backend!r}: time-sharing supports vLLM only "
                        "(policy.generation.backend=vllm)")
    if cfg_path(master_config, "policy.generation.colocated.enabled") is not False:
        problems.append("vLLM must not be colocated: set policy.generation.colocated.enabled=false (the scheduler "
                        "shares GPUs across pipelines instead)")
    if not cfg_path(master_config, "policy.generation.vllm_cfg.async_engine"):
        problems.append("set policy.generation.vllm_cfg.async_engine=true (per-request routing over active DP ranks "
                        "needs the async engine)")
    if loop == ASYNC_GRPO and not cfg_path(master_config, "loss_fn.use_importance_sampling_correction"):
        problems.append("set loss_fn.use_importance_sampling_correction=true (trajectories generated with older "
                        "weights must be corrected)")
    if loop == SINGLE_CONTROLLER and is_one_rank_topology(run):
        problems += _streaming_on_one_rank(master_config)
    level = cfg_path(master_config, "policy.generation.vllm_cfg.sleep_level")
    if level is not None and int(level) != run.runtime.sleep_level:
        problems.append(f"policy.generation.vllm_cfg.sleep_level={level} differs from rlix.sleep_level="
                        f"{run.runtime.sleep_level}: set both to the same value, or drop vllm_cfg.sleep_level (shrinks use "
                        "rlix.sleep_level)")
    return problems


def validate_topology(master_config: Any, run: RlixRunConfig) -> None:
    """Raise one :class:`RlixConfigError` listing every problem (see the module docstring)."""
    problems = topology_problems(master_config, run)
    if problems:
        raise RlixConfigError("the time-sharing topology is invalid:\n  - " + "\n  - ".join(problems))
