"""Shared placement for several pipelines' workers on the same GPUs, and the NeMo RL virtual-cluster surface its
worker groups read.

* :class:`GpuPlacementPool` - a detached named actor ``rlix:placement`` (namespace ``rlix``) that owns ONE placement
  group per GPU (one ``{"GPU": 1, "CPU": n}`` bundle each, ``n`` = worker groups per GPU), created on first use and
  shared by every pipeline. ``groups(gpus, table)`` takes rlix's global GPU ids and the control plane's node table
  (:mod:`rlix_plugins.control.nodes`: global id = node rank x GPUs per node + local id): each new group's bundle is
  pinned to the table's node by Ray's ``ray.io/node-id`` label, a probe in the bundle reports where it really runs
  (node id, node IP, its GPU's index on the node: :func:`local_gpu_indices`), that is checked against the table, and the group is kept under
  (node id, local GPU id): the local id alone repeats on every node. The actor serialises creation (two drivers
  never create two groups for one GPU).
* :class:`VirtualClusterAdapter` - duck-typed to the members of NeMo RL's ``RayVirtualCluster`` that
  ``RayWorkerGroup`` / ``Policy`` / ``VllmGeneration`` read (``world_size``, ``node_count``,
  ``get_placement_groups``, ``_init_placement_groups``, ``_sorted_bundle_indices``,
  ``_nvlink_domain_per_bundle_index``, ``use_gpus``, ``num_gpus_per_node``, ``max_colocated_worker_groups``,
  ``get_master_address_and_port``, ``get_available_addresses_and_ports_batch``, ``shutdown``) over groups it does
  not own: each worker asks for ``1 / max_colocated_worker_groups`` GPU, so several pipelines' workers fit one
  bundle. ``shutdown`` is a no-op (the pool owns the groups). Any other attribute raises AttributeError.
* :func:`worker_name_prefix` - unique worker-actor names per pipeline (``<pid>-<role>``).
* :func:`nemo_rl_placement` - what the ``rlix_placement`` hook answers NeMo RL's patched ``setup()`` (patch 0002):
  the train adapter (one group per ``rlix.train_devices`` GPU, in order: Megatron rank i on GPU i), the inference
  adapter (one per ``rlix.infer_devices`` GPU: vLLM DP rank r on ``infer_devices[r]``) and the ``name_prefix``
  keywords of ``Policy`` / ``VllmGeneration``. It fixes the pipeline id here (``rlix.pipeline_id`` or a fresh one)
  so the names and the registration agree. With a Megatron policy it also names Ray's worker-process setup hook in
  ``policy.megatron_cfg.env_vars``, so each Megatron worker records its ``initialize_model_parallel`` call before
  its model setup (:func:`.megatron_nccl.megatron_worker_env`; why there: that module's docstring).
* The start-up grant (:mod:`rlix_plugins.control.start_gate`): :func:`nemo_rl_placement` registers the pipeline and
  returns at once, so setup() starts its worker processes (imports, model conversion, engine creation) while other
  pipelines keep running; only each vLLM rank's device set-up waits for INITIALIZATION of the pipeline's inference
  cluster (every GPU it uses: training ⊂ inference), which it asks for from its ``init_device``. A
  :class:`SetupGrant` (the parsed config with the pipeline id, and the registration) waits in this process for
  ``rlix_pipeline_start`` (another hook instance: setup() and the loop each load the hooks) to :func:`take_setup`
  it with the master config setup() was given (NeMo RL's setup() returns that object, and the loop gets it).
  NeMo RL's config is written only where NeMo RL's own processes must read it: ``data_plane.rlix_namespace`` (the
  TransferQueue loops, :func:`.config.scope_data_plane`) and ``policy.generation.vllm_cfg.env_vars`` (the pipeline
  id its vLLM ranks wait for). The runtime's init phases run under the same grant (asked for again, which returns at
  once when the ranks hold it) and release it (``PipelineRuntime.start(init_held=True)``). Never taken (setup()
  failed, or the loop never ran): unregistered at exit. The SingleController runs ``setup()`` in the driver but its
  hooks inside its own actor process: there :func:`adopt_setup` adopts the registration by pipeline id through the
  control plane.

Limits (clear errors): vLLM TP 1 only (a TP group needs one multi-bundle placement group, NeMo RL's tied-worker
layout; such a group will be pinned to one node the same way). Several nodes: tested on CPU with several raylets
(``tests/nemo_rl/without_nemo/test_placement_nodes.py``), not yet on GPU machines.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import socket
import threading
from typing import TYPE_CHECKING, Any, Final

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rlix_plugins.control.nodes import NODE_ID_LABEL, GpuLocation, NodeTable, PlacementMismatchError
from rlix_plugins.control.rpc import ray_get
from rlix_plugins.errors import RlixConfigError, RlixError

if TYPE_CHECKING:
    from rlix_plugins.nemo_rl.config import RlixRunConfig

__all__ = ["GpuPlacementPool", "SetupGrant", "VirtualClusterAdapter", "adopt_setup", "nemo_rl_placement",
           "placement_pool", "take_setup", "worker_name_prefix"]

logger = logging.getLogger(__name__)

POOL_NAME: Final = "rlix:placement"
_NAMESPACE: Final = "rlix"
#: Least worker groups one GPU's bundle holds. Each worker asks ``1 / n`` GPU and 1 CPU (NeMo RL's workers keep
#: Ray's default CPU), so a bundle is ``{"GPU": 1, "CPU": n}``; a pipeline puts at most two on a GPU (a training
#: worker and a vLLM rank). The pool's creator takes half of the cluster's logical CPUs per GPU, at least this, so the
#: slots are not what bounds the pipelines on a GPU: memory is (``rlix recipe`` checks it, ``memory_budget``). A
#: cluster with few logical CPUs per GPU needs more declared (``ray start --num-cpus``, ``rlix up --num-cpus``).
#: The first creator fixes ``n`` for the cluster.
MIN_WORKER_GROUPS_PER_GPU: Final = 4


def default_worker_groups_per_gpu() -> int:
    """Half of the Ray cluster's logical CPUs per GPU (the other half for collectors, reward workers, ...)."""
    res = ray.cluster_resources()
    gpus = int(res.get("GPU", 0)) or 1
    return max(MIN_WORKER_GROUPS_PER_GPU, int(res.get("CPU", 0)) // gpus // 2)


def worker_name_prefix(pipeline_id: str, role: str) -> str:
    """Prefix of a pipeline's worker-actor names (``ft_ab12…-policy``): unique across pipelines."""
    return f"{pipeline_id}-{role}"


def _probe_location() -> tuple[str, str, list[int]]:
    """Where this worker really runs: (Ray node id, node IP, node-local GPU ids)."""
    return (ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(),
            local_gpu_indices(ray.get_gpu_ids()))


def local_gpu_indices(ids: list[int] | list[str]) -> list[int]:
    """Ray's GPU ids of this worker as the node's GPU indices 0..n-1 (the node table's local ids).

    ``ray.get_gpu_ids()`` names GPUs as the raylet's ``CUDA_VISIBLE_DEVICES`` does: a raylet started on GPUs 2,3
    of its machine reports 2 and 3 for its GPUs 0 and 1 (Ray maps its slot i to that list's i-th entry; the list is
    what the worker inherited, which Ray keeps before narrowing the variable to the worker's own GPUs). Without
    such a list (the raylet saw every GPU) the ids are the indices."""
    worker = getattr(ray._private.worker, "global_worker", None)  # Ray keeps the inherited list only there
    visible = (getattr(worker, "original_visible_accelerator_ids", None) or {}).get("GPU")
    if not visible:
        return [int(g) for g in ids]
    order = [str(v) for v in visible]
    missing = [g for g in ids if str(g) not in order]
    if missing:
        raise PlacementMismatchError(f"this worker's GPUs {missing} are not in the node's visible GPUs {order} "
                                     "(CUDA_VISIBLE_DEVICES of its raylet); restart that raylet")
    return [order.index(str(g)) for g in ids]


def _free_port() -> tuple[str, int]:
    with socket.socket() as s:
        s.bind(("", 0))
        return ray.util.get_node_ip_address(), int(s.getsockname()[1])


class GpuPlacementPool:
    """See the module docstring. A plain (one call at a time) actor: creation is serialised."""

    def __init__(self, timeout_s: float = 120.0, worker_groups_per_gpu: int | None = None) -> None:
        if worker_groups_per_gpu is None:
            worker_groups_per_gpu = default_worker_groups_per_gpu()
        if worker_groups_per_gpu < 1:
            raise RlixConfigError(f"worker_groups_per_gpu={worker_groups_per_gpu} must be >= 1")
        self._timeout_s = timeout_s
        self._per_gpu = int(worker_groups_per_gpu)
        #: (Ray node id, node-local GPU id) -> its group. Never the local id alone: it repeats on every node.
        self._by_loc: dict[tuple[str, int], PlacementGroup] = {}

    def worker_groups_per_gpu(self) -> int:
        return self._per_gpu

    def groups(self, gpus: list[int], table: NodeTable) -> dict[int, PlacementGroup]:
        """Placement groups of the global GPU ids ``gpus`` (``table``: the control plane's node table), created on
        first use and kept. Each new group's bundle is pinned to the node the table names (Ray's node-id label);
        Ray picks the GPU inside that node, so groups are created (one per missing GPU), probed for where they
        really landed, checked against the table and kept, until every requested GPU has one; a group that landed
        on another GPU of its node is kept for later requests."""
        want = {g: table.locate(g) for g in gpus}  # a clear error for an id outside the pool, before creating any
        while need := [loc for loc in want.values() if (loc.node_id, loc.local_gpu) not in self._by_loc]:
            new = [placement_group([{"GPU": 1, "CPU": self._per_gpu}], strategy="STRICT_PACK",
                                   bundle_label_selector=[{NODE_ID_LABEL: loc.node_id}]) for loc in need]
            try:
                nodes = sorted({loc.node_ip for loc in need})
                ray_get([pg.ready() for pg in new], f"{len(new)} per-GPU placement groups ready", self._timeout_s,
                        hint=f" (each needs 1 free GPU and {self._per_gpu} free CPUs on its node, one CPU per worker "
                             f"group it holds; GPUs {[loc.gpu for loc in need]} on node(s) {nodes} are missing: "
                             "free them, or declare more CPUs to Ray, e.g. `ray start --num-cpus`)")
                probes = [ray.remote(_probe_location).options(num_cpus=0, num_gpus=0.01, scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=0))).remote()
                    for pg in new]
                found = ray_get(probes, "probing where new placement groups landed", self._timeout_s)
                fresh = self._check_new(need, found, table)
            except BaseException:
                for pg in new:
                    remove_placement_group(pg)
                raise
            self._by_loc.update(zip(fresh, new, strict=True))
        return {g: self._by_loc[(loc.node_id, loc.local_gpu)] for g, loc in want.items()}

    def _check_new(self, need: list[GpuLocation], found: list[tuple[str, str, list[int]]],
                   table: NodeTable) -> list[tuple[str, int]]:
        """The (node id, local GPU) keys of new groups from what their probes reported; a group off its pinned node,
        at an address the table does not hold, or on a GPU another group holds is an error."""
        keys: list[tuple[str, int]] = []
        for loc, (node_id, node_ip, local) in zip(need, found, strict=True):
            if len(local) != 1:
                raise PlacementMismatchError(f"a one-GPU bundle's worker on node {node_ip} sees GPUs {local}")
            table.check_location(table.global_gpu(node_id, local[0]), node_id, node_ip, local)
            if node_id != loc.node_id:
                raise PlacementMismatchError(
                    f"the group for GPU {loc.gpu} was pinned to node {loc.node_ip} ({loc.node_id[:8]}…) but landed on "
                    f"{node_ip} ({node_id[:8]}…): Ray ignored the node label; check the nodes' labels (`ray list "
                    "nodes --detail`)")
            key = (node_id, local[0])
            if key in self._by_loc or key in keys:
                raise PlacementMismatchError(f"two placement groups report local GPU {local[0]} of node {node_ip}; "
                                             "Ray's GPU accounting disagrees with the bundles: restart the Ray cluster")
            keys.append(key)
        return keys

    def locations(self) -> dict[tuple[str, int], str]:
        """(node id, local GPU) -> placement group id (hex) of every group the pool holds."""
        return {loc: pg.id.hex() for loc, pg in self._by_loc.items()}

    def release_all(self) -> int:
        """Remove every group (``rlix down``; tests). Workers still placed in them are killed by Ray."""
        n = len(self._by_loc)
        for pg in self._by_loc.values():
            remove_placement_group(pg)
        self._by_loc.clear()
        return n


