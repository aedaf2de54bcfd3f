"""Shared placement for several pipelines' workers on the same GPUs, and the NeMo RL virtual-cluster surface its
worker groups read.

* :class:`GpuPlacementPool` - a detached named actor ``rlix:placement`` (namespace ``rlix``) that owns the placement
  groups of the cluster's GPUs, shared by every pipeline: one group per **block**, one ``{"GPU": 1, "CPU": n}``
  bundle per GPU (``n`` = worker groups per GPU). A block is one GPU, or the GPUs of one vLLM tensor-parallel rank
  (NeMo RL ties a TP group to ONE placement group: ``VllmGeneration._get_tied_worker_bundle_indices`` gives its
  workers bundles of one group, and vLLM's Ray executor puts its TP workers there). ``place(gpus, size, table)``
  takes rlix's global GPU ids, the block size and the control plane's node table (:mod:`rlix_plugins.control.nodes`:
  global id = node rank x GPUs per node + local id): each new group's bundles are pinned to the table's node by
  Ray's ``ray.io/node-id`` label, a probe in every bundle reports where it really runs (node id, node IP, its GPU's
  index on the node: :func:`local_gpu_indices`), that is checked against the table, and the group is kept under
  (node id, local GPU id) of each bundle: the local id alone repeats on every node. A GPU's group is kept while the
  pool lives, so the first pipeline on a GPU fixes its block; one that needs another block there is refused with the
  layout. The actor serialises creation (two drivers never create two groups for one GPU).
* :func:`cover` - the groups a cluster is given: whole blocks, in bundle order (NeMo RL puts one worker on every
  bundle of every group it gets; so a training slice is a union of blocks, and one-GPU vLLM ranks may use a
  bigger block only whole).
* :class:`VirtualClusterAdapter` - duck-typed to the members of NeMo RL's ``RayVirtualCluster`` that
  ``RayWorkerGroup`` / ``Policy`` / ``VllmGeneration`` read (``world_size``, ``node_count``,
  ``get_placement_groups``, ``_init_placement_groups``, ``_sorted_bundle_indices``,
  ``_nvlink_domain_per_bundle_index``, ``use_gpus``, ``num_gpus_per_node``, ``max_colocated_worker_groups``,
  ``get_master_address_and_port``, ``get_available_addresses_and_ports_batch``, ``shutdown``) over groups it does
  not own: each worker asks for ``1 / max_colocated_worker_groups`` GPU, so several pipelines' workers fit one
  bundle. ``shutdown`` is a no-op (the pool owns the groups). Any other attribute raises AttributeError.
* :func:`worker_name_prefix` - unique worker-actor names per pipeline (``<pid>-<role>``).
* :func:`nemo_rl_placement` - what the ``rlix_placement`` hook answers NeMo RL's patched ``setup()`` (patch 0002):
  the train adapter (the blocks of ``rlix.train_devices``, in order: Megatron rank i on GPU i), the inference
  adapter (the blocks of ``rlix.infer_devices``: vLLM DP rank r on ``infer_devices[r*T:(r+1)*T]``, TP ``T``) and the ``name_prefix``
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

Limits (clear errors): a GPU keeps the block the first pipeline on it asked for (TP-2 ranks on GPUs a TP-1 pipeline
placed first are refused); a TP rank runs on one node. Several nodes: tested on CPU with several raylets
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
from rlix_plugins.nemo_rl.topology import rank_slices

if TYPE_CHECKING:
    from rlix_plugins.nemo_rl.config import RlixRunConfig

__all__ = ["GpuPlacementPool", "PlacedBlock", "SetupGrant", "VirtualClusterAdapter", "adopt_setup", "cover",
           "nemo_rl_placement", "placement_pool", "take_setup", "worker_name_prefix"]

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


@dataclasses.dataclass(frozen=True)
class PlacedBlock:
    """One placement group of the pool: its global GPU ids in bundle order (bundle i holds ``gpus[i]``)."""

    group: PlacementGroup
    gpus: tuple[int, ...]


def cover(gpus: list[int], blocks: list[PlacedBlock], what: str = "these GPUs") -> list[PlacementGroup]:
    """The groups of ``blocks`` that hold ``gpus``, in order: NeMo RL's worker groups put one worker on every bundle
    of every group they are given (and a vLLM TP group on one group's bundles), so a cluster must list whole blocks,
    each's GPUs together and in bundle order. Anything else is a ``RlixConfigError`` naming the blocks."""
    where = {g: b for b in blocks for g in b.gpus}
    out: list[PlacementGroup] = []
    i = 0
    while i < len(gpus):
        block = where.get(gpus[i])
        if block is None:
            raise RlixConfigError(f"GPU {gpus[i]} of {what} has no placement group here (placed: "
                                  f"{sorted(where)}); this is a bug in the caller, not the config")
        got = tuple(gpus[i:i + len(block.gpus)])
        if got != block.gpus:
            layout = ", ".join(str(list(b.gpus)) for b in blocks)
            raise RlixConfigError(
                f"{what} {list(gpus)} do not list whole placement blocks: GPUs {list(block.gpus)} are one placement "
                f"group (vLLM tensor parallel ranks of {len(block.gpus)} GPUs; blocks: {layout}) but the list has "
                f"{list(got)} there; list every block's GPUs together, in that order (training GPUs too: NeMo RL puts "
                "a worker on every GPU of a group it is given)")
        out.append(block.group)
        i += len(block.gpus)
    return out


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
        #: every group: the (node id, local GPU) of each bundle, in bundle order
        self._keys: dict[PlacementGroup, tuple[tuple[str, int], ...]] = {}
        self._port_slots: dict[str, int] = {}

    def worker_groups_per_gpu(self) -> int:
        return self._per_gpu

    def port_slot(self, pipeline_id: str) -> int:
        """The pipeline's slot of vLLM port windows (:mod:`rlix_plugins.vllm.ports`): its own, the same on every
        call; slots go round, so up to ``ports.SLOTS`` pipelines started one after another get different ones."""
        from rlix_plugins.vllm.ports import SLOTS

        if pipeline_id not in self._port_slots:
            self._port_slots[pipeline_id] = len(self._port_slots) % SLOTS
        return self._port_slots[pipeline_id]

    def groups(self, gpus: list[int], table: NodeTable) -> dict[int, PlacementGroup]:
        """One-GPU groups of the global GPU ids ``gpus`` (``table``: the control plane's node table): :meth:`place`
        with blocks of one GPU (GPUs in a bigger block are refused: ask :meth:`place` for them)."""
        blocks = self.place(list(gpus), 1, table)
        if bigger := [list(b.gpus) for b in blocks if len(b.gpus) > 1]:
            raise RlixConfigError(f"GPUs {bigger} are placed as tensor-parallel blocks, not one group per GPU")
        return {b.gpus[0]: b.group for b in blocks}

    def place(self, gpus: list[int], block_size: int, table: NodeTable) -> list[PlacedBlock]:
        """The placement blocks that hold ``gpus`` (global ids; ``table``: the control plane's node table), in order
        of first use, created where missing: consecutive ``block_size`` GPUs of ``gpus`` are one block (a vLLM
        tensor-parallel rank: NeMo RL places its TP workers on one group's bundles), one bundle per GPU, pinned to
        the node the table names (Ray's node-id label). Ray picks the GPUs inside that node, so every new bundle is
        probed for where it really landed and checked against the table. A one-GPU group that landed on another GPU
        of its node is kept for later requests; a block that landed on other GPUs is removed and refused. A GPU's
        group, once made, is kept for the life of the pool: a block of ``block_size`` over GPUs that are already in
        other groups is refused (so is a one-GPU request on part of a bigger block), naming the layout."""
        if block_size < 1 or len(gpus) % block_size:
            raise RlixConfigError(f"{len(gpus)} GPUs {gpus} are not whole blocks of {block_size} GPUs")
        want = [tuple(table.locate(g) for g in s) for s in rank_slices(gpus, block_size)]  # clear error first
        for locs in want:
            if len({loc.node_id for loc in locs}) > 1:
                raise RlixConfigError(f"GPUs {[loc.gpu for loc in locs]} span nodes {sorted({loc.node_ip for loc in locs})}: "
                                      "a vLLM tensor-parallel rank runs on one node; list each rank's GPUs on one node")
        while need := [locs for locs in want if self._missing(locs)]:
            new = [placement_group([{"GPU": 1, "CPU": self._per_gpu}] * len(locs), strategy="STRICT_PACK",
                                   bundle_label_selector=[{NODE_ID_LABEL: locs[0].node_id}] * len(locs))
                   for locs in need]
            try:
                nodes = sorted({loc.node_ip for locs in need for loc in locs})
                ray_get([pg.ready() for pg in new], f"{len(new)} placement groups ready", self._timeout_s,
                        hint=f" (each GPU needs {self._per_gpu} free CPUs on its node, one per worker group it holds; "
                             f"GPUs {[loc.gpu for locs in need for loc in locs]} on node(s) {nodes} are missing: free "
                             "them, or declare more CPUs to Ray, e.g. `ray start --num-cpus`)")
                probes = [ray.remote(_probe_location).options(num_cpus=0, num_gpus=0.01, scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=b))).remote()
                    for pg, locs in zip(new, need, strict=True) for b in range(len(locs))]
                found = iter(ray_get(probes, "probing where new placement groups landed", self._timeout_s))
                landed = self._check_new(need, [[next(found) for _ in locs] for locs in need], table)
            except BaseException:
                for pg in new:
                    remove_placement_group(pg)
                raise
            astray = [(locs, keys) for locs, keys in zip(need, landed, strict=True)
                      if len(keys) > 1 and set(keys) != {(loc.node_id, loc.local_gpu) for loc in locs}]
            if astray:
                for pg in new:
                    remove_placement_group(pg)
                locs, keys = astray[0]
                raise PlacementMismatchError(
                    f"the placement group for GPUs {[loc.gpu for loc in locs]} landed on local GPUs "
                    f"{sorted(k[1] for k in keys)} of node {locs[0].node_ip}: Ray picks free GPUs inside a node, so "
                    "GPUs that block needs are held by something outside the pool; free them, or share the GPUs "
                    "Ray has free")
            for pg, keys in zip(new, landed, strict=True):
                self._keys[pg] = keys
                self._by_loc.update(dict.fromkeys(keys, pg))
        blocks: dict[PlacementGroup, PlacedBlock] = {}
        for locs in want:
            pg = self._by_loc[(locs[0].node_id, locs[0].local_gpu)]
            block = blocks.get(pg) or PlacedBlock(pg, tuple(table.global_gpu(*k) for k in self._keys[pg]))
            if block_size > 1 and set(block.gpus) != {loc.gpu for loc in locs}:
                raise self._conflict([loc.gpu for loc in locs], block_size, table)
            blocks[pg] = block
        placed = list(blocks.values())
        if block_size == 1:
            cover(list(gpus), placed, f"GPUs {list(gpus)}")  # one-GPU ranks over a bigger block: only all of it
        return placed

    def _missing(self, locs: tuple[GpuLocation, ...]) -> bool:
        """True when no GPU of the wanted block has a group; False when all have; a conflict otherwise."""
        have = [(loc.node_id, loc.local_gpu) in self._by_loc for loc in locs]
        if any(have) and not all(have):
            raise RlixConfigError(f"GPUs {[loc.gpu for loc in locs]}: only some have a placement group "
                                  f"({[loc.gpu for loc, h in zip(locs, have, strict=True) if h]}); a vLLM "
                                  "tensor-parallel rank needs all its GPUs in one group")
        return not any(have)

    def _conflict(self, gpus: list[int], size: int, table: NodeTable) -> RlixConfigError:
        held = sorted({tuple(table.global_gpu(*k) for k in self._keys[self._by_loc[(loc.node_id, loc.local_gpu)]])
                       for loc in (table.locate(g) for g in gpus)})
        return RlixConfigError(
            f"a vLLM tensor-parallel rank of {size} GPUs needs GPUs {gpus} in one placement group, but they are "
            f"already placed as {[list(h) for h in held]} (by pipelines that started earlier; a GPU's group is kept "
            "while the pool lives): run this pipeline's ranks on GPUs placed as blocks of its TP size, or on GPUs no "
            "pipeline used yet, or `rlix down` (when nothing runs) to start the placement afresh")

    def _check_new(self, need: list[tuple[GpuLocation, ...]], found: list[list[tuple[str, str, list[int]]]],
                   table: NodeTable) -> list[tuple[tuple[str, int], ...]]:
        """Per new group, the (node id, local GPU) of each bundle from what its probes reported; a bundle off its
        pinned node, at an address the table does not hold, or on a GPU another group holds is an error."""
        out: list[tuple[tuple[str, int], ...]] = []
        taken: set[tuple[str, int]] = set()
        for locs, reports in zip(need, found, strict=True):
            loc, keys = locs[0], []
            for node_id, node_ip, local in reports:
                if len(local) != 1:
                    raise PlacementMismatchError(f"a one-GPU bundle's worker on node {node_ip} sees GPUs {local}")
                table.check_location(table.global_gpu(node_id, local[0]), node_id, node_ip, local)
                if node_id != loc.node_id:
                    raise PlacementMismatchError(
                        f"the group for GPU {loc.gpu} was pinned to node {loc.node_ip} ({loc.node_id[:8]}…) but landed "
                        f"on {node_ip} ({node_id[:8]}…): Ray ignored the node label; check the nodes' labels (`ray list "
                        "nodes --detail`)")
                key = (node_id, local[0])
                if key in self._by_loc or key in taken:
                    raise PlacementMismatchError(
                        f"two placement groups report local GPU {local[0]} of node {node_ip}; Ray's GPU accounting "
                        "disagrees with the bundles: restart the Ray cluster")
                taken.add(key)
                keys.append(key)
            out.append(tuple(keys))
        return out

    def locations(self) -> dict[tuple[str, int], str]:
        """(node id, local GPU) -> placement group id (hex) of every GPU the pool holds."""
        return {loc: pg.id.hex() for loc, pg in self._by_loc.items()}

    def release_all(self) -> int:
        """Remove every group (``rlix down``; tests). Workers still placed in them are killed by Ray."""
        n = len(self._keys)
        for pg in self._keys:
            remove_placement_group(pg)
        self._keys.clear()
        self._by_loc.clear()
        return n


