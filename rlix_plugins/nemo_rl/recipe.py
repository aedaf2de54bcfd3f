"""``rlix recipe``: from a stock NeMo RL GRPO recipe and the GPUs to share, the time-sharing overlays.

One overlay per pipeline: a YAML with ``defaults: <stock recipe>`` (NeMo RL's own inheritance) plus only the keys
time-sharing changes, each with its reason as a comment. The stock recipe is resolved the way NeMo RL's
``nemo_rl.utils.config.load_config`` does (``defaults:`` chains, later files win, dicts merge, ``_override_: true``
replaces a section) without importing NeMo RL; the result (stock + overlay) passes the same start-up checks as a
real run (:func:`.config.load_run_config`, :func:`.topology.topology_problems`), or nothing is written.

Layout of ``N`` pipelines on ``G`` GPUs with vLLM TP ``T`` (the stock recipe's, or ``--tp``; a rollout rank is
``T`` consecutive GPUs of ``--gpus``). ``--gpus`` are the control plane's global GPU ids
(:mod:`rlix_plugins.control.nodes`: node rank x ``--gpus-per-node`` + local id), so on ``--nodes M`` they run
``0 .. M x gpus-per-node - 1``:

* ``G == T``: one rollout rank; every pipeline trains and rolls out on its GPUs (:func:`.topology.is_one_rank_topology`;
  one GPU with TP 1);
* ``G > T``: partial overlap as in ``recipes/nemo_rl/``: every pipeline rolls out on all G GPUs and trains on
  its own home slice (``G // N`` GPUs, at most ``G - T`` so one rank always stays outside, rounded down to whole
  rollout ranks and whole trainer replicas: a rank's GPUs are one placement group, which training takes whole).

The GRPO loop (:func:`.topology.grpo_loop`): a stock SingleController or TransferQueue (``data_plane.enabled``)
recipe keeps its loop; any other is switched to async GRPO, or with ``--data-plane`` to the TransferQueue loop.
"""

from __future__ import annotations

import math
import os
import re
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from rlix_plugins.errors import RlixConfigError
from rlix_plugins.nemo_rl.config import cfg_path, load_run_config
from rlix_plugins.nemo_rl.memory_budget import (
    DEFAULT_STEP_TOKENS,
    ENGINE_BATCH_TOKENS,
    ENGINE_MAX_SEQS,
    ENGINE_MIN_SEQS,
    PipelineMemory,
    check_fits,
    cluster_memory,
    engine_need_gib,
    gpu_need_gib,
    pipeline_memory,
)
from rlix_plugins.nemo_rl.model_shape import bucket_size_for, model_shape
from rlix_plugins.nemo_rl.topology import (
    ASYNC_GRPO,
    DATA_PLANE,
    SINGLE_CONTROLLER,
    grpo_loop,
    topology_problems,
    training_parallel_size,
    vllm_parallel_problems,
)
from rlix_plugins.pipeline.config import RuntimeConfig

__all__ = ["Overlay", "PipelineLayout", "layout", "load_stock", "make_overlays", "run_cli", "write_overlays"]

#: The vLLM worker class that carries the weight receiver (``rlix_plugins.vllm.nemo_rl_vllm_kwargs()``).
_WORKER_CLS: Final = "rlix_plugins.vllm.gpu_worker.RlixGPUWorker"
_SLEEP_LEVEL: Final = RuntimeConfig.sleep_level  # the runtime's default, declared there


