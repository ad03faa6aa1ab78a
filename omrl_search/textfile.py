"""Reading the text files users hand us (task files, results, imports) as UTF-8, with a bad byte
reported as ``FILE:LINE: not UTF-8 text (byte 0x.. at column C)``: one line that says where,
not Python's bare ``'utf-8' codec can't decode ...`` (whose first argument is just ``utf-8``)."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator


def decode_utf8(data: bytes, path: "str | Path", first_line: int = 1) -> str:
    """``data`` decoded, or a ValueError naming the line (counted from ``first_line``) and the
    column of the first byte that is not UTF-8, or of the first NUL byte (valid UTF-8, but no
    text file holds one: a parquet or other binary file whose first bytes happen to decode)."""
    try:
        text = data.decode("utf-8")
        end = len(data)
    except UnicodeDecodeError as exc:
        text, end = "", exc.start
    nul = data.find(b"\0", 0, end)
    if nul < 0 and end == len(data):
        return text
    bad = nul if nul >= 0 else end
    line = first_line + data.count(b"\n", 0, bad)
    column = bad - (data.rfind(b"\n", 0, bad) + 1) + 1
    what = "not text (a NUL byte" if nul >= 0 else f"not UTF-8 text (byte 0x{data[bad]:02x}"
    raise ValueError(f"{path}:{line}: {what} at column {column}; a binary file?)")


def read_utf8(path: "str | Path") -> str:
    """The whole file as text (OSError as usual; a bad byte: :func:`decode_utf8`'s error)."""
    return decode_utf8(Path(path).read_bytes(), path)


def utf8_lines(path: "str | Path") -> Iterator[tuple[int, str]]:
    """(line number from 1, line) for each line of a file read as it goes (large JSONL files);
    a bad byte fails at its line with :func:`decode_utf8`'s error."""
    with Path(path).open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            yield lineno, decode_utf8(raw, path, lineno)
