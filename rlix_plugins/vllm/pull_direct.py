"""host_pull straight into the parameters (a GPU worker, eager mode, every bucket's layout direct): one host->device
copy per recorded range from the sender's pinned pages, with the landed bytes' checksums queued behind each bucket.
And, at finalize, :func:`landed_checksums`: those sums read, and the layouts first recorded in the sync checked for
the direct form (:class:`.replay.DirectCopies`)."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from rlix_plugins import transport
from rlix_plugins.transport import finish_checksums
from rlix_plugins.transport._checksum_kernel import KernelChecksums, self_check
from rlix_plugins.vllm.receive_checksums import PiecesChecksums
from rlix_plugins.vllm.receive_state import LayoutKey, ReceiverState, Sync
from rlix_plugins.vllm.replay import DirectCopies

if TYPE_CHECKING:
    from rlix_plugins.transport import BucketMeta

__all__ = ["landed_checksums", "pull_direct"]

logger = logging.getLogger(__name__)


def pull_direct(worker: Any, state: ReceiverState, sync: Sync, opened: list[tuple[BucketMeta, Any]],
                keys: list[LayoutKey], direct: list[DirectCopies], *, deferred: bool, sm_reads: bool = False) -> int:
    """Every bucket straight from the sender's pinned pages into the parameters: one host->device copy per
    recorded range, on the side stream, ordered after the work already queued on the model. ``deferred``: return
    once the copies are queued (the sender's ``after_issue`` work - the KV cache's wake - overlaps them, and
    ``rlix_finish_weight_update`` is the barrier); otherwise return after the last host read. ``sm_reads`` (an
    expand: memory is being mapped): one copy kernel per bucket reads the pages through their device address,
    since the driver's work on the memory a wake maps halves copy-engine throughput - a triton kernel of few
    programs (:mod:`rlix_plugins.transport._copy_kernel`: a shallow PCIe read queue does not hold the KV wake
    back), torch's foreach copy where it is unavailable. Verified at finalize, on the parameters themselves."""
    import torch

    device = worker._rlix_device()
    layouts = state.layouts
    stream = state.copy_stream
    if state.check_stream is None:
        state.check_stream = torch.cuda.Stream(device)
    t0 = time.perf_counter()
    stream.wait_stream(torch.cuda.current_stream(device))
    landed = []
    kernel = 0
    with torch.cuda.stream(stream):
        for (_, host), key, layout in zip(opened, keys, direct, strict=True):
            if sm_reads:
                view = transport.device_view(host, device)
                plan = layouts.copy_plan(key, view.data_ptr(), device)
                if plan is not None:
                    plan.launch()
                    kernel += 1
                    landed.append(torch.cuda.Event())
                    landed[-1].record(stream)
                    continue
                dsts, srcs = layout.word_copies(view)
            else:
                dsts, srcs = [dst for dst, _, _ in layout.copies], [host[lo:hi] for _, lo, hi in layout.copies]
            torch._foreach_copy_(dsts, srcs, non_blocking=True)
            landed.append(torch.cuda.Event())
            landed[-1].record(stream)
        sync.reads_done = torch.cuda.Event()
        sync.reads_done.record(stream)
    t_copies = time.perf_counter()
    # The checksums of what landed, bucket by bucket as its copies finish (they read the parameters on the GPU
    # while the next buckets cross PCIe): the sync's verification costs little more than the last bucket's sums.
    check = state.check_stream
    with torch.cuda.stream(check):
        for (meta, _), key, layout, event in zip(opened, keys, direct, landed, strict=True):
            check.wait_event(event)
            sync.landed_sums.append((meta.names, layout.pieces, layouts.landed_plan(key).start()))
        sync.landed_done = torch.cuda.Event()
        sync.landed_done.record(check)
    sync.direct.extend((meta, layout) for (meta, _), layout in zip(opened, direct, strict=True))
    sync.loaded_eagerly = True
    sync.buckets += len(opened)
    state.buckets_total += len(opened)
    t_issued = time.perf_counter()
    if not deferred:
        sync.wait_reads()
    state.timing = {"pull_issue_s": t_issued - t0, "pull_issue_checksums_s": t_issued - t_copies,
                    "pull_direct_copies": sum(len(d.copies) for d in direct), "pull_deferred": deferred,
                    "pull_sm_reads": sm_reads, "pull_copy_kernel_buckets": kernel,
                    "pull_checksum_kernel": all(isinstance(layouts.landed_plans.get(k), KernelChecksums)
                                                for k in keys),
                    "pull_wait_copies_s": time.perf_counter() - t_issued}
    return sum(len(m.names) for m, _ in opened)


def landed_checksums(worker: Any, state: ReceiverState, sync: Sync,
                     received: dict[str, list[int]]) -> dict[str, tuple[list[int], int | None]]:
    """Checksums of the bytes in the parameters after a direct pull (what verification reads; launched by the pull as
    each bucket landed), and a check of the layouts this sync recorded: one becomes direct when its copies tile its
    tensors and the parameters, after the loader's post-processing, hold exactly the received bytes (a
    post-processing that rewrites weights keeps the layout on the receive-buffer path; one that leaves them as
    they are lets a direct sync's sums, taken before it, stand for the parameters after it)."""
    layouts = state.layouts
    on_gpu = worker._rlix_device().type == "cuda"
    landed: dict[str, tuple[list[int], int | None]] = {}
    for names, pieces, partial in sync.landed_sums:
        sums = finish_checksums([sum(p.numel() for p in item) for item in pieces], partial)
        landed.update((name, (sum_, item[0].data_ptr() if len(item) == 1 else None))
                      for name, item, sum_ in zip(names, pieces, sums, strict=True))
    items: list[tuple[str, list[Any]]] = []
    candidates: list[tuple[LayoutKey, BucketMeta, DirectCopies]] = []
    for meta, key, replay in sync.recorded:
        found = DirectCopies.from_replay(replay, meta.offsets, [meta.nbytes(k) for k in range(len(meta.names))])
        if isinstance(found, str):
            logger.info("rlix: bucket %d stays on the receive-buffer path: %s", meta.index, found)
            continue
        candidates.append((key, meta, found))
    for meta, layout in ((m, d) for _, m, d in candidates):
        items.extend(zip(meta.names, layout.pieces, strict=True))
    if not items:
        return landed
    t0 = time.perf_counter()
    plan = PiecesChecksums([pieces for _, pieces in items])  # a first load: once per layout
    sums = finish_checksums(plan.nbytes, plan.start())
    if on_gpu:  # the checksum kernel's one comparison (and compile) per process
        self_check([pieces for _, pieces in items], sums)
    landed.update((name, (sum_, pieces[0].data_ptr() if len(pieces) == 1 else None))
                  for (name, pieces), sum_ in zip(items, sums, strict=True))
    state.timing["finalize_candidate_checksums_s"] = time.perf_counter() - t0
    for key, meta, found in candidates:
        if all(landed[n][0] == received.get(n) for n in meta.names):
            layouts.promote(key, found)
        else:
            logger.info("rlix: bucket %d stays on the receive-buffer path: the parameters differ from the received "
                        "bytes after post-processing", meta.index)
    if on_gpu:  # the plans now, not in the next pull: building one is a blocking copy
        for key in layouts.direct:
            layouts.landed_plan(key)
            if key in sync.sources:
                layouts.copy_plan(key, sync.sources[key], worker._rlix_device())
    return landed
