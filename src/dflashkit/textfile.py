"""Users' text files (configs, chat templates): read as UTF-8, or a named error.

Usage:
    text = read_utf8(Path("run.yaml"), "config file")   # UsageError (exit 2): file:line:col, the byte, iconv
"""

from __future__ import annotations

import codecs
from pathlib import Path

from dflashkit.errors import UsageError


def read_utf8(path: str | Path, what: str) -> str:
    """The text of a user's file, which must be UTF-8 (a leading byte-order mark is dropped). Anything
    else is exit 2 naming the file, the line, the column and the byte offset of the first bad byte
    (UTF-16 / UTF-32 by their byte-order mark), with the command that converts it."""
    path = Path(path)
    raw = path.read_bytes()
    fix = f"save it as UTF-8, e.g. `iconv -f {{enc}} -t UTF-8 {path} > {path.stem}.utf8{path.suffix}`"
    for bom, enc in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                     (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if raw.startswith(bom):
            raise UsageError(f"{path}: {what} is {enc} (byte-order mark at byte 0); dflashkit reads UTF-8",
                             hint=fix.format(enc=enc))
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        col = e.start - (raw.rfind(b"\n", 0, e.start) + 1) + 1
        raise UsageError(f"{path}:{line}:{col}: {what} is not UTF-8 (byte 0x{raw[e.start]:02x} at offset "
                         f"{e.start}: {e.reason})", hint=fix.format(enc="LATIN1")) from None