def placement_pool(worker_groups_per_gpu: int | None = None) -> Any:
    """The cluster's pool actor (created detached on first use; ``worker_groups_per_gpu`` only matters then; default:
    :func:`default_worker_groups_per_gpu`)."""
    return ray.remote(GpuPlacementPool).options(name=POOL_NAME, namespace=_NAMESPACE, lifetime="detached",
                                                get_if_exists=True, num_cpus=0).remote(
        worker_groups_per_gpu=worker_groups_per_gpu)


class VirtualClusterAdapter:
    """See the module docstring. ``groups``: placement groups in worker order (one GPU bundle each)."""

    def __init__(self, groups: list[PlacementGroup], *, max_colocated_worker_groups: int, name: str = "") -> None:
        if not groups:
            raise RlixConfigError("VirtualClusterAdapter needs at least one placement group")
        if max_colocated_worker_groups < 1:
            raise RlixConfigError(f"max_colocated_worker_groups={max_colocated_worker_groups} must be >= 1")
        self._groups = list(groups)
        self.name = name
        self.use_gpus = True
        # Bundles per node inside ONE of these groups (one), not the machine's GPU count (the node table has that):
        # NeMo RL compares TP·PP with it to choose a unified cross-node group, refused here (TP 1 only for now).
        self.num_gpus_per_node = 1
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self._sorted_bundle_indices = None
        self._nvlink_domain_per_bundle_index = None

    def world_size(self) -> int:
        return len(self._groups)

    def node_count(self) -> int:
        return len(self._groups)

    def get_placement_groups(self) -> list[PlacementGroup]:
        return list(self._groups)

    def _init_placement_groups(self, strategy: str | None = None, use_unified_pg: bool = False) -> list[PlacementGroup]:
        if use_unified_pg:
            raise RlixConfigError("cross-node model parallelism (a unified placement group) is not supported with "
                                  "shared per-GPU placement groups")
        return list(self._groups)

    def get_available_addresses_and_ports_batch(self, pg_bundle_pairs: list[tuple[int, int]],
                                                batch_size: int = 256) -> list[tuple[str, int]]:
        refs = [ray.remote(_free_port).options(num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=self._groups[pg], placement_group_bundle_index=b)).remote() for pg, b in pg_bundle_pairs]
        return [tuple(r) for r in ray.get(refs, timeout=120)]  # type: ignore[misc]

    def get_available_address_and_port(self, pg_idx: int, bundle_idx: int) -> tuple[str, int]:
        """One at a time: what NeMo RL v0.7.0's worker group asks (main asks the batch above)."""
        return self.get_available_addresses_and_ports_batch([(pg_idx, bundle_idx)])[0]

    def get_master_address_and_port(self) -> tuple[str, int]:
        return self.get_available_addresses_and_ports_batch([(0, 0)])[0]

    def shutdown(self) -> bool:
        return True  # the pool owns the placement groups; they outlive any one pipeline


