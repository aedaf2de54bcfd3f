"""Every environment variable rlix-plugins reads, in one place (like vLLM's ``vllm/envs.py``).

Each variable has a name constant, a row in :data:`VARIABLES` (default and meaning) and one accessor that reads
``os.environ`` when it is called (never at import: a test or a launcher that sets a variable after import is seen)
and converts the text. A value that cannot mean anything raises ``RlixConfigError`` naming the variable, the value
and what is expected.

Variables owned by others (Ray, CUDA, Hugging Face, XDG, the C toolchain) that rlix only reads have accessors here
too, returning the raw value: their owners define what a value means. Environment *writes* (a child process's or a
Ray ``runtime_env``'s environment) stay where they are built.

Not read here, on purpose: ``rlix_plugins/nemo_rl/hookspec.py`` reads ``RLIX_CONTROL_PLANE`` itself and validates
it, because it is the source of NeMo RL's seam file (patch 0001), which never imports rlix-plugins; and
``rlix_plugins/vllm/plugin.py`` reads it too, because vLLM imports that entry point in standalone processes, where
nothing else of ours may be imported.

This module imports only the standard library and :mod:`rlix_plugins.errors`: ``control/`` and ``transport/`` import
it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from rlix_plugins.errors import RlixConfigError

__all__ = [
    "VARIABLES",
    "EnvVar",
    "c_compiler",
    "chained_setup_hook",
    "control_plane",
    "cuda_visible_devices",
    "hf_home",
    "hf_hub_cache",
    "init_timeout_s",
    "native_checksum",
    "node_id",
    "node_ip",
    "patches_dir",
    "pipeline_id",
    "profile_calls",
    "profile_dir",
    "profile_pull",
    "ray_address",
    "ray_auth_mode",
    "ray_auth_token",
    "ray_auth_token_path",
    "ray_use_tls",
    "search_path",
    "state_dir",
    "time_sharing",
    "vllm_port",
    "vllm_port_slot",
    "worker_rank",
    "xdg_cache_home",
]

# ---------------------------------------------------------------------------------------------- names (rlix's own)
RLIX_CONTROL_PLANE: Final = "RLIX_CONTROL_PLANE"
#: The only value of ``RLIX_CONTROL_PLANE`` that turns time-sharing on.
TIME_SHARING_VALUE: Final = "rlix"
RLIX_PIPELINE_ID: Final = "RLIX_PIPELINE_ID"
RLIX_INIT_TIMEOUT_S: Final = "RLIX_INIT_TIMEOUT_S"
RLIX_VLLM_PORT_SLOT: Final = "RLIX_VLLM_PORT_SLOT"
RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK: Final = "RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK"
RLIX_PATCHES_DIR: Final = "RLIX_PATCHES_DIR"
RLIX_STATE_DIR: Final = "RLIX_STATE_DIR"
RLIX_NATIVE_CHECKSUM: Final = "RLIX_NATIVE_CHECKSUM"
RLIX_PROFILE_PULL: Final = "RLIX_PROFILE_PULL"
RLIX_PROFILE_CALLS: Final = "RLIX_PROFILE_CALLS"
RLIX_PROFILE_DIR: Final = "RLIX_PROFILE_DIR"
RLIX_NODE_ID: Final = "RLIX_NODE_ID"
RLIX_NODE_IP: Final = "RLIX_NODE_IP"

# ------------------------------------------------------------------------------- names (others', read by rlix only)
RAY_ADDRESS: Final = "RAY_ADDRESS"
RAY_RANK: Final = "RANK"
VLLM_PORT: Final = "VLLM_PORT"
RAY_USE_TLS: Final = "RAY_USE_TLS"
RAY_AUTH_MODE: Final = "RAY_AUTH_MODE"
RAY_AUTH_TOKEN: Final = "RAY_AUTH_TOKEN"
RAY_AUTH_TOKEN_PATH: Final = "RAY_AUTH_TOKEN_PATH"
CUDA_VISIBLE_DEVICES: Final = "CUDA_VISIBLE_DEVICES"
HF_HUB_CACHE: Final = "HF_HUB_CACHE"
HF_HOME: Final = "HF_HOME"
XDG_CACHE_HOME: Final = "XDG_CACHE_HOME"
CC: Final = "CC"
PATH: Final = "PATH"
NRL_VLLM_ASYNC_TIMEOUT_SECONDS: Final = "NRL_VLLM_ASYNC_TIMEOUT_SECONDS"

#: The default start-up grant wait (``RuntimeConfig.init_timeout_s``'s default).
DEFAULT_INIT_TIMEOUT_S: Final = 900.0


@dataclass(frozen=True)
class EnvVar:
    """One variable rlix reads: its name, its default (as text; ``None``: unset means "off" or "not given"), who
    defines it, and what it means."""

    name: str
    default: str | None
    owner: str
    meaning: str


#: The table of every variable read (``docs`` and ``rlix`` tests list it; the accessors below read them).
VARIABLES: Final[tuple[EnvVar, ...]] = (
    EnvVar(RLIX_CONTROL_PLANE, None, "rlix",
           "`rlix` turns GPU time-sharing on; unset: standalone NeMo RL / vLLM (the NeMo RL seam rejects other values)"),
    EnvVar(RLIX_PIPELINE_ID, None, "rlix",
           "set by the NeMo RL placement hook on vLLM workers: the pipeline whose start-up grant they wait for"),
    EnvVar(RLIX_INIT_TIMEOUT_S, str(DEFAULT_INIT_TIMEOUT_S), "rlix",
           "seconds a vLLM worker waits for its pipeline's start-up (INITIALIZATION) grant; a positive number"),
    EnvVar(RLIX_VLLM_PORT_SLOT, None, "rlix",
           "set by the NeMo RL placement hook on vLLM workers: the pipeline's slot of vLLM port windows on a node"),
    EnvVar(RAY_RANK, None, "torch.distributed / NeMo RL",
           "a worker's global rank (NeMo RL's worker group sets it; a vLLM rank's port window is chosen by it)"),
    EnvVar(VLLM_PORT, None, "vLLM", "where vLLM's port searches start (rewritten per engine: rlix_plugins.vllm.ports)"),
    EnvVar(RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK, None, "rlix",
           "a Ray worker-process setup hook that was there before rlix's; run first by rlix's hook"),
    EnvVar(RLIX_PATCHES_DIR, None, "rlix", "a directory of NeMo RL patch series used instead of the shipped one"),
    EnvVar(RLIX_STATE_DIR, "~/.cache/rlix", "rlix", "where `rlix up` records the local Ray head it started"),
    EnvVar(RLIX_NATIVE_CHECKSUM, "1", "rlix", "`0` keeps the torch path of the bucket pack checksum (read each use)"),
    EnvVar(RLIX_PROFILE_PULL, "0", "rlix", "N > 0: torch-profile a vLLM worker's N-th host_pull; an int >= 0"),
    EnvVar(RLIX_PROFILE_CALLS, "0", "rlix", "anything but empty or `0`: cProfile every receiver pull/finish call"),
    EnvVar(RLIX_PROFILE_DIR, None, "rlix", "where the receiver's profiles are written"),
    EnvVar(RLIX_NODE_ID, None, "rlix",
           "set by rlix in a Ray process for the processes it starts (vLLM engine cores): the Ray node they run on"),
    EnvVar(RLIX_NODE_IP, None, "rlix",
           "set with RLIX_NODE_ID: that node's IP (a weight broadcast's rendezvous address when this process sends)"),
    EnvVar(RAY_ADDRESS, None, "Ray", "the Ray cluster to join when no --address is given"),
    EnvVar(RAY_USE_TLS, None, "Ray", "`1`: the cluster uses TLS (rlix then skips its own GCS probe)"),
    EnvVar(RAY_AUTH_MODE, None, "Ray", "`token` or `disabled`: Ray's authentication mode"),
    EnvVar(RAY_AUTH_TOKEN, None, "Ray", "Ray's auth token itself"),
    EnvVar(RAY_AUTH_TOKEN_PATH, "~/.ray/auth_token", "Ray", "the file holding Ray's auth token"),
    EnvVar(CUDA_VISIBLE_DEVICES, None, "CUDA", "the GPUs this process sees (named in cuda_ipc errors)"),
    EnvVar(HF_HUB_CACHE, None, "Hugging Face", "the hub cache (model shapes are read from cached configs)"),
    EnvVar(HF_HOME, None, "Hugging Face", "the Hugging Face home; the hub cache is its `hub`"),
    EnvVar(XDG_CACHE_HOME, "~/.cache", "XDG", "the user's cache directory (native kernel, hub cache fallback)"),
    EnvVar(CC, "cc", "C toolchain", "the C compiler of the native checksum kernel"),
    EnvVar(PATH, "", "POSIX", "where `rlix up` looks for the `ray` command (after this Python's directory)"),
    EnvVar(NRL_VLLM_ASYNC_TIMEOUT_SECONDS, "900", "NeMo RL",
           "seconds one rollout request may take (read by the router's per-request path on NeMo RL v0.7.0)"),
)


def _raw(name: str) -> str | None:
    return os.environ.get(name)


def _set(name: str) -> str | None:
    """The value, with an empty one read as unset."""
    return os.environ.get(name) or None


# ---------------------------------------------------------------------------------------------------- rlix's own
def control_plane() -> str:
    """``RLIX_CONTROL_PLANE`` as it is ("" when unset)."""
    return os.environ.get(RLIX_CONTROL_PLANE, "")


def time_sharing() -> bool:
    """This process runs under the rlix control plane (``RLIX_CONTROL_PLANE=rlix``); any other value: standalone."""
    return control_plane() == TIME_SHARING_VALUE


def pipeline_id() -> str | None:
    """``RLIX_PIPELINE_ID``: the time-shared pipeline this vLLM worker serves (None: none, nothing waits)."""
    return _set(RLIX_PIPELINE_ID)


def vllm_port_slot() -> int | None:
    """``RLIX_VLLM_PORT_SLOT``: the pipeline's slot of vLLM port windows (None: unset); an int >= 0."""
    return _non_negative_int(RLIX_VLLM_PORT_SLOT)