def placement_pool(worker_groups_per_gpu: int | None = None) -> Any:
    """The cluster's pool actor (created detached on first use; ``worker_groups_per_gpu`` only matters then; default:
    :func:`default_worker_groups_per_gpu`)."""
    return ray.remote(GpuPlacementPool).options(name=POOL_NAME, namespace=_NAMESPACE, lifetime="detached",
                                                get_if_exists=True, num_cpus=0).remote(
        worker_groups_per_gpu=worker_groups_per_gpu)


class VirtualClusterAdapter:
    """See the module docstring. ``groups``: placement groups in worker order (one GPU per bundle)."""

    def __init__(self, groups: list[PlacementGroup], *, max_colocated_worker_groups: int, name: str = "") -> None:
        if not groups:
            raise RlixConfigError("VirtualClusterAdapter needs at least one placement group")
        if max_colocated_worker_groups < 1:
            raise RlixConfigError(f"max_colocated_worker_groups={max_colocated_worker_groups} must be >= 1")
        self._groups = list(groups)
        self.name = name
        self.use_gpus = True
        # Bundles of ONE of these groups (a vLLM TP block, else one), not the machine's GPU count (the node table has
        # that): NeMo RL compares TP·PP with it to choose a unified cross-node group, which shared placement refuses,
        # and derives its vLLM port slots from it.
        self.num_gpus_per_node = min(pg.bundle_count for pg in self._groups)
        self.max_colocated_worker_groups = max_colocated_worker_groups
        self._sorted_bundle_indices = None
        self._nvlink_domain_per_bundle_index = None

    def world_size(self) -> int:
        return sum(pg.bundle_count for pg in self._groups)

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


