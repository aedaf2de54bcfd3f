"""Host pages -> GPU copies by a few SMs: one triton launch per bucket over a table of spans (GPU only).

An expand queues its weight copies and then wakes the KV cache while they run. Read by a copy engine, or by a
``torch._foreach_copy_`` kernel that fills every SM with blocks waiting on PCIe reads, the copies held the wake's
own work back: on an H200 (``benchmarks/kv_wake_contention.py``, results in ``benchmarks/results/``) the KV wake took
145-180 ms with them instead of 92-121 ms alone. A grid-stride copy of 16-132 programs moved the same bytes at 47-48
GB/s (the foreach kernel: 51) and left the wake's time as it was alone; a device-to-device kernel as busy as the
foreach one did not slow it either, so what hurts the wake is the depth of the PCIe read queue, not busy SMs.

A plan is built once per bucket layout and source address: rows ``(source address, destination address, words)``
of at most :data:`SPAN_BYTES`, in the widest word that every address and size of the layout allows. The table lives
on the GPU; building it is a blocking host->device copy, so the receiver builds plans when a layout becomes direct,
not during an expand. The kernel's bytes are verified like every sync's (the landed-bytes checksums), and once per
process against ``torch`` on a small buffer before the first plan is used (:func:`copy_kernel_ok`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

log = logging.getLogger(__name__)

#: bytes per table row: enough rows for every program to have work, few enough that the table is small
SPAN_BYTES = 1 << 20
#: programs per launch: each streams its spans' words in blocks; few programs keep the PCIe read queue shallow
PROGRAMS = 32
#: words per loop step of one program
BLOCK = 1024
#: None: not checked yet; then whether this process's kernel copied bytes exactly (see :func:`copy_kernel_ok`)
_ok: bool | None = None
_kernel: Any = None


def _compile() -> Any:
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def copy_spans(table, rows, WORD: tl.constexpr, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            if WORD == 8:
                ptr_type = tl.pointer_type(tl.int64)
            elif WORD == 4:
                ptr_type = tl.pointer_type(tl.int32)
            elif WORD == 2:
                ptr_type = tl.pointer_type(tl.int16)
            else:
                ptr_type = tl.pointer_type(tl.uint8)
            for row in range(tl.program_id(0), rows, tl.num_programs(0)):
                src = tl.load(table + row * 3).to(ptr_type)
                dst = tl.load(table + row * 3 + 1).to(ptr_type)
                words = tl.load(table + row * 3 + 2)
                for start in range(0, words, BLOCK):
                    offs = start + tl.arange(0, BLOCK)
                    mask = offs < words
                    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)

        _kernel = copy_spans
    return _kernel


def span_table(source: int, copies: Sequence[tuple[int, int, int]]) -> tuple[list[tuple[int, int, int]], int]:
    """Rows ``(source address, destination address, words)`` for ``copies`` = ``(destination address, lo, hi)``
    (bytes ``[lo, hi)`` of the source at address ``source``), and the word size in bytes."""
    word = next(w for w in (8, 4, 2, 1)
                if source % w == 0 and all(dst % w == 0 and lo % w == 0 and hi % w == 0 for dst, lo, hi in copies))
    rows = []
    for dst, lo, hi in copies:
        for at in range(lo, hi, SPAN_BYTES):
            n = min(SPAN_BYTES, hi - at)
            rows.append((source + at, dst + at - lo, n // word))
    return rows, word


class KernelCopies:
    """One bucket layout's copies from one source address, as a table on ``device``; :meth:`launch` queues them."""

    def __init__(self, source: int, copies: Sequence[tuple[int, int, int]], device: torch.device) -> None:
        rows, self.word = span_table(source, copies)
        self.source = source
        self.rows = len(rows)
        self.table = torch.tensor(rows, dtype=torch.int64, device=device) if rows else None

    def launch(self) -> None:
        """Queue every copy on the current stream (one launch, no host sync)."""
        if self.table is not None:
            _compile()[(min(PROGRAMS, self.rows),)](self.table, self.rows, WORD=self.word, BLOCK=BLOCK)


def copy_kernel_ok(device: torch.device) -> bool:
    """Whether the kernel copies pinned host bytes exactly on ``device``, checked once per process (compiling it):
    odd sizes and offsets in every word size, against the source. False without triton or on any difference."""
    global _ok
    if _ok is not None:
        return _ok
    try:
        host = torch.randint(0, 256, (3 * SPAN_BYTES + 24,), dtype=torch.uint8).pin_memory()
        out = torch.zeros(host.numel(), dtype=torch.uint8, device=device)
        base = out.data_ptr()
        cases = [[(base, 0, host.numel())], [(base + 4, 4, 2 * SPAN_BYTES + 12)], [(base + 2, 2, 10)], [(base + 1, 1, 7)],
                 [(base + 16, 16, 24), (base + 40, 40, SPAN_BYTES + 8)]]
        from rlix_plugins.transport._host_pull import device_view

        view = device_view(host, device)
        for copies in cases:
            out.zero_()
            KernelCopies(view.data_ptr(), copies, device).launch()
            want = torch.zeros_like(host)
            for dst, lo, hi in copies:
                want[dst - base : dst - base + hi - lo] = host[lo:hi]
            if not torch.equal(out.cpu(), want):
                log.warning("rlix: the SM copy kernel differs from the source bytes; expands read with torch's copy")
                _ok = False
                return _ok
        _ok = True
    except Exception as exc:  # no triton, a compile failure: torch's copy works everywhere
        log.warning("rlix: SM copy kernel unavailable (%r); expands read with torch's copy", exc)
        _ok = False
    return _ok


def kernel_copies(source: int, copies: Sequence[tuple[int, int, int]], device: torch.device) -> KernelCopies | None:
    """A :class:`KernelCopies` when this process's kernel passed :func:`copy_kernel_ok`; else None."""
    return KernelCopies(source, copies, device) if copy_kernel_ok(device) else None
