"""host_pull through receive buffers (a GPU worker): the sender's pinned pages are copied host -> GPU on a side
stream into two alternating receive buffers, and each group of a bucket is loaded as soon as its bytes landed (the
next copies overlap the current loads). Eager mode loads by the loader's copies recorded at a layout's first load
(:mod:`.replay`) when it can, recording them otherwise; staged mode keeps clones until finalize. Checksums run on the
received bytes, batched per bucket."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlix_plugins import transport
from rlix_plugins.vllm.receive_state import ReceiverState, Sync, layout_key
from rlix_plugins.vllm.replay import BucketReplay, CopyRecorder

if TYPE_CHECKING:
    from rlix_plugins.transport import BucketMeta

__all__ = ["GROUP_BYTES", "group_ranges", "pull_through_buffers"]

logger = logging.getLogger(__name__)

#: bytes per load group of a host_pull bucket: the loader starts on a group as soon as it landed
GROUP_BYTES = 64 << 20


def group_ranges(meta: Any) -> list[tuple[list[int], int, int]]:
    """Tensor indices of ``meta`` in consecutive groups of about ``GROUP_BYTES`` (a large tensor alone), each with
    its byte range ``[lo, hi)``. The ranges tile ``[0, used_bytes)`` - padding between groups included: the
    checksums read it (zero on the sender's side) - so a group ends where the next one starts."""
    groups: list[list[int]] = []
    size = 0
    for k in range(len(meta.names)):
        nbytes = meta.nbytes(k)
        if groups and size + nbytes <= GROUP_BYTES:
            groups[-1].append(k)
            size += nbytes
        else:
            groups.append([k])
            size = nbytes
    starts = [meta.offsets[g[0]] if i else 0 for i, g in enumerate(groups)]
    ends = [*starts[1:], meta.used_bytes]
    return [(g, lo, hi) for g, lo, hi in zip(groups, starts, ends, strict=True)]


def pull_through_buffers(worker: Any, state: ReceiverState, sync: Sync, opened: list[tuple[BucketMeta, Any]],
                         params: set[int]) -> int:
    """Every bucket of ``opened`` (the sender's mapped pages) into ``worker``'s model; returns the tensors taken,
    after the last host read (the sender may rebuild its cache once every receiver returned). ``params``: the
    model's parameter storages (a recorded load is replayed only where they did not move)."""
    import torch

    device = worker._rlix_device()
    layouts = state.layouts
    copy_stream, main = state.copy_stream, torch.cuda.current_stream(device)
    capacity = max((transport.align_up(m.used_bytes) for m, _ in opened), default=0)
    count = min(2, len(opened))
    largest = max((m.largest() for m, _ in opened), key=lambda t: t[1], default=("", 0))
    transport.check_device_capacity(count * capacity, device, what=f"host_pull receive buffers ({count})",
                                    largest=largest)
    receive = [torch.empty(capacity, dtype=torch.uint8, device=device) for _ in range(count)]
    loaded: list[Any] = [None] * len(opened)
    landed: list[list[tuple[list[int], Any]]] = [[] for _ in opened]

    def copy_in(i: int) -> None:
        meta, host = opened[i]
        buf = receive[i % count]
        with torch.cuda.stream(copy_stream):
            if i >= count:
                copy_stream.wait_event(loaded[i - count])  # the buffer's previous bucket was loaded
            # zero the rest of the last row first: the checksums read whole rows, and they wait only on the
            # group events below (a zero queued after them raced the checksum: caught by verification)
            buf[meta.used_bytes : transport.align_up(meta.used_bytes)].zero_()
            for group, lo, hi in group_ranges(meta):
                buf[lo:hi].copy_(host[lo:hi], non_blocking=True)
                done = torch.cuda.Event()
                done.record(copy_stream)
                landed[i].append((group, done))

    tensors = replayed = 0
    t0 = time.perf_counter()
    load_s = 0.0
    for i in range(count):
        copy_in(i)
    for i, (meta, host) in enumerate(opened):
        buf = receive[i % count]
        views = transport.unpack_bucket(meta, buf)
        key = layout_key(meta)
        sync.sources[key] = host.data_ptr()
        eager = sync.mode == "eager"
        known = key in layouts.replays
        replay = layouts.replay(key, params) if eager else None
        if known and eager and replay is None:
            logger.warning("rlix: parameters moved since bucket %d's load was recorded: loading it again", meta.index)
        record = eager and replay is None and layouts.wants_recording(key)
        recorders: list[CopyRecorder] = []
        for g, (group, done) in enumerate(landed[i]):
            main.wait_event(done)
            named = [views[k] for k in group]
            if eager:
                t_load = time.perf_counter()
                if replay is not None:
                    replay.apply(g, buf)
                elif record:
                    recorders.append(CopyRecorder(buf))
                    with recorders[-1]:
                        state.loader.load(worker, named)
                else:
                    state.loader.load(worker, named)
                load_s += time.perf_counter() - t_load
                sync.loaded_eagerly = True
            else:
                sync.staged.extend((name, t.clone()) for name, t in named)
        replayed += replay is not None
        if record:
            built = BucketReplay.from_recording(recorders, params)
            layouts.recorded(key, built)
            if built is None:
                logger.info("rlix: bucket %d is loaded by the model's loader every sync (%s)", meta.index,
                            next((r.foreign for r in recorders if r.foreign), "copies into non-parameters"))
            else:
                sync.recorded.append((meta, key, built))
        nbytes = [meta.nbytes(k) for k in range(len(meta.names))]
        padded = receive[i % count][: transport.align_up(meta.used_bytes)]
        sync.pending_sums.append(
            (list(meta.names), nbytes, transport.bucket_checksums(padded, list(meta.offsets), nbytes))
        )
        loaded[i] = torch.cuda.Event()
        loaded[i].record(main)
        if i + count < len(opened):
            copy_in(i + count)
        sync.buckets += 1
        state.buckets_total += 1
        tensors += len(views)
    t_issued = time.perf_counter()
    copy_stream.synchronize()  # every host read is done before we return
    state.timing = {"pull_issue_s": t_issued - t0, "pull_load_s": load_s, "pull_replayed_buckets": replayed,
                    "pull_wait_copies_s": time.perf_counter() - t_issued}
    return tensors