@dataclasses.dataclass(frozen=True)
class SetupGrant:
    """What setup()'s placement hands the loop's hooks (see the module docstring)."""

    #: The object setup() was given; the loop's ``rlix_pipeline_start`` finds its grant by it (identity).
    master_config: Any
    #: The ``rlix`` section, parsed and validated once, with the pipeline id fixed.
    config: RlixRunConfig
    #: The registration (``client.PipelineHandle``); its vLLM ranks take INITIALIZATION of every GPU of the pipeline.
    pipe: Any


#: Setup grants no ``rlix_pipeline_start`` took over yet (pipeline id -> grant).
_SETUP_GRANTS: dict[str, SetupGrant] = {}
_SETUP_LOCK = threading.Lock()


def _register_setup(cp: Any, master_config: Any, cfg: RlixRunConfig) -> None:
    """Register the pipeline (no GPU is asked for yet: see the module docstring) and tell its vLLM ranks which
    pipeline's start-up grant they wait for (``policy.generation.vllm_cfg.env_vars``, which NeMo RL hands to every
    vLLM worker actor)."""
    from rlix_plugins.control.start_gate import INIT_TIMEOUT_ENV, PIPELINE_ENV
    from rlix_plugins.nemo_rl.config import cfg_path, cfg_set

    assert cfg.pipeline_id is not None  # fixed by nemo_rl_placement
    env = cfg_path(master_config, "policy.generation.vllm_cfg.env_vars") or {}
    cfg_set(master_config, "policy.generation.vllm_cfg.env_vars",
            {**env, PIPELINE_ENV: cfg.pipeline_id, INIT_TIMEOUT_ENV: str(cfg.runtime.init_timeout_s)})
    pipe = cfg.register(cp)
    pipe.keep_alive()  # the lease runs from here: its vLLM ranks take the start-up grant while setup() goes on
    with _SETUP_LOCK:
        _SETUP_GRANTS[cfg.pipeline_id] = SetupGrant(master_config, cfg, pipe)
    atexit.register(_end_untaken_setup_grant, cfg.pipeline_id)


