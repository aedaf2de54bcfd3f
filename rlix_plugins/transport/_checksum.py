"""Bit-exact tensor checksums at memory speed: two int32 reductions over the raw bytes, on the tensor's device.

``tensor_checksum(t) -> [nbytes, word_sum, weighted_sum]`` (plain ints, msgpack-safe):

* the tensor's bytes, zero-padded, are read as int32 words laid out in rows of ``ROW_WORDS`` (128) words:
  word ``i`` sits at row ``k = i // 128``, column ``j = i % 128``;
* ``word_sum = sum(w[i]) mod 2**32`` - any single flipped bit changes it;
* ``weighted_sum = sum(w[i] * ((k + 1) * 129 + j + 1)) mod 2**32`` - every position has its own weight, so
  swapped or shifted words change it too.

Everything is integer arithmetic modulo 2**32 (int32 sums wrap; the order of a reduction cannot change
a modular sum), so CPU, GPU, one tensor at a time and a whole bucket at once give identical numbers. No
float tolerance: the same bytes in means the same numbers out, NaNs and -0.0 included.

Why this layout: a row is 512 bytes, the bucket alignment (``ALIGN_BYTES``), so every tensor of a bucket
starts on a row; :func:`bucket_checksums` checksums all tensors of a received bucket with a handful of
kernels and no host sync per tensor (``weighted = 129 * sum_k (k + 1) * rowsum_k + sum_k rowdot_k``,
segment sums by prefix sums over rows; a GPU reads the bytes about three times). On a CPU the per-tensor
form reads the bytes twice (row sums, then column sums over 4096-word rows: 1.9 + 2.3 ms for 256 MiB on the
H100 host, where a memcpy takes 6.1 ms); the cache build uses :class:`PackChecksums` instead, which copies and
sums in one pass with a small C kernel (:mod:`._native_checksum`, compiled at first use) or, where that is not
available, takes both sums of each 8 MiB step of the copy while the step is still in cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Final

import torch

from rlix_plugins.errors import WeightVerificationError
from rlix_plugins.transport import _native_checksum

#: int32 words per row: 512 bytes, the bucket alignment.
ROW_WORDS: Final = 128
#: words per row of the CPU column pass (32 rows of the definition side by side).
WIDE_WORDS: Final = 32 * ROW_WORDS
#: rows per GPU step of the batched form (bounds the int32 product scratch to 64 MiB).
GPU_CHUNK_ROWS: Final = 1 << 17
#: bytes of one row (the bucket alignment).
ROW_BYTES: Final = 4 * ROW_WORDS
#: bytes per step of :class:`PackChecksums` (whole rows): small enough that both sums read a step's bytes from
#: the caches right after the copy wrote them, large enough that per-step dispatch stays a few percent.
PACK_STEP_BYTES: Final = 8 << 20
#: rows per column-sum group of :class:`PackChecksums`.
GROUP_ROWS: Final = 64
_MASK32: Final = (1 << 32) - 1
_I32 = torch.int32
_CPU = torch.device("cpu")


def _words(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as int32 words (zero-padded to a multiple of 4)."""
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if raw.numel() % 4:
        raw = torch.cat([raw, raw.new_zeros(4 - raw.numel() % 4)])
    try:
        return raw.view(_I32)
    except RuntimeError:  # storage offset not 4-byte aligned
        return raw.clone().view(_I32)


_arange_cache: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _arange(device: torch.device, start: int, n: int) -> torch.Tensor:
    """``[start, start + 1, ..., start + n - 1]`` as int32 on ``device`` (cached)."""
    key = (device, start, n)
    w = _arange_cache.get(key)
    if w is None:
        if len(_arange_cache) > 64:
            _arange_cache.clear()
        w = _arange_cache[key] = torch.arange(start, start + n, dtype=_I32, device=device)
    return w


def _combine(word_sum: int, row_weighted: int, col_weighted: int, nbytes: int) -> list[int]:
    weighted = (ROW_WORDS + 1) * row_weighted + col_weighted
    return [nbytes, word_sum & _MASK32, weighted & _MASK32]