def _register_setup(cp: Any, master_config: Any, cfg: RlixRunConfig, port_slot: int) -> None:
    """Register the pipeline (no GPU is asked for yet: see the module docstring) and tell its vLLM ranks which
    pipeline's start-up grant they wait for and its slot of port windows (``policy.generation.vllm_cfg.env_vars``,
    which NeMo RL hands to every vLLM worker actor)."""
    from rlix_plugins import envs
    from rlix_plugins.control.start_gate import INIT_TIMEOUT_ENV, PIPELINE_ENV
    from rlix_plugins.nemo_rl.config import cfg_path, cfg_set

    assert cfg.pipeline_id is not None  # fixed by nemo_rl_placement
    env = cfg_path(master_config, "policy.generation.vllm_cfg.env_vars") or {}
    cfg_set(master_config, "policy.generation.vllm_cfg.env_vars",
            {**env, PIPELINE_ENV: cfg.pipeline_id, INIT_TIMEOUT_ENV: str(cfg.runtime.init_timeout_s),
             envs.RLIX_VLLM_PORT_SLOT: str(port_slot)})
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
    cp = client.connect(cfg.ray_address)
    pid = cfg.pipeline_id or cp.allocate_pipeline_id()
    cfg = dataclasses.replace(cfg, pipeline_id=pid)
    scope_data_plane(master_config, pid)  # the pipeline's own TransferQueue actors (before TQPolicy starts them)
    if policy_trainer(master_config) == "megatron":  # before setup() creates the Policy's workers
        cfg_set(master_config, "policy.megatron_cfg.env_vars",
                megatron_worker_env(cfg_path(master_config, "policy.megatron_cfg.env_vars")))
    pool, dead = placement_pool(), "the placement pool actor died; `rlix down` and start again"
    table = cp.node_table()  # the control plane's: the ids in rlix.*_devices are its global GPU ids
    infer = list(cfg.infer_devices)  # train ⊂ infer (topology): the rollout ranks' blocks hold every GPU
    blocks = ray_get(pool.place.remote(infer, cfg.infer_tp, table),
                     f"shared placement groups of GPUs {infer} (blocks of {cfg.infer_tp})", cfg.runtime.init_timeout_s,
                     dead=dead)
    train_groups = cover(list(cfg.train_devices), blocks, "rlix.train_devices")
    infer_groups = cover(infer, blocks, "rlix.infer_devices")
    per_gpu = int(ray_get(pool.worker_groups_per_gpu.remote(), "pool.worker_groups_per_gpu", 60.0, dead=dead))
    port_slot = int(ray_get(pool.port_slot.remote(pid), "pool.port_slot", 60.0, dead=dead))
    _register_setup(cp, master_config, cfg, port_slot)  # last: NeMo RL creates the workers right after this returns
    train = VirtualClusterAdapter(train_groups, max_colocated_worker_groups=per_gpu, name=f"{pid}-train")
    infer_cluster = VirtualClusterAdapter(infer_groups, max_colocated_worker_groups=per_gpu, name=f"{pid}-infer")
    return (train, infer_cluster, {"name_prefix": worker_name_prefix(pid, "policy")},
            {"name_prefix": worker_name_prefix(pid, "vllm")})
