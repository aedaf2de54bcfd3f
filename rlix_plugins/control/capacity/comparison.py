"""``rlix simulate``: N async-GRPO pipelines on G GPUs, scheduled by the real planner, vs two baselines.

Three ways to run the same jobs (each job keeps its number of training GPUs and its vLLM TP size):

* **rlix**: all jobs at once on the shared pool. Job ``i`` trains on the head of its home slice (``G/N`` GPUs)
  and may run rollout ranks on *every* GPU (partial overlap: train GPUs ⊂ infer GPUs); ``plan_cycle``
  time-shares everything. Its training setup is the one of its best static configuration (below): ``train_gpus``
  GPUs, or the whole home slice with the same data-parallel time scaling when the synchronous colocated
  configuration wins. Otherwise the baseline would train twice as wide as rlix (issue 17: "train + train" lost
  0.87x to static only because of that).
* **static**: all jobs at once, each alone on its own ``G/N`` GPUs in its fastest *stock* NeMo RL configuration:
  async non-colocated (train on ``train_gpus``, rollout on the rest; needs room for a rollout rank) or
  synchronous colocated (rollout, then training data-parallel over the slice).
* **one after another**: each job alone on the whole pool in its fastest stock configuration, then the next.

Reported: aggregate steps/hour (all steps / makespan) and GPU busy share (useful rollout + training GPU-seconds
over pool x makespan), and the ratios rlix / baseline. The engine and its model are in ``simulation.py``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TypedDict, TypeVar, Unpack

from rlix_plugins.control.capacity.simulation import JobSpec, Placement, SimRun, Simulation
from rlix_plugins.control.registration import parse_cluster_memory
from rlix_plugins.control.types import ClusterMemory
from rlix_plugins.errors import RlixConfigError

__all__ = ["Comparison", "JobSpec", "SimOptions", "SimRun", "add_arguments", "best_alone", "best_stock", "compare", "rlix_placements",
           "run_cli"]

MODES = ("rlix", "static", "sequential")
T = TypeVar("T")


class SimOptions(TypedDict, total=False):
    """Keyword options of :class:`Simulation` that every run of a comparison shares (defaults: Simulation's)."""

    dt_s: float
    tick_s: float
    validate: bool
    record: bool


def _bundles(lo: int, hi: int, tp: int, gpus_per_node: int) -> list[int]:
    """GPU ids of the tp-aligned bundles that fit inside ``[lo, hi)`` (each inside one node)."""
    out: list[int] = []
    start = -(-lo // tp) * tp
    while start + tp <= hi:
        if start // gpus_per_node == (start + tp - 1) // gpus_per_node:
            out.extend(range(start, start + tp))
        start += tp
    return out


def rlix_placements(jobs: Sequence[JobSpec], num_gpus: int, gpus_per_node: int) -> list[Placement]:
    """Partial overlap on the shared pool: job ``i`` trains on the head of its home slice, rolls out anywhere."""
    n = len(jobs)
    if num_gpus == 1:  # the one-GPU topology (``rlix recipe --gpus g``): everyone trains and rolls out on it
        for job in jobs:
            if job.train_gpus != 1 or job.tp != 1:
                raise RlixConfigError(f"job {job.name}: one GPU holds trainers and rollout ranks of one GPU each; "
                                      "use --train-gpus 1 --tp 1 or more --gpus")
        return [Placement((0,), (0,)) for _ in jobs]
    home = num_gpus // n
    out: list[Placement] = []
    for i, job in enumerate(jobs):
        if job.train_gpus > home:
            raise RlixConfigError(
                f"job {job.name} trains on {job.train_gpus} GPUs but each of {n} pipelines has a home slice of "
                f"{home} of the {num_gpus} GPUs; use more --gpus or fewer --train-gpus"
            )
        train = tuple(range(i * home, i * home + job.train_gpus))
        infer = _bundles(0, num_gpus, job.tp, gpus_per_node)
        if not set(train) <= set(infer):
            raise RlixConfigError(f"job {job.name}: tp={job.tp} bundles of the pool do not cover its training GPUs")
        out.append(Placement(train, tuple(infer)))
    return out


def stock_configs(job: JobSpec, size: int, gpus_per_node: int) -> list[tuple[JobSpec, Placement]]:
    """What stock NeMo RL can run on ``size`` GPUs of its own: async non-colocated (train on ``train_gpus``,
    rollout on the rest) when a rollout rank fits, and synchronous colocated (rollout and training take turns on
    all ``size`` GPUs; training data-parallel over them, time scaled by ``train_gpus / size``, optimistically).
    Without memory figures: stock NeMo RL never runs a rollout next to a training step."""
    out: list[tuple[JobSpec, Placement]] = []
    job = replace(job, memory=None)
    infer = _bundles(job.train_gpus, size, job.tp, gpus_per_node) if job.train_gpus < size else []
    if infer:
        out.append((replace(job, start_s=0.0), Placement(tuple(range(job.train_gpus)), tuple(infer))))
    whole = _bundles(0, size, job.tp, gpus_per_node)
    if whole:
        scaled = job.train_time_s * job.train_gpus / len(whole)
        out.append((replace(job, start_s=0.0, sync=True, train_time_s=scaled), Placement(tuple(whole), tuple(whole))))
    if not out:
        raise RlixConfigError(f"job {job.name}: not even one tp={job.tp} rollout rank fits on {size} GPUs")
    return out


def best_stock(job: JobSpec, size: int, gpus_per_node: int,
               **options: Unpack[SimOptions]) -> tuple[JobSpec, Placement, SimRun]:
    """The fastest stock configuration of ``job`` alone on ``size`` GPUs: (variant, placement, its run)."""
    best: tuple[JobSpec, Placement, SimRun] | None = None
    for variant, placement in stock_configs(job, size, gpus_per_node):
        run = Simulation([variant], [placement], size, gpus_per_node, **options).run()
        if best is None or run.makespan_s < best[2].makespan_s:
            best = (variant, placement, run)
    assert best is not None
    return best


def best_alone(job: JobSpec, size: int, gpus_per_node: int, **options: Unpack[SimOptions]) -> SimRun:
    """The run of the fastest stock configuration of ``job`` alone on ``size`` GPUs."""
    return best_stock(job, size, gpus_per_node, **options)[2]


def with_training_of(job: JobSpec, variant: JobSpec, placement: Placement) -> JobSpec:
    """``job`` (async, as rlix runs it) with the training width and time of a stock ``variant``/``placement``."""
    return replace(job, train_gpus=len(placement.train), train_time_s=variant.train_time_s)


@dataclass
class Comparison:
    runs: dict[str, SimRun]
    #: the jobs as the rlix mode ran them (training setup of each job's best static configuration)
    rlix_jobs: list[JobSpec] = field(default_factory=list)

    def ratio(self, baseline: str, metric: str = "steps_per_hour") -> float:
        base = getattr(self.runs[baseline], metric)
        return getattr(self.runs["rlix"], metric) / base if base else float("inf")

    def table(self) -> str:
        rows = [
            f"{'mode':<20}{'makespan':>10}{'steps':>7}{'steps/h':>10}{'busy':>7}"
            f"{'rlix steps/h ratio':>20}{'rlix busy ratio':>17}"
        ]
        for mode in (m for m in MODES if m in self.runs):
            r = self.runs[mode]
            speed = "" if mode == "rlix" else f"{self.ratio(mode):.2f}x"
            busy = "" if mode == "rlix" else f"{self.ratio(mode, 'busy_share'):.2f}x"
            rows.append(
                f"{_LABEL[mode]:<20}{r.makespan_s:>9.0f}s{r.steps:>7}{r.steps_per_hour:>10.1f}{r.busy_share:>7.0%}"
                f"{speed:>20}{busy:>17}"
            )
        return "\n".join(rows)


_LABEL = {"rlix": "rlix (shared pool)", "static": "static partition", "sequential": "one after another"}


def _add_run(total: SimRun, run: SimRun, job: str, start_s: float, first_gpu: int) -> None:
    """Add ``run`` (of ``job`` alone, started at ``start_s`` on GPUs from ``first_gpu``) to the baseline ``total``."""
    total.events.extend(replace(e, time=e.time + start_s, gpus=tuple(g + first_gpu for g in e.gpus)) for e in run.events)
    total.finish_s[job] = start_s + run.makespan_s
    total.makespan_s = max(total.makespan_s, start_s + run.makespan_s)
    total.steps += run.steps
    total.busy_gpu_s += run.busy_gpu_s
    total.cycles += run.cycles


def compare(jobs: Sequence[JobSpec], num_gpus: int, gpus_per_node: int, **options: Unpack[SimOptions]) -> Comparison:
    """Run ``jobs`` under rlix, a static equal partition and one after another; return the three runs.

    Both baselines use each job's fastest stock configuration (``stock_configs``) on its GPUs.
    """
    rlix_placements(jobs, num_gpus, gpus_per_node)  # refuses a job whose training does not fit its home slice
    n = len(jobs)
    home = num_gpus // n
    static = SimRun(makespan_s=0.0, steps=0, busy_gpu_s=0.0, num_gpus=num_gpus, finish_s={}, cycles=0)
    seq = SimRun(makespan_s=0.0, steps=0, busy_gpu_s=0.0, num_gpus=num_gpus, finish_s={}, cycles=0)
    rlix_jobs: list[JobSpec] = []
    for i, job in enumerate(jobs):
        if home:
            variant, placement, r = best_stock(job, home, gpus_per_node, **options)
            rlix_jobs.append(with_training_of(job, variant, placement))
            _add_run(static, r, job.name, job.start_s, i * home)
        else:  # more pipelines than GPUs: no static partition exists; rlix runs the job as given (one-GPU topology)
            rlix_jobs.append(job)
        _add_run(seq, best_alone(job, num_gpus, gpus_per_node, **options), job.name, seq.makespan_s, 0)
    rlix = Simulation(rlix_jobs, rlix_placements(rlix_jobs, num_gpus, gpus_per_node), num_gpus, gpus_per_node,
                      **options).run()
    runs = {"rlix": rlix, "sequential": seq} | ({"static": static} if home else {})
    return Comparison(runs, rlix_jobs)


# ---- CLI ----------------------------------------------------------------------------------------------------


def _csv(kind: Callable[[str], float]) -> Callable[[str], list[float]]:
    """argparse type: a comma list of positive numbers."""

    def parse(text: str) -> list[float]:
        try:
            values = [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None
        if not values or any(v <= 0 for v in values):
            raise argparse.ArgumentTypeError(f"expected positive values, got {text!r}")
        return values

    return parse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``rlix simulate``. Per-job options take a comma list, repeated over the pipelines.

    The defaults mix a rollout-heavy job (long trajectories, big batch, short training) with a balanced one.
    """
    d = JobSpec(name="default")
    parser.add_argument("--pipelines", type=int, default=2, help="number of pipelines N (default 2)")
    parser.add_argument("--gpus", type=int, default=2, help="GPUs in the pool G (default 2, as `rlix demo`)")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (default 8)")
    parser.add_argument("--steps", type=_csv(int), default=[d.steps], help=f"training steps per pipeline (default {d.steps})")
    parser.add_argument("--train-gpus", type=_csv(int), default=[1], help="training GPUs per pipeline (default 1)")
    parser.add_argument("--tp", type=_csv(int), default=[d.tp], help=f"vLLM tensor-parallel size (default {d.tp})")
    parser.add_argument("--step-target", type=_csv(int), default=[1024, 512], help="trajectories per step (default 1024,512)")
    parser.add_argument("--traj-time", type=_csv(float), default=[60.0, 30.0], help="seconds to decode one trajectory (default 60,30)")
    parser.add_argument("--seqs-per-rank", type=_csv(int), default=[d.seqs_per_rank], help=f"concurrent trajectories per DP rank (default {d.seqs_per_rank})")
    parser.add_argument("--train-time", type=_csv(float), default=[30.0, 60.0], help="seconds per training step on --train-gpus (default 30,60)")
    parser.add_argument("--sync-time", type=_csv(float), default=[d.sync_time_s], help=f"seconds of cache build + weight refresh after training (default {d.sync_time_s})")
    parser.add_argument("--expand-time", type=_csv(float), default=[d.expand_time_s], help=f"seconds to wake + sync a rollout rank (default {d.expand_time_s})")
    parser.add_argument("--init-time", type=_csv(float), default=[d.init_time_s], help=f"seconds of initialisation (default {d.init_time_s})")
    parser.add_argument("--admit-delay", type=float, default=30.0, help="seconds between pipeline admissions in the concurrent modes (default 30)")
    parser.add_argument("--max-age", type=int, default=d.max_age, help=f"async GRPO max trajectory age in steps (default {d.max_age})")
    parser.add_argument("--dt", type=float, default=1.0, help="simulation time step in seconds (default 1)")
    parser.add_argument("--out", default="out/simulate", help="directory for timeline PNGs and summary.json (default out/simulate)")
    parser.add_argument("--no-validate", action="store_true", help="skip validate_plan on every cycle (faster)")
    parser.add_argument("--gpu-gib", type=float, default=None,
                        help="memory figures, as `rlix recipe` writes rlix.memory: GiB each GPU offers its tenants "
                             "(its gpu_gib); with --rollout-gib and --train-gib, phases of different pipelines share "
                             "a GPU where they fit (co-residence), as the scheduler runs such a recipe (default: "
                             "none, whole-GPU turns)")
    parser.add_argument("--rollout-gib", type=_memory, default=None,
                        help="a rollout rank's GiB per GPU awake/asleep (actor_infer's awake_gib/asleep_gib), "
                             "comma list per pipeline, e.g. 72.4/1.25")
    parser.add_argument("--train-gib", type=_memory, default=None,
                        help="a training step's GiB per GPU awake/asleep (actor_train's awake_gib/asleep_gib), "
                             "comma list per pipeline, e.g. 44.4/3")


def _memory(text: str) -> list[tuple[float, float]]:
    """argparse type: a comma list of AWAKE/ASLEEP GiB pairs."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        try:
            awake, asleep = (float(v) for v in item.split("/"))
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected AWAKE/ASLEEP GiB pairs like 72.4/1.25, got {item!r}") from None
        out.append((awake, asleep))
    if not out:
        raise argparse.ArgumentTypeError(f"expected AWAKE/ASLEEP GiB pairs like 72.4/1.25, got {text!r}")
    return out


def _per_pipeline(values: Sequence[T], flag: str, i: int, n: int) -> T:
    """Pipeline ``i``'s value of a per-pipeline comma list (a shorter list repeats; a longer one is refused)."""
    if len(values) > n:
        raise RlixConfigError(f"{flag} has {len(values)} values for {n} pipelines; give at most one per pipeline")
    return values[i % len(values)]


def _memory_of(args: argparse.Namespace, n: int) -> list[tuple[ClusterMemory, ClusterMemory] | None]:
    """Each pipeline's (rollout, training) memory figures from the flags, checked as registration checks them."""
    given = [args.gpu_gib is not None, args.rollout_gib is not None, args.train_gib is not None]
    if not any(given):
        return [None] * n
    if not all(given):
        raise RlixConfigError("memory figures need --gpu-gib, --rollout-gib and --train-gib together "
                              "(the rlix.memory figures `rlix recipe` writes), or none of them")
    out: list[tuple[ClusterMemory, ClusterMemory] | None] = []
    for i in range(n):
        pair = []
        for flag, name, values in (("--rollout-gib", "actor_infer", args.rollout_gib),
                                   ("--train-gib", "actor_train", args.train_gib)):
            awake, asleep = _per_pipeline(values, flag, i, n)
            try:
                pair.append(parse_cluster_memory(name, {"gpu_gib": args.gpu_gib, "awake_gib": awake,
                                                        "asleep_gib": asleep}))
            except RlixConfigError as exc:
                raise RlixConfigError(f"{flag} / --gpu-gib of pipeline p{i}: {exc}") from None
        out.append((pair[0], pair[1]))
    return out


def jobs_from_args(args: argparse.Namespace) -> list[JobSpec]:
    n = args.pipelines
    if n < 1 or args.gpus < 1 or args.gpus_per_node < 1 or args.max_age < 1 or args.dt <= 0:
        raise RlixConfigError("--pipelines, --gpus, --gpus-per-node, --max-age and --dt must be positive")

    def pick(values: Sequence[float], flag: str, i: int) -> float:
        return _per_pipeline(values, flag, i, n)

    memory = _memory_of(args, n)
    jobs = []
    for i in range(n):
        jobs.append(
            JobSpec(
                name=f"p{i}",
                memory=memory[i],
                train_gpus=int(pick(args.train_gpus, "--train-gpus", i)),
                tp=int(pick(args.tp, "--tp", i)),
                step_target=int(pick(args.step_target, "--step-target", i)),
                traj_time_s=pick(args.traj_time, "--traj-time", i),
                seqs_per_rank=int(pick(args.seqs_per_rank, "--seqs-per-rank", i)),
                train_time_s=pick(args.train_time, "--train-time", i),
                sync_time_s=pick(args.sync_time, "--sync-time", i),
                expand_time_s=pick(args.expand_time, "--expand-time", i),
                init_time_s=pick(args.init_time, "--init-time", i),
                steps=int(pick(args.steps, "--steps", i)),
                max_age=args.max_age,
                start_s=i * args.admit_delay,
            )
        )
    return jobs


def run_cli(args: argparse.Namespace) -> int:
    from rlix_plugins.control.capacity.timeline import render_timeline

    jobs = jobs_from_args(args)
    cmp = compare(jobs, args.gpus, args.gpus_per_node, dt_s=args.dt, validate=not args.no_validate)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"rlix simulate: {len(jobs)} pipelines on {args.gpus} GPUs ({args.gpus_per_node}/node), same planner as the scheduler")
    print(cmp.table())
    if any(j.memory is not None for j in jobs):
        print("busy counts every phase on a GPU: with memory figures two pipelines' phases share one, so rlix's share "
              "can pass 100%")
    print(f"rlix {cmp.runs['rlix'].fairness().line()}")
    pictures = []
    for mode in (m for m in MODES if m in cmp.runs):
        title = f"{_LABEL[mode]}: {len(jobs)} pipelines, {args.gpus} GPUs, {cmp.runs[mode].steps_per_hour:.1f} steps/h"
        pictures.append(render_timeline(cmp.runs[mode].events, out / f"timeline_{mode}.png", gpus=args.gpus, title=title))
    summary = {
        "jobs": [asdict(j) for j in jobs],
        "gpus": args.gpus,
        "modes": {
            m: {"makespan_s": r.makespan_s, "steps": r.steps, "steps_per_hour": r.steps_per_hour, "busy_share": r.busy_share}
            for m, r in cmp.runs.items()
        },
        "rlix_fairness": cmp.runs["rlix"].fairness().as_dict(),
        "rlix_vs_sequential": cmp.ratio("sequential"),
        "rlix_vs_static": cmp.ratio("static") if "static" in cmp.runs else None,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"timelines: {', '.join(str(p) for p in pictures)}")
    return 0