def worker_rank() -> int | None:
    """``RANK``: this worker's global rank (None: unset); an int >= 0."""
    return _non_negative_int(RAY_RANK)


def vllm_port() -> str | None:
    """``VLLM_PORT`` as set (vLLM reads it; rlix only checks that it is set before rewriting it)."""
    return _raw(VLLM_PORT)


def _non_negative_int(name: str, meaning: str = "") -> int | None:
    """``name`` as an int >= 0 (None when unset); else a one-line error naming it (``meaning``: what it is for)."""
    text = _set(name)
    if text is None:
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise RlixConfigError(f"{name}={text!r} is not an int >= 0{meaning}")
    return value


def init_timeout_s() -> float:
    """``RLIX_INIT_TIMEOUT_S`` in seconds (default :data:`DEFAULT_INIT_TIMEOUT_S`); a positive number."""
    return _positive_seconds(RLIX_INIT_TIMEOUT_S, DEFAULT_INIT_TIMEOUT_S, f"e.g. {DEFAULT_INIT_TIMEOUT_S:.0f}")


def _positive_seconds(name: str, default: float, example: str) -> float:
    """``name`` as a positive number of seconds (``default`` when unset); else a one-line error naming it."""
    text = _set(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value > 0:
        raise RlixConfigError(f"{name}={text!r} is not a positive number of seconds; set it to one ({example}) "
                              "or unset it")
    return value


def chained_setup_hook() -> str | None:
    """``RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK``: the ``module.function`` rlix's worker setup hook runs first."""
    return _set(RLIX_CHAINED_WORKER_PROCESS_SETUP_HOOK)


def patches_dir() -> Path | None:
    """``RLIX_PATCHES_DIR``: a patch-series root replacing the shipped one (None: the shipped one)."""
    value = _set(RLIX_PATCHES_DIR)
    return Path(value) if value else None


def state_dir() -> Path:
    """``RLIX_STATE_DIR``, else ``~/.cache/rlix``: where ``rlix up`` keeps its record."""
    return Path(_set(RLIX_STATE_DIR) or os.path.join(os.path.expanduser("~"), ".cache", "rlix"))


def native_checksum() -> bool:
    """``RLIX_NATIVE_CHECKSUM``: False only for ``0`` (keep the torch path)."""
    return os.environ.get(RLIX_NATIVE_CHECKSUM, "1") != "0"


def profile_pull() -> int:
    """``RLIX_PROFILE_PULL``: the host_pull to profile (0: none); an int >= 0."""
    value = _non_negative_int(RLIX_PROFILE_PULL, " (the host_pull to profile, counting from 1; 0 or unset: none)")
    return 0 if value is None else value


def profile_calls() -> bool:
    """``RLIX_PROFILE_CALLS``: True for anything but empty or ``0``."""
    return os.environ.get(RLIX_PROFILE_CALLS, "") not in ("", "0")


def profile_dir() -> str | None:
    """``RLIX_PROFILE_DIR``: where profiles go (None: the log only, or nowhere)."""
    return _set(RLIX_PROFILE_DIR)


def node_id() -> str | None:
    """``RLIX_NODE_ID``: the Ray node a Ray parent process exported (None: unset or empty)."""
    return _set(RLIX_NODE_ID)


def node_ip() -> str | None:
    """``RLIX_NODE_IP``: that node's IP (None: unset or empty)."""
    return _set(RLIX_NODE_IP)


# ------------------------------------------------------------------------------------- others', as they are set
def ray_address() -> str | None:
    """``RAY_ADDRESS`` as it is (an empty value is returned as it is)."""
    return _raw(RAY_ADDRESS)


def ray_use_tls() -> bool:
    """``RAY_USE_TLS=1``."""
    return _raw(RAY_USE_TLS) == "1"


def ray_auth_mode() -> str | None:
    """``RAY_AUTH_MODE`` as it is (None: unset)."""
    return _raw(RAY_AUTH_MODE)


def ray_auth_token() -> str | None:
    """``RAY_AUTH_TOKEN`` (None: unset or empty). A secret: never log it."""
    return _set(RAY_AUTH_TOKEN)


def ray_auth_token_path() -> str | None:
    """``RAY_AUTH_TOKEN_PATH`` (None: unset or empty)."""
    return _set(RAY_AUTH_TOKEN_PATH)


def cuda_visible_devices() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` as it is (None: unset)."""
    return _raw(CUDA_VISIBLE_DEVICES)


def hf_hub_cache() -> str | None:
    """``HF_HUB_CACHE`` (None: unset or empty)."""
    return _set(HF_HUB_CACHE)


def hf_home() -> str | None:
    """``HF_HOME`` (None: unset or empty)."""
    return _set(HF_HOME)


def xdg_cache_home() -> str | None:
    """``XDG_CACHE_HOME`` (None: unset or empty; callers default to ``~/.cache``)."""
    return _set(XDG_CACHE_HOME)


def c_compiler() -> str:
    """``CC``, else ``cc``."""
    return os.environ.get(CC, "cc")


def search_path() -> str:
    """``PATH`` ("" when unset)."""
    return os.environ.get(PATH, "")


def nemo_rl_async_timeout_s() -> float:
    """``NRL_VLLM_ASYNC_TIMEOUT_SECONDS`` (NeMo RL's bound on one async generation request; default 900)."""
    return _positive_seconds(NRL_VLLM_ASYNC_TIMEOUT_SECONDS, 900.0, "NeMo RL's default is 900")
