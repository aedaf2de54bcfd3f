"""The SM copy kernel's span table (CPU: the kernel itself runs in tests/transport/test_gpu.py)."""

from __future__ import annotations

from rlix_plugins.transport._copy_kernel import SPAN_BYTES, span_table


def test_span_table_splits_copies_into_spans_in_the_widest_word() -> None:
    src, dst = 1 << 40, 1 << 41
    rows, word = span_table(src, [(dst, 0, 2 * SPAN_BYTES + 8), (dst + (4 << 20), 2 * SPAN_BYTES + 512, 2 * SPAN_BYTES + 520)])
    assert word == 8
    assert rows == [
        (src, dst, SPAN_BYTES // 8),
        (src + SPAN_BYTES, dst + SPAN_BYTES, SPAN_BYTES // 8),
        (src + 2 * SPAN_BYTES, dst + 2 * SPAN_BYTES, 1),
        (src + 2 * SPAN_BYTES + 512, dst + (4 << 20), 1),
    ]
    # any address or size that is not a multiple of 8 narrows the word for the whole layout
    assert span_table(src, [(dst, 0, 12)])[1] == 4
    assert span_table(src + 2, [(dst, 0, 8)])[1] == 2
    assert span_table(src, [(dst + 1, 0, 8)]) == ([(src, dst + 1, 8)], 1)
    assert span_table(src, []) == ([], 8)
