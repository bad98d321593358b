"""HTTP `Range: bytes=...` of a file of known size (RFC 9110 §14): pure.

    parse_range("bytes=0-99", 1000)  -> ByteRange(0, 99)      first and last byte, inclusive
    parse_range("bytes=900-", 1000)  -> ByteRange(900, 999)
    parse_range("bytes=-100", 1000)  -> ByteRange(900, 999)   the last 100 bytes (a suffix longer than the file: all)
    parse_range("bytes=1000-", 1000) -> raises Unsatisfiable  (answer 416 with `Content-Range: bytes */1000`)
    parse_range(None, 1000)          -> None                  (answer 200 with the whole file)

A last byte past the end is cut to the end; a first byte at or past the end, a zero-length suffix, or any range of
an empty file is unsatisfiable. What the RFC lets a server ignore is ignored (200 and the whole file): a header
that does not parse, another unit, a range whose last byte comes before its first, and several ranges (we do not
send multipart/byteranges).
"""

from __future__ import annotations

from dataclasses import dataclass

UNIT = "bytes"


@dataclass(frozen=True, slots=True)
class ByteRange:
    first: int
    last: int  # inclusive

    @property
    def length(self) -> int:
        return self.last - self.first + 1

    def content_range(self, size: int) -> str:
        return f"{UNIT} {self.first}-{self.last}/{size}"


class Unsatisfiable(ValueError):
    """No byte of the file is in the range: 416."""

    def __init__(self, size: int) -> None:
        super().__init__(f"the range asks for no byte of the {size} there are")
        self.size = size

    @property
    def content_range(self) -> str:
        return f"{UNIT} */{self.size}"


def parse_range(header: str | None, size: int) -> ByteRange | None:
    """The one range `header` asks for in a file of `size` bytes; None to send the whole file. Raises
    Unsatisfiable."""
    if header is None:
        return None
    unit, sep, spec = header.partition("=")
    if not sep or unit.strip().lower() != UNIT or "," in spec:
        return None
    first_text, dash, last_text = spec.strip().partition("-")
    first_text, last_text = first_text.strip(), last_text.strip()
    if not dash or not _digits(first_text, last_text):
        return None
    if not first_text:  # a suffix: the last N bytes
        if not last_text:
            return None
        suffix = int(last_text)
        if suffix == 0 or size == 0:
            raise Unsatisfiable(size)
        return ByteRange(max(0, size - suffix), size - 1)
    first = int(first_text)
    last = int(last_text) if last_text else size - 1
    if last_text and last < first:
        return None
    if first >= size:
        raise Unsatisfiable(size)
    return ByteRange(first, min(last, size - 1))


def _digits(*texts: str) -> bool:
    return all(text == "" or (text.isascii() and text.isdigit()) for text in texts)
