"""The client's event-stream line splitter: the specification's line ends only, however the
bytes arrive."""

from __future__ import annotations

import pytest

from tokenspeed_aio.client.stream import event_stream_lines

STREAM = (
    'data: {"text": "one\u2028two\u2029three\x85four"}\r\n\r\ndata: é\rdata: x\n\ndata: [DONE]\r'
)
LINES = [
    'data: {"text": "one\u2028two\u2029three\x85four"}',
    "",
    "data: é",
    "data: x",
    "",
    "data: [DONE]",
]


async def _chunks(data: bytes, size: int):
    for start in range(0, len(data), size):
        yield data[start : start + size]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
async def test_lines_end_at_crlf_lf_and_cr_alone_in_any_chunking(size):
    """Chunks of one byte cut CRLFs and the two-byte é in two; U+2028, U+2029 and U+0085 stay
    inside their line."""
    lines = [line async for line in event_stream_lines(_chunks(STREAM.encode(), size))]
    assert lines == LINES


async def test_an_unterminated_last_line_is_read():
    assert [line async for line in event_stream_lines(_chunks(b"a\nb", 1))] == ["a", "b"]