def _cpu_partial_sums(words: torch.Tensor) -> torch.Tensor:
    """The CPU form, two reductions at memory speed: row sums of 128-word rows and column sums of 4096-word rows
    (a reduction over a wide row is what a CPU does fast); the 128 column sums of the definition are the
    4096 column sums folded 32 times (``4096 = 32 * 128``, so word ``i`` keeps ``i % 128``)."""
    n = words.numel()
    full = n // ROW_WORDS
    rows = words[: full * ROW_WORDS].view(full, ROW_WORDS).sum(dim=1, dtype=_I32)
    wide = n // WIDE_WORDS
    cols = words[: wide * WIDE_WORDS].view(wide, WIDE_WORDS).sum(dim=0, dtype=_I32).view(-1, ROW_WORDS)
    cols = cols.sum(dim=0, dtype=_I32) if wide else torch.zeros(ROW_WORDS, dtype=_I32)
    rest = words[wide * WIDE_WORDS :]  # fewer than 4096 words: fold them into the 128 columns directly
    if rest.numel():
        padded = torch.zeros(-(-rest.numel() // ROW_WORDS) * ROW_WORDS, dtype=_I32)
        padded[: rest.numel()] = rest
        cols += padded.view(-1, ROW_WORDS).sum(dim=0, dtype=_I32)
    word_sum = rows.sum(dtype=_I32)
    row_weighted = (rows * _arange(words.device, 1, full)).sum(dtype=_I32)
    tail = words[full * ROW_WORDS :]
    if tail.numel():
        total = tail.sum(dtype=_I32)
        word_sum = word_sum + total
        row_weighted = row_weighted + total * (full + 1)
    col_weighted = (cols * _arange(words.device, 1, ROW_WORDS)).sum(dtype=_I32)
    return torch.stack([word_sum, row_weighted, col_weighted])


def _partial_sums(words: torch.Tensor) -> torch.Tensor:
    """``[word_sum, sum_k (k + 1) * rowsum_k, sum_j (j + 1) * colsum_j]`` (int32, wrapped) as a device tensor."""
    dev = words.device
    if dev.type == "cpu":
        return _cpu_partial_sums(words)
    n = words.numel()
    full = n // ROW_WORDS
    chunk = max(full, 1)
    cols = torch.zeros(ROW_WORDS, dtype=_I32, device=dev)
    acc = torch.zeros(2, dtype=_I32, device=dev)  # [sum of rows, sum of (k + 1) * row_k]
    for start in range(0, full, chunk):
        stop = min(start + chunk, full)
        block = words[start * ROW_WORDS : stop * ROW_WORDS].view(stop - start, ROW_WORDS)
        rows = block.sum(dim=1, dtype=_I32)
        cols += block.sum(dim=0, dtype=_I32)
        acc[0] += rows.sum(dtype=_I32)
        acc[1] += (rows * _arange(dev, start + 1, stop - start)).sum(dtype=_I32)
    tail = words[full * ROW_WORDS :]
    if tail.numel():
        total = tail.sum(dtype=_I32)
        cols[: tail.numel()] += tail
        acc[0] += total
        acc[1] += total * (full + 1)
    col_weighted = (cols * _arange(dev, 1, ROW_WORDS)).sum(dtype=_I32)
    return torch.cat([acc, col_weighted.view(1)])


def tensor_checksum(tensor: torch.Tensor) -> list[int]:
    """``[nbytes, word_sum, weighted_sum]`` of the raw bytes; see the module docstring. One host sync."""
    return finish_checksums([tensor.numel() * tensor.element_size()], start_checksums([tensor]))[0]


def start_checksums(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Launch the checksums of ``tensors`` (one device) without waiting: an ``(n, 3)`` int32 tensor for
    :func:`finish_checksums`. On a GPU nothing blocks until ``finish_checksums`` reads the result."""
    if not tensors:
        return torch.zeros((0, 3), dtype=_I32)
    parts = [
        _partial_sums(_words(t)) if t.numel() else torch.zeros(3, dtype=_I32, device=t.device) for t in tensors
    ]
    return torch.stack(parts)


def finish_checksums(nbytes: Sequence[int], partial: torch.Tensor) -> list[list[int]]:
    """Read :func:`start_checksums` / :func:`bucket_checksums` results (one host sync for all of them)."""
    rows = partial.tolist()
    return [_combine(ws, rw, cw, n) for n, (ws, rw, cw) in zip(nbytes, rows, strict=True)]


def bucket_checksums(buffer: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int]) -> torch.Tensor:
    """Checksums of every tensor of a bucket at once, for :func:`finish_checksums`; no host sync.

    ``buffer`` is the bucket's uint8 bytes (any device) holding the tensors at ``offsets`` (multiples of
    512, ascending) with ``nbytes`` each; the bytes between a tensor's end and the next row must be zero
    (``pack`` writes zero padding; pass a buffer padded with zeros to a whole row after the last tensor).
    """
    if buffer.device.type == "cpu":  # the per-tensor column-sum form is faster on a CPU
        return start_checksums([buffer[o : o + n] for o, n in zip(offsets, nbytes, strict=True)])
    return segment_checksums(buffer, offsets, nbytes)


def segment_rows(offsets: Sequence[int], nbytes: Sequence[int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each segment's first row and the row past its end, on ``device`` (pass to :func:`segment_checksums` as
    ``rows`` when the same layout is checksummed again: building them is a blocking host->device copy)."""
    row_bytes = ROW_WORDS * 4
    first = torch.tensor([o // row_bytes for o in offsets], dtype=torch.int64, device=device)
    last = torch.tensor([-(-(o + n) // row_bytes) for o, n in zip(offsets, nbytes, strict=True)],
                        dtype=torch.int64, device=device)
    return first, last


def segment_checksums(buffer: torch.Tensor, offsets: Sequence[int], nbytes: Sequence[int],
                      rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """The batched form of :func:`bucket_checksums` (any device; the GPU path): row sums and row dot
    products of the whole bucket, per-tensor sums by prefix sums over rows (``rows``: :func:`segment_rows`)."""
    dev = buffer.device
    if not offsets:
        return torch.zeros((0, 3), dtype=_I32, device=dev)
    row_bytes = ROW_WORDS * 4
    end = offsets[-1] + nbytes[-1]
    if buffer.numel() < end:
        raise ValueError(f"bucket buffer of {buffer.numel()} bytes is shorter than its tensors ({end} bytes)")
    nrows = -(-end // row_bytes)
    whole = min(nrows, buffer.numel() // row_bytes)
    words = buffer[: whole * row_bytes].view(_I32).view(whole, ROW_WORDS)
    if whole < nrows:  # the buffer ends inside the last row: checksum a zero-padded copy of that row
        last = torch.zeros(row_bytes, dtype=torch.uint8, device=dev)
        last[: end - whole * row_bytes] = buffer[whole * row_bytes : end]
        words = torch.cat([words, last.view(_I32).view(1, ROW_WORDS)])
    row_sum = torch.empty(nrows, dtype=_I32, device=dev)
    row_dot = torch.empty(nrows, dtype=_I32, device=dev)
    col_weights = _arange(dev, 1, ROW_WORDS)
    for start in range(0, nrows, GPU_CHUNK_ROWS):
        block = words[start : start + GPU_CHUNK_ROWS]
        row_sum[start : start + GPU_CHUNK_ROWS] = block.sum(dim=1, dtype=_I32)
        row_dot[start : start + GPU_CHUNK_ROWS] = (block * col_weights).sum(dim=1, dtype=_I32)
    # per tensor: rows [first, last); sums over a row range by prefix sums (modular: differences are exact)
    first, last = rows if rows is not None else segment_rows(offsets, nbytes, dev)
    zero = torch.zeros(1, dtype=_I32, device=dev)
    global_row = _arange(dev, 0, nrows)
    prefix = [torch.cat([zero, torch.cumsum(v, 0, dtype=_I32)]) for v in (row_sum, row_sum * global_row, row_dot)]
    seg = [p[last] - p[first] for p in prefix]
    # sum over the tensor's rows of (local_row + 1) * row_sum = sum(global_row * row_sum) - (first - 1) * sum(row_sum)
    row_weighted = seg[1] - (first.to(_I32) - 1) * seg[0]
    return torch.stack([seg[0], row_weighted, seg[2]], dim=1)


class PackChecksums:
    """Checksums of a CPU bucket taken while it is packed: :meth:`copy` writes a tensor into the bucket and sums
    the words it copies in the same pass (the native kernel of :mod:`._native_checksum`); without that kernel it
    copies step by step (:data:`PACK_STEP_BYTES`) and takes each step's row sums and column sums while its bytes
    are still in the caches, so memory is read once (by the copy) instead of once more per reduction;
    :meth:`finish` returns the numbers of :func:`start_checksums` for the bucket's tensors.

    Column sums are taken per group of :data:`GROUP_ROWS` rows (a ``[groups, 64, 128]`` view summed over its
    middle dimension): torch splits such a reduction across threads by group, the same contiguous ranges its
    copy gave each thread, where a plain column sum would split 128 columns over at most 4 threads.
    """

    def __init__(self, buffer: torch.Tensor) -> None:
        self.buffer = buffer
        #: per tensor in bucket order: [word_sum, row_weighted] and its 128 column sums; None: copied elsewhere
        self.tensors: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def fits(self, start: int, nbytes: int) -> bool:
        """Whether the buffer holds the tensor's last row whole (the sums read whole rows)."""
        return start % ROW_BYTES == 0 and start + -(-nbytes // ROW_BYTES) * ROW_BYTES <= self.buffer.numel()

    def copy(self, start: int, src: torch.Tensor) -> None:
        """Copy the uint8 CPU tensor ``src`` to ``buffer[start:]`` (see :meth:`fits`), zero the rest of its last row."""
        n = src.numel()
        padded = -(-n // ROW_BYTES) * ROW_BYTES
        if _native_checksum.available():
            sums = _native_checksum.copy_sums(src, self.buffer[start : start + padded])
            self.tensors.append((sums[:2], sums[2:]))
            return
        words = self.buffer[start : start + padded].view(_I32).view(-1, ROW_WORDS)
        if padded <= GROUP_ROWS * ROW_BYTES:  # one group at most (norms, biases): fewest calls, no scratch
            self.buffer[start : start + n].copy_(src)
            if n < padded:
                self.buffer[start + n : start + padded].zero_()
            rows = words.sum(dim=1, dtype=_I32)
            self.tensors.append(((rows * _row_weights(rows.numel())).sum(dim=1, dtype=_I32), words.sum(dim=0, dtype=_I32)))
            return
        step_rows = PACK_STEP_BYTES // ROW_BYTES
        rows = _scratch("rows", words.shape[0])[: words.shape[0]]
        full_steps, last_rows = divmod(words.shape[0], step_rows)
        groups = _scratch("groups", full_steps * -(-step_rows // GROUP_ROWS) + -(-last_rows // GROUP_ROWS))
        group = 0
        for lo in range(0, padded, PACK_STEP_BYTES):
            hi = min(lo + PACK_STEP_BYTES, n)
            self.buffer[start + lo : start + hi].copy_(src[lo:hi])
            if hi == n and n < padded:
                self.buffer[start + n : start + padded].zero_()
            row = lo // ROW_BYTES
            block = words[row : row + step_rows]
            torch.sum(block, dim=1, dtype=_I32, out=rows[row : row + block.shape[0]])
            whole, rest = divmod(block.shape[0], GROUP_ROWS)
            if whole:
                grouped = block[: whole * GROUP_ROWS].view(whole, GROUP_ROWS, ROW_WORDS)
                torch.sum(grouped, dim=1, dtype=_I32, out=groups[group : group + whole])
            if rest:
                torch.sum(block[whole * GROUP_ROWS :], dim=0, dtype=_I32, out=groups[group + whole])
            group += whole + (rest > 0)
        row_parts = (rows * _row_weights(rows.numel())).sum(dim=1, dtype=_I32)
        self.tensors.append((row_parts, groups[:group].sum(dim=0, dtype=_I32)))

    def skip(self) -> None:
        """The next tensor of the bucket is copied elsewhere (a GPU source); its row of :meth:`finish` is meaningless."""
        self.tensors.append(None)

    def finish(self) -> torch.Tensor:
        """The ``(n, 3)`` partial sums of the bucket's tensors, for :func:`finish_checksums`."""
        zeros = (torch.zeros(2, dtype=_I32), torch.zeros(ROW_WORDS, dtype=_I32))
        row_parts, cols = zip(*(t if t is not None else zeros for t in self.tensors), strict=True)
        col_weighted = (torch.stack(cols) * _arange(_CPU, 1, ROW_WORDS)).sum(dim=1, dtype=_I32)
        return torch.cat([torch.stack(row_parts), col_weighted.view(-1, 1)], dim=1)


_scratches = threading.local()
_row_weights_all = torch.ones(2, 0, dtype=_I32)


def _row_weights(rows: int) -> torch.Tensor:
    """``[[1, 1, ..., 1], [1, 2, ..., rows]]`` (int32; views of one buffer grown to the most rows asked for): a
    tensor's row sums times this, summed over the rows, are its ``[word_sum, row_weighted]``."""
    global _row_weights_all
    if _row_weights_all.shape[1] < rows:
        _row_weights_all = torch.stack([torch.ones(rows, dtype=_I32), torch.arange(1, rows + 1, dtype=_I32)])
    return _row_weights_all[:, :rows]


def _scratch(name: str, rows: int) -> torch.Tensor:
    """A per-thread int32 scratch reused by every tensor (a fresh allocation of this size would fault its pages
    in again each time): at least ``rows`` x 128 words for ``"groups"``, at least ``rows`` words otherwise."""
    have: torch.Tensor | None = getattr(_scratches, name, None)
    if have is None or have.shape[0] < rows:
        have = torch.empty((rows, ROW_WORDS) if name == "groups" else (rows,), dtype=_I32)
        setattr(_scratches, name, have)
    return have


def compute_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    """``{name: tensor_checksum(t)}`` in iteration order (the order ``verify_checksums`` reports in)."""
    named = list(named_tensors)
    by_device: dict[Any, list[int]] = {}
    for i, (_, t) in enumerate(named):
        by_device.setdefault(t.device, []).append(i)
    out: list[list[int]] = [[] for _ in named]
    for indices in by_device.values():
        tensors = [named[i][1] for i in indices]
        sums = finish_checksums([t.numel() * t.element_size() for t in tensors], start_checksums(tensors))
        for i, s in zip(indices, sums, strict=True):
            out[i] = s
    return {name: s for (name, _), s in zip(named, out, strict=True)}


def verify_checksums(
    expected: Mapping[str, Sequence[int]],
    actual: Mapping[str, Sequence[int]],
    *,
    require_all: bool = True,
    context: str = "",
) -> None:
    """Raise ``WeightVerificationError`` naming the first parameter (in ``expected`` order) that differs.

    ``require_all``: a parameter in ``expected`` that the receiver never saw is an error too; an
    extra parameter on the receiver side is always an error (the sender did not send it).
    """
    where = f" ({context})" if context else ""
    for name, want in expected.items():
        got = actual.get(name)
        if got is None:
            if require_all:
                raise WeightVerificationError(
                    f"parameter {name!r} was sent but never received{where}; "
                    f"received {len(actual)} of {len(expected)} parameters",
                    parameter=name,
                )
            continue
        if [int(x) for x in got] != [int(x) for x in want]:
            raise WeightVerificationError(
                f"parameter {name!r} differs after loading{where}: sender checksum "
                f"[nbytes, word_sum, weighted_sum]={list(want)}, receiver {list(got)}",
                parameter=name,
            )
    extra = [n for n in actual if n not in expected]
    if extra:
        raise WeightVerificationError(f"receiver holds parameters the sender never sent{where}: {extra[:5]}")