def take_setup(master_config: Any) -> SetupGrant | None:
    """The grant setup() left in this process for ``master_config`` (the same object, or a copy naming the same
    ``rlix.pipeline_id``); the taker runs its start under INITIALIZATION and releases it. None when setup() placed
    nothing (NeMo RL's own clusters, or a test calling the loop's hooks alone)."""
    from rlix_plugins.nemo_rl.config import cfg_path

    fixed = cfg_path(master_config, "rlix.pipeline_id")
    with _SETUP_LOCK:
        for pid, grant in _SETUP_GRANTS.items():
            if grant.master_config is master_config or pid == fixed:
                return _SETUP_GRANTS.pop(pid)
        pending = sorted(_SETUP_GRANTS)
    if pending:
        raise RlixError(
            f"setup() registered pipeline(s) {pending} for another master config object; pass async_grpo_train the "
            "master_config setup() returned, or fix the id with ++rlix.pipeline_id=<id>"
        )
    return None


def adopt_setup(master_config: Any, cfg: RlixRunConfig, cp: Any) -> SetupGrant | None:
    """The SingleController runs setup() in the driver but its hooks in its own actor process, with a copy of the
    master config: there setup()'s registration is adopted through the control plane when the pipeline the copy
    names (``rlix.pipeline_id``, else the data-plane namespace setup() wrote: :func:`.config.data_plane_pipeline_id`)
    is registered; None otherwise (nothing to adopt: register anew)."""
    from rlix_plugins.nemo_rl.config import data_plane_pipeline_id

    pid = cfg.pipeline_id or data_plane_pipeline_id(master_config)
    if not pid or pid not in cp.status()["pipelines"]:
        return None
    return SetupGrant(master_config, dataclasses.replace(cfg, pipeline_id=pid), cp.pipeline(pid))


