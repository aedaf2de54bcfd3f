"""Co-residence: phases of different pipelines awake on one GPU at once, where their memory fits (pure).

Whole-GPU turns leave a GPU idle most of the time even while it is held: a 1.5 B training step keeps an H200 busy a
third of the time, an eager rollout a sixth, and a 0.5 B rollout's decode is bound by its engine's CPU side (DESIGN
§9). When phases of different pipelines fit in the GPU's memory together, running them at the same time fills those
gaps. The rule (DESIGN §4, "Co-residence"):

* A GPU holds any number of allocations, at most one of each kind of each pipeline: a non-GENERATION one (a
  pipeline's training step) and a GENERATION rank. It holds more than one only when every non-GENERATION one there is training-type
  (:data:`COTENANT_PRIORITIES`: not INITIALIZATION, whose start-up profiles the free memory), no pipeline has two
  of one kind, and the GPU's memory fits them all (:func:`fits`). A pipeline's own rollout rank may stay awake
  beside its own training step like any other tenant: alone on a GPU, a pipeline whose rollout slept while it
  trained waited for every other batch (30 steps/h at 1.5 B against 44-46 for stock NeMo RL, DESIGN §9); the
  in-flight refresh after the step updates the rank like a rank on another GPU.
* Memory of a GPU (:func:`fits`): every cluster whose mapping holds the GPU counts its ``awake_gib`` when it is awake
  there and its ``asleep_gib`` otherwise; the sum must not exceed the smallest ``gpu_gib`` any of them declared. A
  cluster without figures (``ClusterSpec.memory is None``) shares its GPUs with nobody.
* The planner uses it three times: a training-type grant runs next to other pipelines' training steps on its GPUs
  where they all fit (two steps side by side fill each other's idle time: a step keeps an H200 busy 0.2-0.4 alone),
  it leaves co-tenants' rollout ranks awake instead of preempting them (as many as fit), and a rollout rank that
  wants a GPU wakes next to the GPU's holders (other pipelines' training steps and rollout ranks) where it fits,
  never on a GPU a waiting request reserves: before the gap ratio for a cluster with no rank and no idle GPU to
  take, after it for every cluster. A
  co-resident rank is never a gap-ratio donor, and a GPU with a co-resident rank is never given by the gap ratio;
  such a rank leaves by a shrink like any other (preemption, a planned release, the planner's co-resident swap: a
  pipeline with work and no rank takes the place of one rank of a pipeline that keeps another) or stays when its
  neighbours leave.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Final

from rlix_plugins.control.scheduling.turns import TURN_PRIORITIES
from rlix_plugins.control.types import ClusterSpec, Priority

#: Priorities whose allocation a co-tenant's rollout rank may run next to: training-type work, as for fair turns.
COTENANT_PRIORITIES: Final = TURN_PRIORITIES

#: Memory is summed in units of 1/2**20 GiB (KiB): integers, so a GPU's load does not depend on the order of its
#: tenants, and a sum kept per GPU (:class:`GpuTenancy`) gives exactly what adding every tenant up again gives.
_UNITS_PER_GIB: Final = 1 << 20


def _units(gib: float) -> int:
    return round(gib * _UNITS_PER_GIB)


class GpuTenancy(tuple[ClusterSpec, ...]):  # the tenants, with their figures summed once
    """The clusters mapped on one GPU, with their memory figures summed once per planning cycle: ``base`` is the
    load with every tenant asleep, ``extra[cluster id]`` what waking that tenant adds, ``cap`` the smallest
    ``gpu_gib`` (units of :data:`_UNITS_PER_GIB`); ``complete`` is False when a tenant has no figures. A load is
    then ``base`` plus the few awake tenants' ``extra`` instead of a sum over every tenant: in a pool where every
    pipeline rolls out on every GPU that sum cost a decision ~100 s at 256 pipelines x 2,048 GPUs."""

    base: int
    cap: int
    extra: dict[str, int]
    complete: bool

    def __new__(cls, specs: Iterable[ClusterSpec] = (),
                figures: Mapping[str, tuple[int, int, int] | None] | None = None) -> GpuTenancy:
        """``figures``: each cluster's (asleep, extra, gpu) in units, None without figures (:func:`_figures`),
        computed once for all GPUs (:func:`gpu_tenants`); else from the specs."""
        self = super().__new__(cls, specs)
        self.base, self.cap, self.extra, self.complete = 0, 0, {}, True
        caps = []
        for s in self:
            f = figures[s.cluster_id] if figures is not None else _figures(s)
            if f is None:
                self.complete = False
                continue
            self.base += f[0]
            self.extra[s.cluster_id] = f[1]
            caps.append(f[2])
        self.cap = min(caps, default=0)
        return self

    def load(self, awake: Collection[str]) -> int:
        """The GPU's load (units) with the tenants in ``awake`` (cluster ids) awake and every other one asleep."""
        extra, total = self.extra, self.base
        for c in awake if isinstance(awake, (set, frozenset)) else set(awake):  # (a loop: the planner asks per GPU)
            total += extra.get(c, 0)
        return total