# ---------------------------------------------------------------- NeMo RL's config inheritance, reimplemented
def _merge(base: Any, over: Any) -> Any:
    """OmegaConf.merge for plain YAML data: mappings merge key by key, anything else is replaced; ``???``
    (mandatory, unset) never overwrites; ``_override_: true`` replaces the whole section (NeMo RL's marker)."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    out = dict(base)
    for key, value in over.items():
        if value == "???" and key in out:
            continue
        if isinstance(value, dict) and value.get("_override_", False):
            out[key] = {k: v for k, v in value.items() if k != "_override_"}
        else:
            out[key] = _merge(out.get(key), value)
    return out


#: OmegaConf's float rule (YAML 1.2-like: ``1e-8`` is a float, PyYAML's YAML 1.1 reads it as a string).
_FLOAT: Final = re.compile(r"""^(?:
     [-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
    |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
    |\.[0-9_]+(?:[eE][-+][0-9]+)?
    |[-+]?[0-9][0-9_]*(?::[0-5]?[0-9])+\.[0-9_]*
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


def _yaml_loader() -> Any:
    """PyYAML's SafeLoader read the way OmegaConf reads YAML (its float rule; timestamps stay strings)."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.yaml_implicit_resolvers = {
        ch: [(tag, rx) for tag, rx in rules if tag not in ("tag:yaml.org,2002:float", "tag:yaml.org,2002:timestamp")]
        for ch, rules in yaml.SafeLoader.yaml_implicit_resolvers.items()
    }
    Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))
    return Loader


def load_stock(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The recipe at ``path`` with its ``defaults:`` chain resolved (relative to each file's directory)."""
    import yaml

    path = Path(path)
    try:
        config = yaml.load(path.read_text(), Loader=_yaml_loader())  # a SafeLoader subclass
    except OSError as exc:
        raise RlixConfigError(f"cannot read the recipe {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise RlixConfigError(f"{path} is not valid YAML{where} ({problem}); fix the recipe file") from None
    if not isinstance(config, dict):
        raise RlixConfigError(f"{path} must be a YAML mapping (a NeMo RL recipe), not {type(config).__name__}")
    defaults = config.pop("defaults", None)
    if defaults is None:
        return config
    parents = [defaults] if isinstance(defaults, str) else list(defaults)
    base: dict[str, Any] = {}
    for parent in parents:
        parent_path = Path(str(parent))
        base = _merge(base, load_stock(parent_path if parent_path.is_absolute() else path.parent / parent_path))
    return _merge(base, config)


def _resolved(config: Mapping[str, Any], dotted: str, depth: int = 0) -> Any:
    """``cfg_path`` that follows a whole-value absolute interpolation (``${policy.x}``) like OmegaConf does."""
    value = cfg_path(config, dotted)
    if isinstance(value, str) and value.startswith("${") and value.endswith("}"):
        ref = value[2:-1]
        if ":" in ref or ref.startswith(".") or depth > 16:
            raise RlixConfigError(f"{dotted}={value!r}: rlix recipe follows plain ${{a.b}} references only; "
                                  "set the value in the recipe")
        return _resolved(config, ref, depth + 1)
    return value


# ---------------------------------------------------------------- layout
@dataclass(frozen=True)
class PipelineLayout:
    name: str
    train_devices: tuple[int, ...]
    infer_devices: tuple[int, ...]


def layout(num_pipelines: int, gpus: Sequence[int], trainer_size: int, tp: int = 1) -> list[PipelineLayout]:
    """Where each pipeline trains and rolls out (see the module docstring); refuses what cannot be shared."""
    gpus = tuple(gpus)
    if num_pipelines < 1:
        raise RlixConfigError(f"--pipelines {num_pipelines}: need at least 1")
    if num_pipelines > len(string.ascii_lowercase):
        raise RlixConfigError(f"--pipelines {num_pipelines}: at most {len(string.ascii_lowercase)}")
    names = string.ascii_lowercase[:num_pipelines]
    if len(gpus) % tp:
        raise RlixConfigError(f"--gpus {list(gpus)}: {len(gpus)} GPUs are not whole vLLM ranks of TP {tp}; share a "
                              f"multiple of {tp} GPUs")
    if len(gpus) == tp:
        if tp % trainer_size:
            raise RlixConfigError(f"one model replica of the trainer spans {trainer_size} GPUs; the {tp} GPU(s) of "
                                  "one rollout rank cannot hold whole replicas: share more GPUs (--gpus) or change "
                                  "the trainer's parallel sizes")
        return [PipelineLayout(n, gpus, gpus) for n in names]
    step = math.lcm(tp, trainer_size)  # whole rollout ranks (one placement group each) of whole trainer replicas
    home = len(gpus) // num_pipelines // tp * tp
    per_pipeline = min(home, len(gpus) - tp) // step * step
    if per_pipeline < 1:
        raise RlixConfigError(
            f"{num_pipelines} pipelines on {len(gpus)} GPUs leave each a home slice of {home} GPU(s) to train on; "
            f"it must be whole rollout ranks (vLLM TP {tp}) of whole trainer replicas ({trainer_size} GPU(s)), and "
            f"one rank ({tp} GPU(s)) must stay outside training: use more GPUs, fewer pipelines, or the GPUs of one "
            "rank for all (--gpus with as many GPUs as the TP size)")
    return [PipelineLayout(n, gpus[i * home:i * home + per_pipeline], gpus) for i, n in enumerate(names)]


# ---------------------------------------------------------------- overlays
@dataclass
class Overlay:
    """The changed keys of one pipeline (dotted key -> (value, reason)) and the notes printed with them."""

    pipeline: PipelineLayout
    changes: dict[str, tuple[Any, str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    #: what the memory budget found (printed, not written: it depends on the machine that checked it)
    memory: str = ""

    def nested(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, (value, _) in self.changes.items():
            node = out
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = value
        return out


def _set(overlay: Overlay, stock: Mapping[str, Any], key: str, value: Any, reason: str) -> None:
    """Record ``key = value`` unless the stock recipe already has that value (only changed keys are written)."""
    if key.startswith("rlix.") or cfg_path(stock, key) != value:
        overlay.changes[key] = (value, reason)


def _refusals(stock: Mapping[str, Any], gpus: Sequence[int], gpus_per_node: int, nodes: int = 1) -> list[str]:
    problems: list[str] = []
    backend = _resolved(stock, "policy.generation.backend")
    if backend not in (None, "vllm"):
        problems.append(f"policy.generation.backend={backend!r}: time-sharing supports vLLM only; use a vLLM recipe "
                        "or set policy.generation.backend=vllm in it")
    tp = _resolved(stock, "policy.generation.vllm_cfg.tensor_parallel_size") or 1
    problems += vllm_parallel_problems(_resolved(stock, "policy.generation.vllm_cfg.pipeline_parallel_size"),
                                       _resolved(stock, "policy.generation.vllm_cfg.expert_parallel_size"), tp)
    stock_nodes = int(_resolved(stock, "cluster.num_nodes") or 1)
    if stock_nodes not in (1, nodes):  # a one-node recipe may be spread; a many-node one says how many it wants
        problems.append(f"cluster.num_nodes={stock_nodes} in the recipe but --nodes {nodes}: pass --nodes "
                        f"{stock_nodes} --gpus-per-node <GPUs of each node> (and --gpus over all of them), or set "
                        f"cluster.num_nodes={nodes} in the recipe")
    total = nodes * gpus_per_node
    if len(set(gpus)) != len(gpus) or any(g < 0 for g in gpus):
        problems.append(f"--gpus {list(gpus)}: list distinct GPU ids >= 0")
    elif max(gpus) >= total:
        where = (f"a node of {gpus_per_node} GPUs (--gpus-per-node)" if nodes == 1 else
                 f"{nodes} nodes x {gpus_per_node} GPUs (--nodes, --gpus-per-node; node rank x GPUs per node + local "
                 "id)")
        problems.append(f"--gpus {list(gpus)} on {where}: GPU ids are 0..{total - 1}")
    return problems


def _step_tokens(stock: Mapping[str, Any]) -> int:
    """Tokens of one training micro-batch (``policy.train_micro_batch_size`` x ``policy.max_total_sequence_length``),
    whose vocabulary logits a training step holds; the stock recipe's when the recipe does not say plainly."""
    micro = _int_or_none(stock, "policy.train_micro_batch_size")
    length = _int_or_none(stock, "policy.max_total_sequence_length")
    return micro * length if micro and length else DEFAULT_STEP_TOKENS


def _int_or_none(stock: Mapping[str, Any], dotted: str) -> int | None:
    """A positive int the recipe says plainly at ``dotted``; None for anything else (absent, not an int, or an
    expression rlix recipe does not evaluate)."""
    try:
        value = _resolved(stock, dotted)
    except RlixConfigError:
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def rollout_in_flight(stock: Mapping[str, Any], *, data_plane: bool = False) -> tuple[int, int, str] | None:
    """(requests, tokens each at most, what they are) a step's rollout keeps in flight, or None where the recipe
    does not say plainly: one step's batch (``num_prompts_per_step`` x ``num_generations_per_prompt``), times
    ``1 + max_trajectory_age_steps`` under async GRPO (its collector generates that many steps ahead), each up to
    ``max_model_len`` tokens."""
    prompts = _int_or_none(stock, "grpo.num_prompts_per_step")
    generations = _int_or_none(stock, "grpo.num_generations_per_prompt")
    length = (_int_or_none(stock, "policy.generation.vllm_cfg.max_model_len")
              or _int_or_none(stock, "policy.max_total_sequence_length"))
    if prompts is None or generations is None or length is None:
        return None
    loop = DATA_PLANE if data_plane and grpo_loop(stock) != SINGLE_CONTROLLER else (grpo_loop(stock) or ASYNC_GRPO)
    ahead = (_int_or_none(stock, "grpo.async_grpo.max_trajectory_age_steps") or 0) if loop == ASYNC_GRPO else 0
    batches = f"{1 + ahead} steps' batches ({prompts} x {generations} each)" if ahead else \
        f"one step's batch ({prompts} x {generations})"
    return prompts * generations * (1 + ahead), length, f"{batches} of up to {length} tokens"


def engine_max_seqs(stock: Mapping[str, Any], *, data_plane: bool = False) -> int:
    """Sequences one engine runs at once: the recipe's ``vllm_kwargs.max_num_seqs``, else as many as the rollout
    keeps in flight, at most :data:`.memory_budget.ENGINE_MAX_SEQS` (the overlay writes it: vLLM's async engine,
    which time-sharing runs, defaults to 128)."""
    given = _int_or_none(stock, "policy.generation.vllm_kwargs.max_num_seqs")
    if given is not None:
        return given
    flight = rollout_in_flight(stock, data_plane=data_plane)
    return min(flight[0], ENGINE_MAX_SEQS) if flight else ENGINE_MAX_SEQS


def engine_batch_tokens(stock: Mapping[str, Any], *, data_plane: bool = False) -> int:
    """Tokens one engine step runs: the recipe's ``vllm_kwargs.max_num_batched_tokens``, else
    :data:`.memory_budget.ENGINE_BATCH_TOKENS` and never fewer than :func:`engine_max_seqs` (vLLM refuses a step
    smaller than its sequences; the overlay writes it)."""
    given = _int_or_none(stock, "policy.generation.vllm_kwargs.max_num_batched_tokens")
    return given if given is not None else max(ENGINE_BATCH_TOKENS, engine_max_seqs(stock, data_plane=data_plane))


def sized_utilization(stock: Mapping[str, Any], gpu_memory_gib: float, *, data_plane: bool = False,
                      tp: int = 1) -> tuple[float, str] | None:
    """The vLLM engines' share of a GPU sized to what a step's rollout keeps in flight (:func:`rollout_in_flight`,
    at most :func:`engine_max_seqs` at once: :func:`.memory_budget.engine_need_gib`), or None where the recipe does
    not say plainly (model shape, batch, context length) and the stock share stays. Never above the stock share:
    the stock recipe's engine on a GPU of its own is the most an engine needs here."""
    model = _resolved(stock, "policy.model_name")
    shape = model_shape(model) if isinstance(model, str) and model else None
    flight = rollout_in_flight(stock, data_plane=data_plane)
    stock_util = float(_resolved(stock, "policy.generation.vllm_cfg.gpu_memory_utilization") or 0.9)
    if shape is None or flight is None or gpu_memory_gib <= 0:
        return None
    requests, length, what = flight
    max_seqs = engine_max_seqs(stock, data_plane=data_plane)
    need = engine_need_gib(shape, requests=requests, max_model_len=length, tp=tp, max_seqs=max_seqs,
                           batched_tokens=engine_batch_tokens(stock, data_plane=data_plane))
    util = min(math.ceil(need / gpu_memory_gib * 100 - 1e-9) / 100, stock_util)
    return util, (f"sized to the rollout in flight: {what}, at most {min(requests, max_seqs)} at once, need "
                  f"{need:.1f} GiB of {gpu_memory_gib:.0f}"
                  + (f" (the stock recipe's {stock_util:g} is the most)" if util == stock_util else "")
                  + "; --gpu-memory-utilization sets it")


def check_memory(stock: Mapping[str, Any], layouts: Sequence[PipelineLayout], *, gpu_memory_gib: float | None,
                 host_memory_gib: float | None, data_plane: bool = False) -> tuple[str, dict[str, dict[str, float]] | None]:
    """Refuse layouts whose pipelines do not fit in GPU or host memory (:mod:`.memory_budget`); returns a note on
    what was checked and, when the GPU's memory is known, the scheduler's figures of each pipeline's clusters
    (``rlix.memory``, the same for every pipeline of the layout). The model's shape comes from ``policy.model_name``
    (:func:`.model_shape.model_shape`). ``data_plane``: the engines' batch of the TransferQueue loop, as the overlay
    writes it."""
    model = _resolved(stock, "policy.model_name")
    shape = model_shape(model) if isinstance(model, str) and model else None
    if shape is None:
        return f"memory not checked: the shape of {model!r} is not known here", None
    util = float(_resolved(stock, "policy.generation.vllm_cfg.gpu_memory_utilization") or 0.9)
    tp = int(_resolved(stock, "policy.generation.vllm_cfg.tensor_parallel_size") or 1)
    tokens = _step_tokens(stock)
    engine_tokens = engine_batch_tokens(stock, data_plane=data_plane)
    engine_seqs = engine_max_seqs(stock, data_plane=data_plane)
    resident = _resolved(stock, "rlix.offload_trainer") is False
    gib = gpu_memory_gib or 0.0
    by_gpu: dict[int, list[PipelineMemory]] = {}
    everyone = []
    for p in layouts:
        mem = {g: pipeline_memory(p.name, shape, gpu_memory_gib=gib, gpu_memory_utilization=util,
                                  trains_here=g in p.train_devices, train_gpus=len(p.train_devices),
                                  step_tokens=tokens, tp=tp, engine_tokens=engine_tokens, engine_seqs=engine_seqs,
                                  trainer_resident=resident)
               for g in p.infer_devices}
        everyone.append(mem[p.train_devices[0]])
        for g, m in mem.items():
            by_gpu.setdefault(g, []).append(m)
    check_fits(by_gpu, everyone, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)
    worst = max(by_gpu, key=lambda g: gpu_need_gib(by_gpu[g]))
    note = (f"memory: {len(layouts)} x {shape.num_parameters / 1e9:.2f} B-parameter pipelines need "
            + (f"{gpu_need_gib(by_gpu[worst]):.1f} of {gpu_memory_gib:.0f} GiB on GPU {worst}"
               if gpu_memory_gib else "GPU memory not checked (pass --gpu-memory-gib)")
            + f" and {sum(m.host_gib for m in everyone):.1f} GiB of host memory"
            + (f" of {host_memory_gib:.0f}" if host_memory_gib else " (not checked: pass --host-memory-gib)"))
    if not gpu_memory_gib:
        return note, None
    figures = cluster_memory(shape, gpu_memory_gib=gpu_memory_gib, gpu_memory_utilization=util,
                             train_gpus=len(layouts[0].train_devices), bucket_size_bytes=bucket_size_for(model)[0],
                             step_tokens=tokens, tp=tp, engine_tokens=engine_tokens, engine_seqs=engine_seqs,
                             trainer_resident=resident)
    return f"{note}; {_coresidence_note(layouts, figures, gpu_memory_gib, util)}", figures


def _tenants(layouts: Sequence[PipelineLayout], figures: Mapping[str, Mapping[str, float]]) -> list[Any]:
    """Every pipeline's cluster specs with the figures, as the scheduler registers them."""
    from rlix_plugins.control.registration import parse_cluster_memory, pipeline_clusters

    return [replace(s, memory=parse_cluster_memory(s.name, figures[s.name]))
            for p in layouts for s in pipeline_clusters(p.name, p.train_devices, p.infer_devices).values()]


@dataclass(frozen=True)
class _Places:
    """What the scheduler's own rule (``control.scheduling.coresidence``) lets run together on one training GPU."""

    need: float  #: GiB of the fullest rollout-next-to-a-step pairing
    cap: float  #: GiB the pipelines may plan for there
    engines: int  #: rollout clusters mapped there
    rollouts: int  #: rollouts of different pipelines awake at once
    beside_step: int  #: of other pipelines' rollouts, awake next to one training step
    steps: int  #: training steps of different pipelines side by side
    beside_two: int  #: rollouts of any pipeline next to two steps (next to the step where one pipeline trains here)
    trainers: int = 2  #: pipelines that train here

    @property
    def coresident(self) -> bool:
        return self.need <= self.cap

    @property
    def together(self) -> tuple[int, int, int, int] | None:
        """What runs together there (None: no rollout next to a training step)."""
        return (self.rollouts, self.beside_step, self.steps, self.beside_two) if self.coresident else None


def _places(layouts: Sequence[PipelineLayout], figures: Mapping[str, Mapping[str, float]]) -> dict[int, _Places]:
    """Per GPU that holds both a training step and a rollout: what fits on it together."""
    from rlix_plugins.control.scheduling.coresidence import gpu_load

    specs = _tenants(layouts, figures)
    out: dict[int, _Places] = {}
    for g in sorted({g for p in layouts for g in p.train_devices}):
        tenants = [s for s in specs if g in s.device_mapping]
        engines = [s for s in tenants if s.is_generation]
        trainers = [s for s in tenants if not s.is_generation]
        loads = [load for host in trainers for guest in engines
                 if (load := gpu_load(tenants, (host.cluster_id, guest.cluster_id))) is not None]
        if not loads:
            continue

        def most(awake: list[str], guests: list[Any], tenants: list[Any] = tenants) -> int:
            k = 0
            while k < len(guests) and (load := gpu_load(tenants, [*awake, *(s.cluster_id for s in guests[:k + 1])])) \
                    is not None and load[0] <= load[1]:
                k += 1
            return k

        need, cap = max(loads)
        beside = most([trainers[0].cluster_id], [s for s in engines if s.pipeline_id != trainers[0].pipeline_id])
        # any pipeline's rollout: the two steps' own ranks stay awake beside them where they fit, too
        out[g] = _Places(need, cap, len(engines), most([], engines), beside, most([], trainers),
                         most([t.cluster_id for t in trainers[:2]], engines), len(trainers))
    return out


def _coresidence_note(layouts: Sequence[PipelineLayout], figures: Mapping[str, Mapping[str, float]],
                      gpu_memory_gib: float, util: float) -> str:
    """Whether a rollout fits next to a training step (another pipeline's, or its own pipeline's where one
    pipeline trains and rolls out on a GPU) on the fullest GPU, by the scheduler's own rule, how many of each fit
    together there, and the utilisation that would make a rollout fit next to a step when it does not."""
    places = _places(layouts, figures)
    if not places:
        return "co-residence: no GPU holds both a training step and a rollout"
    g = max(places, key=lambda k: places[k].need)
    at = places[g]
    engine, train = figures["actor_infer"]["awake_gib"], figures["actor_train"]["awake_gib"]
    if at.coresident:
        counts = "" if at.engines < 2 else (
            f"; up to {at.rollouts} rollouts of different pipelines awake on GPU {g} at once, {at.beside_step} next "
            "to a training step" + (f"; up to {at.steps} training steps of different pipelines side by side "
                                     f"({at.beside_two} rollout{'s' * (at.beside_two != 1)} next to two)"
                                     if at.steps > 1 else ""))
        return (f"co-residence on: a rollout ({engine:.1f} GiB) keeps generating next to a training step "
                f"({train:.1f} GiB), its own pipeline's or another's, where both fit ({at.need:.1f} of {at.cap:.1f} "
                f"GiB on GPU {g})" + counts)
    fit = math.floor((util - (at.need - at.cap) / gpu_memory_gib) * 20) / 20
    return (f"co-residence off: a rollout ({engine:.1f} GiB) next to a training step ({train:.1f} GiB) needs "
            f"{at.need:.1f} of {at.cap:.1f} GiB on GPU {g}; turns on a GPU are exclusive (a rollout sleeps while a "
            "step runs there)"
            + (f" (--gpu-memory-utilization {fit:g} would let them run together)" if fit >= 0.1 else ""))


def _keep_trainers(stock: Mapping[str, Any], layouts: Sequence[PipelineLayout], *, gpu_memory_gib: float | None,
                   host_memory_gib: float | None, data_plane: bool) -> tuple[bool, str]:
    """Whether the trainers keep their states on the GPU between steps, and why (empty: nothing to say, where the
    memory note already says the figures are not checked). They do where the memory figures fit them there and the
    scheduler can still run as many rollouts and steps together on every GPU as with the states offloaded: a kept
    trainer saves each training grant its offload and onload (11-17 s and ~3 s at the Qwen2.5-1.5B shape on an
    H200), while a rollout or step that no longer fits beside another costs whole phases of overlap. Only async
    GRPO's DTensor trainer is kept by default: the path the patched-loop tests and the GPU runs took."""
    how = "(--no-trainer-offload keeps them anyway)"
    if not gpu_memory_gib or not layouts:
        return False, ""
    if data_plane or grpo_loop(stock) == SINGLE_CONTROLLER or _resolved(stock, "policy.megatron_cfg.enabled"):
        return False, ("trainers offload their states to host memory between steps: keeping them on the GPU is "
                       f"the default for async GRPO's DTensor trainer only {how}")
    _, offloaded = check_memory(stock, layouts, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)
    if offloaded is None:
        return False, ""
    kept_stock = _merge(dict(stock), {"rlix": {"offload_trainer": False}})
    try:
        _, kept = check_memory(kept_stock, layouts, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib)
    except RlixConfigError as exc:
        return False, f"trainers offload their states to host memory between steps: kept on the GPU, {exc} {how}"
    assert kept is not None
    before, after = _places(layouts, offloaded), _places(layouts, kept)
    lost = [_shift(g, before, after) for g in before
            if _together(after.get(g)) != before[g].together]
    if lost:
        return False, ("trainers offload their states to host memory between steps: kept on the GPU "
                       f"({kept['actor_train']['asleep_gib']:.1f} GiB each between steps instead of "
                       f"{offloaded['actor_train']['asleep_gib']:.1f}), fewer phases would fit together ("
                       + "; ".join(lost) + f") {how}")
    return True, (f"kept on the GPU: the memory figures fit the trainers' states there "
                  f"({kept['actor_train']['asleep_gib']:.1f} GiB each between steps) beside as many rollouts and "
                  "steps as offloaded ones (--trainer-offload offloads them)")


def _together(p: _Places | None) -> tuple[int, int, int, int] | None:
    return None if p is None else p.together


def _more(a: tuple[int, int, int, int] | None, b: tuple[int, int, int, int] | None) -> bool:
    """Whether ``a`` lets more run together than ``b`` (as much of everything, more of something)."""
    return a is not None and (b is None or (a != b and all(x >= y for x, y in zip(a, b, strict=True))))


def _with_seqs(stock: Mapping[str, Any], seqs: int) -> dict[str, Any]:
    return _merge(dict(stock), {"policy": {"generation": {"vllm_kwargs": {"max_num_seqs": seqs}}}})


def _with_util(stock: Mapping[str, Any], util: float) -> dict[str, Any]:
    return _merge(dict(stock), {"policy": {"generation": {"vllm_cfg": {"gpu_memory_utilization": util}}}})


def _engine_seqs(stock: Mapping[str, Any], layouts: Sequence[PipelineLayout], *,
                 gpu_memory_gib: float | None, host_memory_gib: float | None, data_plane: bool,
                 gpu_memory_utilization: float | None, trainer_offload: bool | None,
                 tp: int) -> tuple[int, str] | None:
    """(``max_num_seqs``, why) where engines that run fewer sequences at once than the rollout keeps in flight (async
    GRPO's look-ahead step too) let more phases run together on some GPU and fewer on none; None to keep
    :func:`engine_max_seqs`. Halves down to :data:`.memory_budget.ENGINE_MIN_SEQS` and keeps the largest that
    gains: the requests beyond it wait in the engine's queue. Measured on an H200 at the 1.5B shape: a pair whose
    rollouts could not run beside both training steps spent 30-45 s of each step waiting for its batch (0.4 s
    alone); engines of one step's batch (512) let one rollout run beside both steps (92 steps/h against 79) and
    decode the two-step rollout 1.41x faster than engines of 1,024. Judged with the trainers as the flag or the
    recipe says, else offloaded (:func:`_keep_trainers` decides that afterwards)."""
    flight = rollout_in_flight(stock, data_plane=data_plane)
    if (not gpu_memory_gib or flight is None or len(layouts) < 2
            or _int_or_none(stock, "policy.generation.vllm_kwargs.max_num_seqs") is not None):
        return None
    batch = (_int_or_none(stock, "grpo.num_prompts_per_step") or 0) * (
        _int_or_none(stock, "grpo.num_generations_per_prompt") or 0)
    full = engine_max_seqs(stock, data_plane=data_plane)
    offload = True if trainer_offload is None else trainer_offload

    def places(seqs: int) -> dict[int, _Places] | None:
        at = _merge(_with_seqs(stock, seqs), {"rlix": {"offload_trainer": offload}})
        sized = sized_utilization(at, gpu_memory_gib, data_plane=data_plane, tp=tp)
        util = gpu_memory_utilization if gpu_memory_utilization is not None else sized[0] if sized else None
        if util is not None:
            at = _with_util(at, util)
        try:
            _, figures = check_memory(at, layouts, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                                      data_plane=data_plane)
        except RlixConfigError:
            return None  # does not fit at all
        return _places(layouts, figures) if figures is not None else None

    def what(seqs: int) -> str:
        share = ("one step's batch" if seqs == batch else "half of one step's batch" if 2 * seqs == batch
                 else f"{seqs} of one step's {batch}")
        return f"{share} at once ({seqs} sequences), not all {full} the rollout keeps in flight"

    before = best = places(full)
    chosen = full
    seqs = full // 2
    while seqs >= ENGINE_MIN_SEQS:
        after = places(seqs)
        if after is not None and (best is None or (
                any(_more(_together(after[g]), _together(best.get(g))) for g in after)
                and not any(_more(_together(best[g]), _together(after.get(g))) for g in best))):
            chosen, best = seqs, after
            if before is None:  # the first that fits at all
                break
        seqs //= 2
    if chosen == full or best is None:
        return None
    if before is None:
        return chosen, (f"{what(chosen)}: the pipelines fit only so (the other requests wait in the engine's "
                        "queue)")
    gained = [g for g in best if _more(_together(best[g]), _together(before.get(g)))]
    return chosen, (f"{what(chosen)}: the smaller engine lets more run together ("
                    + "; ".join(_shift(g, before, best) for g in gained)
                    + "); the other requests wait in the engine's queue")


def _shift(g: int, before: Mapping[int, _Places], after: Mapping[int, _Places]) -> str:
    """What runs together on GPU ``g`` before -> after (for the notes)."""
    return f"GPU {g}: {_fits(before.get(g))} -> {_fits(after.get(g))}"


def _fits(p: _Places | None) -> str:
    together = _together(p)
    if together is None:
        return "no rollout next to a training step"
    rollouts, beside, steps, beside_two = together
    assert p is not None
    return (f"rollouts at once {rollouts}, next to a step {beside}, steps side by side {steps}, "
            + (f"rollouts next to two steps {beside_two}" if p.trainers > 1
               else f"rollouts of any pipeline next to its step {beside_two}"))


def make_overlays(stock: Mapping[str, Any], num_pipelines: int, gpus: Sequence[int],
                  gpus_per_node: int | None = None, data_plane: bool = False, *,
                  gpu_memory_gib: float | None = None, host_memory_gib: float | None = None,
                  gpu_memory_utilization: float | None = None, nodes: int = 1, tp: int | None = None,
                  trainer_offload: bool | None = None) -> list[Overlay]:
    """The overlay of each pipeline, validated by the start-up checks and the memory budget; ``RlixConfigError``
    lists every refusal. ``data_plane``: switch the stock recipe to NeMo RL's TransferQueue loop
    (``grpo_train_sync``). ``gpu_memory_gib`` / ``host_memory_gib``: the memory of the GPUs and the host the
    pipelines will run on (None: not checked; with the GPU's, the overlays carry the scheduler's memory figures).
    ``gpu_memory_utilization``: the vLLM engines' share of a GPU (None: sized to the rollout in flight where the
    GPU's memory and the recipe's batch are known, :func:`sized_utilization`, for engines of one step's batch where
    that lets more run together, :func:`_engine_seqs`; else the stock recipe's).
    ``nodes``: machines the GPUs span (``gpus`` are global ids; more than one needs ``gpus_per_node``). ``tp``:
    vLLM's tensor parallel size (None: the stock recipe's). ``trainer_offload`` False: the trainers keep their
    states on the GPU between steps (``rlix.offload_trainer``), and the memory figures count them there; True:
    they offload them to host memory after every step; None: kept on the GPU where the figures fit them there at
    no cost to what runs together (:func:`_keep_trainers`), else offloaded."""
    gpus = list(gpus)
    stock_says = _resolved(stock, "rlix.offload_trainer")
    if trainer_offload is None and isinstance(stock_says, bool):
        trainer_offload = stock_says  # the recipe's own choice stands
    if tp is not None:
        if tp < 1:
            raise RlixConfigError(f"--tp {tp}: give a tensor parallel size >= 1")
        stock = _merge(dict(stock), {"policy": {"generation": {"vllm_cfg": {"tensor_parallel_size": tp}}}})
    vllm_tp = int(_resolved(stock, "policy.generation.vllm_cfg.tensor_parallel_size") or 1)
    util_reason = "--gpu-memory-utilization: the vLLM engine's share of the GPU"
    if gpu_memory_utilization is not None and not 0 < gpu_memory_utilization <= 1:
        raise RlixConfigError(f"--gpu-memory-utilization {gpu_memory_utilization}: give a share in (0, 1]")
    if nodes < 1:
        raise RlixConfigError(f"--nodes {nodes}: need at least 1")
    if nodes > 1 and not gpus_per_node:
        raise RlixConfigError(f"--nodes {nodes}: pass --gpus-per-node (every node must have the same GPU count; GPU "
                              "ids are node rank x GPUs per node + local id)")
    per_node = gpus_per_node or (max(gpus) + 1 if gpus else 1)
    problems = _refusals(stock, gpus, per_node, nodes)
    if problems:
        raise RlixConfigError("cannot time-share this recipe:\n  - " + "\n  - ".join(problems))
    trainer_size, how = training_parallel_size(stock)
    try:
        layouts = layout(num_pipelines, gpus, trainer_size, vllm_tp)
    except RlixConfigError as exc:
        raise RlixConfigError(f"cannot time-share this recipe ({how}): {exc}") from None
    seqs = _engine_seqs(stock, layouts, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                        data_plane=data_plane, gpu_memory_utilization=gpu_memory_utilization,
                        trainer_offload=trainer_offload, tp=vllm_tp)
    if seqs is not None:  # read back by the sizing and the figures below, written by the overlay
        stock = _with_seqs(stock, seqs[0])
    if gpu_memory_utilization is None and gpu_memory_gib:
        sized = sized_utilization(stock, gpu_memory_gib, data_plane=data_plane, tp=vllm_tp)
        stock_util = _resolved(stock, "policy.generation.vllm_cfg.gpu_memory_utilization")
        if sized is not None and sized[0] != stock_util:  # an overlay writes only what it changes
            gpu_memory_utilization, util_reason = sized
    if gpu_memory_utilization is not None:
        stock = _with_util(stock, gpu_memory_utilization)
    chosen = ""  # why rlix chose, when no flag or recipe key did
    if trainer_offload is None:
        keep, chosen = _keep_trainers(stock, layouts, gpu_memory_gib=gpu_memory_gib,
                                      host_memory_gib=host_memory_gib, data_plane=data_plane)
        trainer_offload = not keep
    # read back by check_memory (the figures) and written by the overlay where it differs from the recipe's
    stock = _merge(dict(stock), {"rlix": {"offload_trainer": trainer_offload}})
    memory, figures = check_memory(stock, layouts, gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                                   data_plane=data_plane)
    overlays = [_overlay(stock, p, num_pipelines, per_node, data_plane, nodes) for p in layouts]
    for ov in overlays:
        ov.memory = memory
        if gpu_memory_utilization is not None:
            ov.changes["policy.generation.vllm_cfg.gpu_memory_utilization"] = (gpu_memory_utilization, util_reason)
        if trainer_offload != (stock_says if isinstance(stock_says, bool) else True):
            why = chosen or ("--trainer-offload" if trainer_offload else "--no-trainer-offload")
            ov.changes["rlix.offload_trainer"] = (trainer_offload, f"{why}: " + (
                "weights and optimizer states go to host memory after every step and come back before the next"
                if trainer_offload else "weights and optimizer states stay on the GPU between steps (no offload and "
                "onload in each training grant; they hold GPU memory while the pipeline rolls out)"))
        elif trainer_offload and chosen:
            ov.notes.append(chosen)
        if seqs is not None:
            ov.changes["policy.generation.vllm_kwargs.max_num_seqs"] = seqs
        if tp is not None:
            ov.changes["policy.generation.vllm_cfg.tensor_parallel_size"] = (
                tp, "--tp: each rollout rank is one vLLM engine over that many GPUs (one placement group)")
        if figures is not None:
            ov.changes["rlix.memory"] = (figures, f"GiB per GPU of {gpu_memory_gib:.0f} (--gpu-memory-gib): the "
                                         "scheduler runs a rollout next to another pipeline's training step where "
                                         "both fit")
    for ov in overlays:
        merged = _merge(dict(stock), ov.nested())
        found = topology_problems(merged, load_run_config(merged))
        if found:  # a rule this module does not know yet: refuse rather than write an overlay that fails at start
            raise RlixConfigError(f"pipeline {ov.pipeline.name}: the overlay does not pass the topology check:\n  - "
                                  + "\n  - ".join(found))
    return overlays


#: The entry point NeMo RL runs each loop with (examples/).
ENTRY_POINTS: Final = {ASYNC_GRPO: "examples/run_grpo.py", DATA_PLANE: "examples/run_grpo.py",
                       SINGLE_CONTROLLER: "examples/run_grpo_single_controller.py"}


def _overlay(stock: Mapping[str, Any], p: PipelineLayout, num_pipelines: int, gpus_per_node: int,
             data_plane: bool, nodes: int = 1) -> Overlay:
    ov = Overlay(p)
    loop = grpo_loop(stock)
    kept = "kept"
    if data_plane and loop != SINGLE_CONTROLLER:
        loop, kept = DATA_PLANE, "switched to it (--data-plane)"
        _set(ov, stock, "data_plane.enabled", True, "NeMo RL's TransferQueue loop grpo_train_sync (--data-plane)")
        _set(ov, stock, "grpo.async_grpo.enabled", False, "run_grpo.py would pick async GRPO first")
    colocated = _resolved(stock, "policy.generation.colocated.enabled") is not False
    if loop in (DATA_PLANE, SINGLE_CONTROLLER):  # the second patch part drives them as they are (loops/)
        ov.notes.append(f"NeMo RL's {loop} loop: {kept} (run it with {ENTRY_POINTS[loop]})"
                        + ("; vLLM switched to non-colocated (the scheduler shares the GPUs instead)" if colocated
                           else ""))
        if loop == SINGLE_CONTROLLER and p.train_devices == p.infer_devices:
            _set(ov, stock, "async_rl.min_groups_for_streaming_train", "${grpo.num_prompts_per_step}",
                 "one rollout rank: one chunk per step (its rollout may sleep while it trains)")
    elif not _resolved(stock, "grpo.async_grpo.enabled") or colocated:
        sync = not _resolved(stock, "grpo.async_grpo.enabled")
        ov.notes.append(
            f"the stock recipe runs {'synchronous' if sync else 'async'} GRPO with {'colocated' if colocated else 'non-colocated'} "
            "inference; time-sharing needs async GRPO with non-colocated vLLM (the scheduler shares the GPUs "
            "instead): switched, with importance-sampling correction for the trajectories from older weights")
    one_rank = p.train_devices == p.infer_devices
    gpus_word = "one GPU" if len(p.infer_devices) == 1 else f"the {len(p.infer_devices)} GPUs of one rollout rank"
    if one_rank:
        ov.notes.append(f"{gpus_word}: this pipeline trains and rolls out there; its rollout keeps generating beside "
                        "a training step (its own included) where the memory figures fit (the co-residence note), "
                        "and sleeps while one runs that it does not fit beside (see topology.is_one_rank_topology)")
    if loop not in (DATA_PLANE, SINGLE_CONTROLLER):
        _set(ov, stock, "grpo.async_grpo.enabled", True, "time-sharing drives async_grpo_train")
        _set(ov, stock, "loss_fn.use_importance_sampling_correction", True,
             "trajectories from older weights are corrected (NeMo RL requires it with async GRPO)")
    _set(ov, stock, "policy.generation.colocated.enabled", False,
         "non-colocated vLLM; the scheduler shares GPUs instead")
    infer_nodes = len({g // gpus_per_node for g in p.infer_devices})
    if infer_nodes == 1:
        _set(ov, stock, "policy.generation.colocated.resources.gpus_per_node", len(p.infer_devices),
             "the rlix.infer_devices GPUs (one vLLM DP rank per TP-size GPUs)")
        _set(ov, stock, "policy.generation.colocated.resources.num_nodes", 1, "one node")
    else:
        _set(ov, stock, "policy.generation.colocated.resources.gpus_per_node", gpus_per_node,
             "vLLM ranks on whole nodes (rlix.infer_devices places each one)")
        _set(ov, stock, "policy.generation.colocated.resources.num_nodes", infer_nodes,
             "the nodes rlix.infer_devices spans")
    _set(ov, stock, "policy.generation.vllm_cfg.async_engine", True, "per-request routing over the active DP ranks")
    _set(ov, stock, "policy.generation.vllm_cfg.sleep_level", _SLEEP_LEVEL, "patch 0003; must equal rlix.sleep_level")
    # vLLM's front-end decodes every sampled token and, for the logprob NeMo RL asks, that token again with
    # checks, per request and step: at 1,024 sequences it held a 1.5B engine to 0.58x the decode rate of one
    # that decodes nothing. NeMo RL's rollouts read token ids and logprobs only.
    if _resolved(stock, "policy.generation.vllm_cfg.detokenize") is None:  # the recipe's own choice stands
        _set(ov, stock, "policy.generation.vllm_cfg.detokenize", False,
             "patch 0003: token ids and logprobs only where no stop string needs the text (1.7x the decode rate)")
    _set(ov, stock, "policy.generation.vllm_kwargs.worker_cls", _WORKER_CLS,
         "the weight receiver (rlix_plugins.vllm.nemo_rl_vllm_kwargs())")
    # vLLM's async engine defaults to 128 sequences and 2,048 tokens a step (its engine context), where the
    # synchronous engine of a stock recipe runs 1,024 and 16,384 on H100/H200-class GPUs: a 512-request batch would
    # decode in four waves. Its steps stay at a quarter of 16,384: a decode step needs at most max_num_seqs, one
    # engine decoded as fast at either, and the profile batch's activations in its share are a quarter.
    _set(ov, stock, "policy.generation.vllm_kwargs.max_num_seqs", engine_max_seqs(stock, data_plane=data_plane),
         "the rollout in flight, at most 1,024 (the async engine's default is 128)")
    if _int_or_none(stock, "policy.generation.vllm_kwargs.max_num_batched_tokens") is None:
        _set(ov, stock, "policy.generation.vllm_kwargs.max_num_batched_tokens",
             engine_batch_tokens(stock, data_plane=data_plane),
             "every decode step whole, as fast as 16,384 (the async engine's default is 2,048, the synchronous "
             "one's 16,384)")
    _set(ov, stock, "cluster.gpus_per_node", gpus_per_node,
         "GPUs of the node the pipelines share" if nodes == 1 else "GPUs of each node the pipelines share")
    _set(ov, stock, "cluster.num_nodes", nodes, "nodes the pipelines share (--nodes)")
    if num_pipelines > 1:
        for key in ("checkpointing.checkpoint_dir", "logger.log_dir"):
            base = _resolved(stock, key)
            if isinstance(base, str):
                _set(ov, stock, key, f"{base.rstrip('/')}/rlix_{p.name}",
                     "pipelines made from one recipe must not write the same directory")
    where = f"{gpus_word} (one-rank topology)" if one_rank else f"its home slice of {len(p.train_devices)} GPU(s)"
    _set(ov, stock, "rlix.train_devices", list(p.train_devices), f"trains on {where}")
    _set(ov, stock, "rlix.infer_devices", list(p.infer_devices), "rolls out on every shared GPU")
    _set(ov, stock, "rlix.bucket_size_bytes", *bucket_size_for(_resolved(stock, "policy.model_name")))
    _set(ov, stock, "rlix.sleep_level", _SLEEP_LEVEL, "2 frees weights and KV cache while slept")
    return ov


# ---------------------------------------------------------------- output
def _scalar(value: Any) -> str:
    import yaml

    return str(yaml.safe_dump([value], default_flow_style=True, width=1 << 16).strip())[1:-1]


def render(overlay: Overlay, defaults: str, stock_name: str, num_pipelines: int) -> str:
    """The overlay file: a header, ``defaults:``, then each changed key with its reason as a comment."""
    p = overlay.pipeline
    lines = [
        f"# rlix-plugins time-sharing overlay: pipeline {p.name} of {num_pipelines} (trains on GPUs "
        f"{list(p.train_devices)}, rolls out on GPUs {list(p.infer_devices)})",
        f"# Stock NeMo RL recipe {stock_name} + only the keys time-sharing changes. Written by `rlix recipe`;",
        "# run with RLIX_CONTROL_PLANE=rlix (see README \"NeMo RL\").",
        *[f"# Note: {n}" for n in overlay.notes],
        f"defaults: {_scalar(defaults)}",
    ]
    reasons = {k: r for k, (_, r) in overlay.changes.items()}

    def emit(node: Mapping[str, Any], prefix: str, indent: int) -> None:
        for key, value in node.items():
            dotted = f"{prefix}{key}"
            pad = "  " * indent
            if isinstance(value, dict) and dotted not in reasons:  # a section, not a key whose value is a dict
                lines.append(f"{pad}{key}:")
                emit(value, dotted + ".", indent + 1)
            else:
                lines.append(f"{pad}{key}: {_scalar(value)}  # {reasons[dotted]}")

    for key, value in overlay.nested().items():
        lines.append("")
        emit({key: value}, "", 0)
    return "\n".join(lines) + "\n"


def write_overlays(stock_path: str | os.PathLike[str], out_dir: str | os.PathLike[str], num_pipelines: int,
                   gpus: Sequence[int], gpus_per_node: int | None = None,
                   data_plane: bool = False, *, gpu_memory_gib: float | None = None,
                   host_memory_gib: float | None = None,
                   gpu_memory_utilization: float | None = None, nodes: int = 1,
                   tp: int | None = None, trainer_offload: bool | None = None) -> list[tuple[Path, Overlay]]:
    """Validate, then write ``<out>/<stock stem>_rlix_<name>.yaml`` per pipeline (``defaults:`` relative to out)."""
    stock_path, out = Path(stock_path).resolve(), Path(out_dir)
    overlays = make_overlays(load_stock(stock_path), num_pipelines, gpus, gpus_per_node, data_plane,
                             gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                             gpu_memory_utilization=gpu_memory_utilization, nodes=nodes, tp=tp,
                             trainer_offload=trainer_offload)
    out.mkdir(parents=True, exist_ok=True)
    defaults = os.path.relpath(stock_path, out.resolve())
    written = []
    for ov in overlays:
        path = out / f"{stock_path.stem}_rlix_{ov.pipeline.name}.yaml"
        path.write_text(render(ov, defaults, stock_path.name, num_pipelines))
        written.append((path, ov))
    return written


def run_cli(stock: str, out: str, num_pipelines: int, gpus: Sequence[int], gpus_per_node: int | None,
            data_plane: bool = False, gpu_memory_gib: float | None = None,
            host_memory_gib: float | None = None, gpu_memory_utilization: float | None = None,
            nodes: int = 1, tp: int | None = None, *, trainer_offload: bool | None = None) -> int:
    """``rlix recipe``. Memory figures not given default to this machine's when it has a GPU (it is then taken to be
    where the pipelines run); on a machine without one, only what is given is checked."""
    from rlix_plugins.nemo_rl.memory_budget import local_gpu_memory_gib, local_host_memory_gib

    local_gpu = local_gpu_memory_gib() if gpu_memory_gib is None or host_memory_gib is None else None
    if local_gpu is not None:
        gpu_memory_gib = gpu_memory_gib if gpu_memory_gib is not None else local_gpu
        host_memory_gib = host_memory_gib if host_memory_gib is not None else local_host_memory_gib()
    written = write_overlays(stock, out, num_pipelines, gpus, gpus_per_node, data_plane,
                             gpu_memory_gib=gpu_memory_gib, host_memory_gib=host_memory_gib,
                             gpu_memory_utilization=gpu_memory_utilization, nodes=nodes, tp=tp,
                             trainer_offload=trainer_offload)
    for path, ov in written:
        print(f"{path}: pipeline {ov.pipeline.name}, train {list(ov.pipeline.train_devices)}, "
              f"infer {list(ov.pipeline.infer_devices)}")
        for note in [*ov.notes, ov.memory]:
            if note:
                print(f"  note: {note}")
        for key, (value, reason) in ov.changes.items():
            print(f"  {key} = {_scalar(value)}  # {reason}")
    entry = ENTRY_POINTS[grpo_loop(_merge(load_stock(stock), written[0][1].nested())) or ASYNC_GRPO]
    print(f"run each with: RLIX_CONTROL_PLANE=rlix python {entry} --config <overlay> (one per pipeline, "
          "after `rlix up`)")
    return 0
