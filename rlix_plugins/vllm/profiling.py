"""Switches that profile a receiver's calls where a sync's time goes (``RLIX_PROFILE_PULL``, ``RLIX_PROFILE_CALLS``,
``RLIX_PROFILE_DIR``): off unless asked for."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from rlix_plugins import envs

__all__ = ["PROFILE_CALLS", "PROFILE_PULL", "profiled", "python_profiled"]

logger = logging.getLogger(__name__)

#: ``RLIX_PROFILE_PULL=N``: profile this worker's N-th host_pull with the torch profiler (where a sync's time goes)
PROFILE_PULL = envs.profile_pull()
#: ``RLIX_PROFILE_CALLS=1``: profile the host Python of every pull and finish call (cProfile, to ``RLIX_PROFILE_DIR``)
PROFILE_CALLS = envs.profile_calls()


@contextlib.contextmanager
def python_profiled(name: str, active: bool) -> Iterator[None]:
    """When ``active`` and ``RLIX_PROFILE_DIR`` is set: cProfile around the block, the 40 costliest calls by
    cumulative time to ``<dir>/<name>_<pid>.txt`` (where host time goes in Python: the torch profiler sees ops)."""
    out = envs.profile_dir()
    if not (active and out):
        yield
        return
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield
    finally:
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        with open(os.path.join(out, f"{name}_{os.getpid()}.txt"), "w", encoding="utf-8") as fh:
            fh.write(text.getvalue())


@contextlib.contextmanager
def profiled(name: str, active: bool) -> Iterator[None]:
    """When ``active``: torch profiler (CPU + CUDA) around the block; the op table goes to the log and, with
    ``RLIX_PROFILE_DIR`` set, to ``<dir>/<name>_<pid>.txt`` next to a Chrome trace (the timeline)."""
    if not active:
        yield
        return
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA],
                                with_stack=True) as prof:
        yield
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    logger.warning("rlix: profile of %s\n%s", name, table)
    out = envs.profile_dir()
    if out:
        with open(os.path.join(out, f"{name}_{os.getpid()}.txt"), "w", encoding="utf-8") as fh:
            fh.write(table)
        prof.export_chrome_trace(os.path.join(out, f"{name}_{os.getpid()}.trace.json"))
