"""The ``rlix`` command. It parses arguments and calls one library function per subcommand; no logic lives here.

Every subcommand has ``--help``. Errors of rlix-plugins (``RlixError``) and bad arguments exit non-zero with
a one-line reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from rlix_plugins.errors import RlixError


def _cmd_up(args: argparse.Namespace) -> int:
    from rlix_plugins.control.admin.commands import up

    return up(address=args.address, num_gpus=args.num_gpus, num_cpus=args.num_cpus,
              insecure_no_auth=args.insecure_no_auth, node_ip=args.node_ip_address)


def _cmd_down(args: argparse.Namespace) -> int:
    from rlix_plugins.control.admin.commands import down

    return down(address=args.address, stop_ray=args.stop_ray)


def _cmd_status(args: argparse.Namespace) -> int:
    from rlix_plugins.control.admin.commands import status

    return status(address=args.address, as_json=args.json)


def _cmd_timeline(args: argparse.Namespace) -> int:
    from rlix_plugins.control.admin.commands import timeline

    return timeline(address=args.address, out=args.out, trace=args.trace, names=args.name)


def _cmd_simulate(args: argparse.Namespace) -> int:
    from rlix_plugins.control.capacity.comparison import run_cli
    from rlix_plugins.out_dir import make_out_dir

    make_out_dir(args.out)
    return run_cli(args)


def _cmd_demo(args: argparse.Namespace) -> int:
    from rlix_plugins.demo.run import run_cli

    return run_cli(args.pipelines, args.gpus, args.steps, args.out, args.address, args.sleep_level, args.force,
                   args.nodes, args.tp)


def _cmd_recipe(args: argparse.Namespace) -> int:
    from rlix_plugins.nemo_rl.recipe import run_cli

    return run_cli(args.stock, args.out, args.pipelines, args.gpus, args.gpus_per_node, args.data_plane,
                   args.gpu_memory_gib, args.host_memory_gib, args.gpu_memory_utilization, args.nodes, args.tp,
                   trainer_offload=args.trainer_offload)


def _gpu_ids(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected GPU ids like 0 or 0,1, got {text!r}") from None


def _cmd_patch(args: argparse.Namespace) -> int:
    from rlix_plugins.patching import run_cli

    return run_cli(action=args.action, nemo_rl=args.nemo_rl)


def _add_address(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        default=None,
        help="Ray cluster address (default: RAY_ADDRESS, else the local cluster started by `rlix up`)",
    )


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlix", description="GPU time-sharing for NeMo RL async GRPO.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True

    def add(name: str, fn: Callable[[argparse.Namespace], int], help_: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(_handler=fn, _parser=p)
        return p

    p = add("up", _cmd_up, "Start (or join) a Ray cluster and the rlix control plane on it.")
    _add_address(p)
    p.add_argument("--num-gpus", type=_positive_int, default=None, help="GPUs to declare when starting a local Ray cluster")
    p.add_argument("--num-cpus", type=_positive_int, default=None, help="CPUs to declare when starting a local Ray cluster")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="start the local Ray cluster WITHOUT token authentication: anyone who can reach its ports "
                        "can run code on it (default: Ray's token authentication, see README Security)")
    p.add_argument("--node-ip-address", default=None,
                   help="IP to start the local Ray head on and record: the address other nodes join with "
                        "`ray start --address IP:PORT` (default: the one Ray picks for this machine)")

    p = add("down", _cmd_down, "Stop the rlix control plane (and, with --stop-ray, the local Ray cluster).")
    _add_address(p)
    p.add_argument("--stop-ray", action="store_true", help="also stop the local Ray cluster `rlix up` started")

    p = add("status", _cmd_status, "Show pipelines, allocations, pending requests and idle GPUs.")
    _add_address(p)
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")

    p = add("timeline", _cmd_timeline, "Render the scheduler trace as a Gantt chart (one row per GPU).")
    _add_address(p)
    p.add_argument("--out", required=True, help="output picture, e.g. timeline.png")
    p.add_argument("--trace", default=None,
                   help="draw a saved trace (JSON lines, .gz allowed) instead of the live control plane's")
    p.add_argument("--name", action="append", default=[], metavar="PIPELINE_ID=NAME",
                   help="the legend's name for a pipeline (repeatable), e.g. --name ft_a19aa0f04941=a")

    p = add("simulate", _cmd_simulate, "Simulate N pipelines time-sharing G GPUs with the real planner.")
    from rlix_plugins.control.capacity.comparison import add_arguments as add_sim_arguments

    add_sim_arguments(p)

    p = add("demo", _cmd_demo, "Run N built-in tiny GRPO pipelines time-sharing G GPUs (real Ray, vLLM, control plane).")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join (default: RAY_ADDRESS, else start a local one for the demo)")
    p.add_argument("--pipelines", type=_positive_int, default=2, help="pipelines to run (default 2)")
    p.add_argument("--gpus", type=_positive_int, default=2, help="GPUs they share (declared to Ray on CPU; default 2)")
    p.add_argument("--nodes", type=_positive_int, default=1,
                   help="Ray nodes the GPUs span, --gpus / --nodes each (default 1); without --address, that many "
                        "raylets start on this machine (node k at 127.0.0.k+1)")
    p.add_argument("--tp", type=_positive_int, default=1,
                   help="vLLM tensor parallel size: each rollout rank is one engine over TP GPUs of one node (default 1)")
    p.add_argument("--steps", type=_positive_int, default=3, help="training steps per pipeline (default 3)")
    p.add_argument("--out", default="out/demo", help="directory for timeline.png and summary.json (default out/demo)")
    p.add_argument("--force", action="store_true", help="overwrite the results of an earlier run in --out")
    p.add_argument("--sleep-level", type=int, choices=[1, 2], default=2, help="vLLM sleep level of shrunk ranks")

    p = add("recipe", _cmd_recipe, "Write the time-sharing overlays (one per pipeline) of a stock NeMo RL GRPO recipe.")
    p.add_argument("stock", metavar="STOCK.yaml", help="the stock NeMo RL recipe (its defaults: chain is resolved)")
    p.add_argument("--pipelines", type=_positive_int, default=2, help="pipelines sharing the GPUs (default 2)")
    p.add_argument("--gpus", type=_gpu_ids, required=True, help="GPU ids they share, e.g. 0 or 0,1")
    p.add_argument("--gpus-per-node", type=_positive_int, default=None,
                   help="GPUs of each node (default on one node: max id + 1; needed with --nodes > 1)")
    p.add_argument("--nodes", type=_positive_int, default=1,
                   help="nodes the GPUs span (default 1); --gpus are then global ids: node rank x GPUs per node + local id")
    p.add_argument("--out", required=True, help="directory for the overlays")
    p.add_argument("--data-plane", action="store_true",
                   help="run NeMo RL's TransferQueue loop (data_plane.enabled) instead of async GRPO")
    p.add_argument("--gpu-memory-gib", type=_positive_float, default=None,
                   help="memory of one GPU the pipelines run on (default: this machine's, unchecked without a GPU)")
    p.add_argument("--host-memory-gib", type=_positive_float, default=None,
                   help="memory of the host they run on (default: this machine's)")
    p.add_argument("--gpu-memory-utilization", type=_positive_float, default=None,
                   help="the vLLM engines' share of a GPU (default: sized to what a step's rollout keeps in flight, "
                        "where the GPU's memory and the recipe's batch are known; else the stock recipe's); lower "
                        "lets more phases run side by side on a GPU")
    p.add_argument("--tp", type=_positive_int, default=None,
                   help="vLLM tensor parallel size of each rollout rank (default: the stock recipe's); a rank is that "
                        "many consecutive --gpus of one node")
    offload = p.add_mutually_exclusive_group()
    offload.add_argument("--no-trainer-offload", dest="trainer_offload", action="store_false", default=None,
                         help="keep each trainer's weights and optimizer states on its GPU between steps (no offload "
                              "to host memory after every step; the memory figures count them while it rolls out). "
                              "Default: kept where the figures fit them beside as many rollouts and steps as "
                              "offloaded ones")
    offload.add_argument("--trainer-offload", dest="trainer_offload", action="store_true", default=None,
                         help="move each trainer's weights and optimizer states to host memory after every step")

    p = add("patch", _cmd_patch, "Apply, check or revert the pinned NeMo RL patch series; drift: what of it no "
            "longer fits a checkout (hunks that need fuzz or conflict, changed NeMo RL signatures).")
    p.add_argument("action", choices=["apply", "check", "revert", "drift"])
    p.add_argument("--nemo-rl", required=True, metavar="PATH", help="path to the NeMo RL checkout")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args._handler(args))
    except RlixError as exc:
        print(f"rlix {args.command}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"rlix {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
