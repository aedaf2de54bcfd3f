"""Per-engine vLLM port windows for time-shared engines (run by the vLLM plugin in every vLLM process).

NeMo RL gives each vLLM engine on a node its own window of ports (``VLLM_PORT`` = 7000 + 100 x the engine's slot on
the node, derived from its placement-group bundle) because vLLM picks ports by probing upward from ``VLLM_PORT`` and
binds them later: two engines searching one window take the same free port and one fails with ``EADDRINUSE``.
Under shared placement every engine's group starts at bundle 0, so NeMo RL gives every engine slot 0; and the
start-up grant widens the gap between probe and bind to minutes (a TP engine's executor probes its
torch.distributed store port, then its rank-0 worker binds it in ``init_device``, after the grant). Seen on two
H200s: two pipelines' vLLM TP 2 engines probed port 7032, the first bound it after its grant, the second died.

So each engine of a time-shared pipeline gets a window of its own: the placement hook gives the pipeline a slot
(``RLIX_VLLM_PORT_SLOT``, from the placement pool: distinct for up to :data:`SLOTS` live pipelines), and NeMo RL's
worker group gives each engine's leader its global rank (``RANK``: distinct within the pipeline, the engine's
position in its inference GPUs). ``VLLM_PORT`` = :data:`PORT_LOW` + (slot x :data:`ENGINES_PER_SLOT` + rank mod
:data:`ENGINES_PER_SLOT`) x :data:`PORTS_PER_ENGINE`: at most 32 pipelines with 8 engines each on a node, all below
the kernel's ephemeral range (32768), where NeMo RL keeps vLLM's ports on purpose. Rewritten only where
``VLLM_PORT`` is already set (NeMo RL's engine leaders, inherited by their engine cores), before the engine core
builds its executor (vLLM reads ``VLLM_PORT`` lazily until the engine is up); a function of the environment, so
calling it again changes nothing.
"""

from __future__ import annotations

import os
from typing import Final

from rlix_plugins import envs

__all__ = ["ENGINES_PER_SLOT", "PORTS_PER_ENGINE", "PORT_LOW", "SLOTS", "apply_port_window", "window_port"]

#: NeMo RL's port layout (``nemo_rl.distributed.virtual_cluster``: DEFAULT_VLLM_PORT_RANGE_LOW / _PORTS_PER_ENGINE).
PORT_LOW: Final = 7000
PORTS_PER_ENGINE: Final = 100
#: Engines of one pipeline on one node, and pipeline slots: 7000 + 32 x 8 x 100 = 32600 < 32768.
ENGINES_PER_SLOT: Final = 8
SLOTS: Final = 32


def window_port(slot: int, rank: int) -> int:
    """The first port of the window of the engine whose leader has global rank ``rank`` in pipeline slot ``slot``."""
    return PORT_LOW + ((slot % SLOTS) * ENGINES_PER_SLOT + rank % ENGINES_PER_SLOT) * PORTS_PER_ENGINE


def apply_port_window() -> int | None:
    """Point ``VLLM_PORT`` at this engine's window (see the module docstring); the port, or None where nothing was
    set (no slot, no rank, or no ``VLLM_PORT`` to move: not a time-shared NeMo RL engine)."""
    slot, rank = envs.vllm_port_slot(), envs.worker_rank()
    if slot is None or rank is None or envs.vllm_port() is None:
        return None
    port = window_port(slot, rank)
    os.environ.update({envs.VLLM_PORT: str(port)})
    return port
