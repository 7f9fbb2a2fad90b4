"""Whether a str is text a tokenizer takes: JSON's \\ud800 escapes, and bytes that are not UTF-8 from a
command line or terminal (Python's surrogateescape), leave lone surrogates, which it refuses."""

from __future__ import annotations


def text_problem(text: str) -> str | None:
    """Why `text` cannot be tokenized, or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        what = f"byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"lone surrogate U+{code:04X}"
        return f"is not UTF-8 text ({what} at character {err.start + 1})"
    return None
