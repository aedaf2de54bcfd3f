"""The checksums of :mod:`._checksum` in one triton kernel launch, read where the bytes lie (GPU only).

The torch form of a direct pull's landed-bytes check (``PiecesChecksums`` in the vLLM receiver) copies each
parameter slice into a scratch buffer and runs ~40 small ops per 256 MiB: ~500 launches and 14-24 ms of host time
for a 1.5B model, on the critical path of an expand (the engine's host thread does the wake, the pull and the
finish one after another). Here a table built once per layout lists every piece as spans of whole int32 words
``(address, words, index of the first word in its item, item)``; one launch sums them all, with no scratch
memory: per span ``word_sum`` and ``weighted = sum(w[i] * ((i // 128 + 1) * 129 + i % 128 + 1))``, added into
the item's row with atomics. All arithmetic wraps modulo 2**32 (int32 adds and products, atomic adds), as the
definition's does, so the numbers are the definition's; the receiver still checks them against the torch form on
a layout's first direct candidate (:func:`self_check`) and stays on the torch form if they ever differ.

An item qualifies when its pieces are 4-byte aligned and hold whole words (a piece with 1-3 trailing bytes would
need the definition's zero padding, which is not in memory): other layouts keep the torch form.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch

from rlix_plugins.transport._checksum import finish_checksums

log = logging.getLogger(__name__)

#: words per table entry (a span of one piece): 256 KiB, so a 1.5B model's 3 GB is ~12k programs
SPAN_WORDS = 1 << 16
#: words per loop step of one program
BLOCK_WORDS = 2048
#: None: not checked yet; then whether this process's kernel matched the torch form (see :func:`self_check`)
_matched: bool | None = None
_kernel: Any = None


def _compile() -> Any:
    global _kernel
    if _kernel is None:
        import triton
        import triton.language as tl

        @triton.jit
        def sums_kernel(table, out, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
            entry = tl.program_id(0)
            addr = tl.load(table + entry * 4)
            nwords = tl.load(table + entry * 4 + 1)
            first = tl.load(table + entry * 4 + 2)
            item = tl.load(table + entry * 4 + 3)
            ptr = addr.to(tl.pointer_type(tl.int32))
            acc_sum = tl.zeros([BLOCK], dtype=tl.int32)
            acc_dot = tl.zeros([BLOCK], dtype=tl.int32)
            for start in range(0, nwords, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < nwords
                w = tl.load(ptr + offs, mask=mask, other=0)
                i = first + offs
                weight = ((i // 128 + 1) * 129 + i % 128 + 1).to(tl.int32)
                acc_sum += w
                acc_dot += w * weight
            tl.atomic_add(out + item * 3, tl.sum(acc_sum, axis=0))
            tl.atomic_add(out + item * 3 + 2, tl.sum(acc_dot, axis=0))

        _kernel = sums_kernel
    return _kernel


def table_for(items: Sequence[Sequence[torch.Tensor]]) -> list[tuple[int, int, int, int]] | None:
    """The span table of ``items`` (each a list of uint8 pieces on one CUDA device), or None when one does not
    qualify (see the module doc)."""
    rows: list[tuple[int, int, int, int]] = []
    for k, pieces in enumerate(items):
        at = 0  # words of item k before this piece
        for piece in pieces:
            n = piece.numel()
            if piece.data_ptr() % 4 or n % 4:
                return None
            words = n // 4
            for s in range(0, words, SPAN_WORDS):
                rows.append((piece.data_ptr() + 4 * s, min(SPAN_WORDS, words - s), at + s, k))
            at += words
    return rows


class KernelChecksums:
    """The same interface as the receiver's ``PiecesChecksums`` (``nbytes``, :meth:`start`), one launch."""

    def __init__(self, items: Sequence[Sequence[torch.Tensor]], table: list[tuple[int, int, int, int]]) -> None:
        self.nbytes = [sum(p.numel() for p in item) for item in items]
        device = next((p.device for item in items for p in item), torch.device("cuda"))
        self.table = torch.tensor(table, dtype=torch.int64, device=device) if table else None
        self.device = device

    def start(self) -> torch.Tensor:
        """``(n, 3)`` int32 partial sums for ``finish_checksums`` (``[word_sum, 0, weighted]``), no host sync."""
        out = torch.zeros((len(self.nbytes), 3), dtype=torch.int32, device=self.device)
        if self.table is not None:
            _compile()[(self.table.shape[0],)](self.table, out, BLOCK=BLOCK_WORDS)
        return out


def kernel_checksums(items: Sequence[Sequence[torch.Tensor]]) -> KernelChecksums | None:
    """A :class:`KernelChecksums` for ``items`` when this process's kernel passed :func:`self_check` and every item
    qualifies; else None (use the torch form)."""
    if not _matched:
        return None
    table = table_for(items)
    return None if table is None else KernelChecksums(items, table)


def self_check(items: Sequence[Sequence[torch.Tensor]], expected: Sequence[Sequence[int]]) -> bool:
    """Compare the kernel with ``expected`` (the torch form's finished checksums of ``items``) once per process,
    compiling it on the way (a layout's first direct candidate: during a pipeline's prewarm sync, not an expand).
    Later calls return the first answer. False (the torch form stays) without triton or on any difference."""
    global _matched
    if _matched is not None:
        return _matched
    table = table_for(items)
    if not table:
        return False  # nothing the kernel would read: ask again with the next layout
    try:
        plan = KernelChecksums(items, table)
        got = finish_checksums(plan.nbytes, plan.start())
    except Exception as exc:  # no triton, a compile failure: the torch form works everywhere
        log.warning("rlix: checksum kernel unavailable (%r); direct pulls keep the torch checksums", exc)
        _matched = False
        return False
    _matched = [list(g) for g in got] == [list(e) for e in expected]
    if not _matched:
        log.warning("rlix: checksum kernel differs from the torch form; direct pulls keep the torch checksums")
    return _matched