def _figures(spec: ClusterSpec) -> tuple[int, int, int] | None:
    m = spec.memory
    if m is None:
        return None
    asleep = _units(m.asleep_gib)
    return asleep, _units(m.awake_gib) - asleep, _units(m.gpu_gib)


#: GPU id -> the clusters whose device mapping holds it.
Tenants = Mapping[int, GpuTenancy]


#: the last :func:`gpu_tenants` answer, by the identity of the specs it was built from (kept alive with it): the
#: registered clusters change rarely, a planning cycle runs every few hundred ms
_LAST_TENANTS: list[tuple[tuple[ClusterSpec, ...], dict[int, GpuTenancy]]] = []


def gpu_tenants(clusters: Iterable[ClusterSpec]) -> Mapping[int, GpuTenancy]:
    """GPU id -> the clusters mapped on it; empty when no cluster declared memory figures (co-residence off, and
    the planner pays nothing for it). Read only (the same answer serves every cycle until a cluster changes)."""
    specs = tuple(clusters)
    last = _LAST_TENANTS[0] if _LAST_TENANTS else None  # one read: another thread may replace it
    if last is not None and len(last[0]) == len(specs) and all(a is b for a, b in zip(last[0], specs, strict=True)):
        return last[1]
    tenants = _gpu_tenants(specs)
    _LAST_TENANTS[:] = [(specs, tenants)]
    return tenants


def _gpu_tenants(specs: tuple[ClusterSpec, ...]) -> dict[int, GpuTenancy]:
    if not any(s.memory is not None for s in specs):
        return {}
    out: dict[int, list[ClusterSpec]] = {}
    for s in specs:
        for g in s.device_mapping:
            out.setdefault(g, []).append(s)
    figures = {s.cluster_id: _figures(s) for s in specs}  # once per cluster, not once per GPU it maps
    return {g: GpuTenancy(v, figures) for g, v in out.items()}


def gpu_load(tenants: Iterable[ClusterSpec], awake: Collection[str]) -> tuple[float, float] | None:
    """(memory needed, memory available) in GiB on a GPU whose tenants are ``tenants`` when the clusters in
    ``awake`` (cluster ids) are awake there; None when a tenant has no figures, or nobody declared any."""
    t = tenants if isinstance(tenants, GpuTenancy) else GpuTenancy(tenants)
    if not t or not t.complete:
        return None
    need = t.load(awake)
    return need / _UNITS_PER_GIB, t.cap / _UNITS_PER_GIB  # exact: a power-of-two divisor keeps the comparison


def fits(tenants: Tenants, gpu: int, awake: Collection[str]) -> bool:
    load = gpu_load(tenants.get(gpu, ()), awake)
    return load is not None and load[0] <= load[1]


Host = tuple[ClusterSpec, Priority]  #: a non-GENERATION allocation on a GPU: its cluster and priority


def sharing_problem(tenants: Tenants, gpu: int, generation: Sequence[ClusterSpec],
                    hosts: Sequence[Host] = ()) -> str | None:
    """Why the GENERATION ranks of ``generation`` may not all be awake on ``gpu`` together, next to the
    non-GENERATION allocations ``hosts`` (cluster, priority); None when they may."""
    if len(generation) + len(hosts) < 2:
        return None  # alone on the GPU: nothing is shared
    host_pipelines: dict[str, str] = {}
    for host, priority in hosts:
        if priority not in COTENANT_PRIORITIES:
            return f"{host.cluster_id} holds it at {priority.name}, not training-type work"
        other = host_pipelines.setdefault(host.pipeline_id, host.cluster_id)
        if other != host.cluster_id:
            return f"{other} and {host.cluster_id} are one pipeline (one training-type allocation at a time)"
    pipelines = [g.pipeline_id for g in generation]
    if len(set(pipelines)) != len(pipelines):
        return f"two ranks of one pipeline on GPU {gpu}"
    awake = [g.cluster_id for g in generation] + [h.cluster_id for h, _ in hosts]
    load = gpu_load(tenants.get(gpu, ()), awake)
    if load is None:
        return "a cluster on it has no memory figures"
    if load[0] > load[1]:
        return f"they need {load[0]:.1f} GiB with every other tenant asleep, more than its {load[1]:.1f} GiB"
    return None