def _end_untaken_setup_grant(pipeline_id: str) -> None:
    with _SETUP_LOCK:
        grant = _SETUP_GRANTS.pop(pipeline_id, None)
    if grant is not None:
        try:
            grant.pipe.unregister("setup() ended without the training loop taking over its GPUs")
        except Exception as exc:  # interpreter exit: the control plane may be gone already
            logger.warning("rlix %s: could not unregister the untaken setup grant at exit: %s", pipeline_id, exc)


def nemo_rl_placement(master_config: Any) -> tuple[VirtualClusterAdapter, VirtualClusterAdapter, dict[str, Any],
                                                    dict[str, Any]]:
    """``(train_cluster, inference_cluster, policy_kwargs, generation_kwargs)`` for NeMo RL's ``setup()``.

    Validates the config and topology first (nothing is placed for a run that cannot start). Blocks on: the
    control plane (connect, allocate an id, register; no GPU grant: see the module docstring) and the pool (group
    creation); both bounded by ``rlix.init_timeout_s``.
    """
    from rlix_plugins.control import client
    from rlix_plugins.nemo_rl.config import (
        cfg_path,
        cfg_set,
        load_run_config,
        policy_trainer,
        scope_data_plane,
    )
    from rlix_plugins.nemo_rl.megatron_nccl import megatron_worker_env
    from rlix_plugins.nemo_rl.topology import validate_topology

    cfg = load_run_config(master_config)
    validate_topology(master_config, cfg)
    if cfg.infer_tp != 1:
        raise RlixConfigError(
            f"shared placement supports vLLM tensor_parallel_size=1 only (got {cfg.infer_tp}): a TP group needs one "
            "multi-GPU placement group; use policy.generation.vllm_cfg.tensor_parallel_size=1 for time-sharing"
        )
    cp = client.connect(cfg.ray_address)
    pid = cfg.pipeline_id or cp.allocate_pipeline_id()
    cfg = dataclasses.replace(cfg, pipeline_id=pid)
    scope_data_plane(master_config, pid)  # the pipeline's own TransferQueue actors (before TQPolicy starts them)
    if policy_trainer(master_config) == "megatron":  # before setup() creates the Policy's workers
        cfg_set(master_config, "policy.megatron_cfg.env_vars",
                megatron_worker_env(cfg_path(master_config, "policy.megatron_cfg.env_vars")))
    gpus = sorted(set(cfg.train_devices) | set(cfg.infer_devices))
    pool, dead = placement_pool(), "the placement pool actor died; `rlix down` and start again"
    table = cp.node_table()  # the control plane's: the ids in rlix.*_devices are its global GPU ids
    groups = ray_get(pool.groups.remote(gpus, table), f"shared placement groups of GPUs {gpus}", cfg.runtime.init_timeout_s,
                     dead=dead)
    per_gpu = int(ray_get(pool.worker_groups_per_gpu.remote(), "pool.worker_groups_per_gpu", 60.0, dead=dead))
    _register_setup(cp, master_config, cfg)  # last: NeMo RL creates the workers right after this returns
    train = VirtualClusterAdapter([groups[g] for g in cfg.train_devices], max_colocated_worker_groups=per_gpu,
                                  name=f"{pid}-train")
    infer = VirtualClusterAdapter([groups[g] for g in cfg.infer_devices], max_colocated_worker_groups=per_gpu,
                                  name=f"{pid}-infer")
    return (train, infer, {"name_prefix": worker_name_prefix(pid, "policy")},
            {"name_prefix": worker_name_prefix(pid, "vllm")})
