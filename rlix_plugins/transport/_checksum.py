"""Bit-exact tensor checksums: exact integer sums of the raw bytes, computed on the tensor's device.

``tensor_checksum(t) -> [nbytes, word_sum, weighted_sum]`` (plain ints, msgpack-safe, < 2**64):

* the tensor's bytes (zero-padded to an even count) are read as little-endian int16 words ``w[i]``;
* ``word_sum = sum(w[i])`` - any single flipped bit changes it;
* ``weighted_sum = sum(w[i] * (i mod CHUNK + 1) * (i // CHUNK + 1))`` mod 2**64 - catches swapped
  or shifted words that a plain sum would miss.

Every partial sum is exact in int64 (|w| < 2**15, weight < 2**22, CHUNK = 2**22 words), so CPU and
GPU give identical numbers regardless of reduction order. Floating-point tolerance is never used:
the same bytes in means the same numbers out, NaNs and -0.0 included.

Scratch: about ``24 * CHUNK`` bytes (~100 MiB) on the tensor's device per call, freed on return.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import torch

from rlix_plugins.errors import WeightVerificationError

#: int16 words per chunk; products w * weight stay below 2**37 and chunk sums below 2**59.
CHUNK_WORDS: Final = 1 << 22
#: Bytes of device scratch one checksum call may allocate (int64 copy of a chunk + weights + product).
CHECKSUM_SCRATCH_BYTES: Final = 3 * 8 * CHUNK_WORDS
_MASK64: Final = (1 << 64) - 1

_weights_cache: dict[torch.device, torch.Tensor] = {}


def _weights(device: torch.device) -> torch.Tensor:
    w = _weights_cache.get(device)
    if w is None:
        w = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=device)
        if device.type == "cpu":  # GPU copies are not cached: they would pin device memory forever
            _weights_cache[device] = w
    return w


def _words(tensor: torch.Tensor) -> torch.Tensor:
    flat = tensor.detach().contiguous().reshape(-1)
    raw = flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)
    if raw.numel() % 2:
        raw = torch.cat([raw, raw.new_zeros(1)])
    try:
        return raw.view(torch.int16)
    except RuntimeError:  # odd storage offset: view needs 2-byte alignment
        return raw.clone().view(torch.int16)


def tensor_checksum(tensor: torch.Tensor) -> list[int]:
    """``[nbytes, word_sum, weighted_sum]`` of the raw bytes; see the module docstring."""
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0:
        return [0, 0, 0]
    words = _words(tensor)
    weights = _weights(words.device)
    sums: list[torch.Tensor] = []
    weighted: list[torch.Tensor] = []
    for k, start in enumerate(range(0, words.numel(), CHUNK_WORDS)):
        chunk = words[start : start + CHUNK_WORDS].to(torch.int64)
        sums.append(chunk.sum())
        weighted.append((chunk * weights[: chunk.numel()]).sum())
        del chunk
        if k % 256 == 255:  # keep the number of pending 0-d results bounded
            sums = [torch.stack(sums).sum()]
    del weights
    chunk_weighted = torch.stack(weighted).tolist()
    weighted_sum = 0
    for k, value in enumerate(chunk_weighted):
        weighted_sum += int(value) * (k + 1)
    word_sum = int(torch.stack(sums).sum().item())
    return [nbytes, word_sum & _MASK64, weighted_sum & _MASK64]


def compute_checksums(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, list[int]]:
    """``{name: tensor_checksum(t)}`` in iteration order (the order ``verify_checksums`` reports in)."""
    return {name: tensor_checksum(t) for name, t in named_tensors}


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
                    f"received {len(actual)} of {len(expected)} parameters"
                )
            continue
        if [int(x) for x in got] != [int(x) for x in want]:
            raise WeightVerificationError(
                f"parameter {name!r} differs after loading{where}: sender checksum "
                f"[nbytes, word_sum, weighted_sum]={list(want)}, receiver {list(got)}"
            )
    extra = [n for n in actual if n not in expected]
    if extra:
        raise WeightVerificationError(f"receiver holds parameters the sender never sent{where}: {extra[:5]}")
