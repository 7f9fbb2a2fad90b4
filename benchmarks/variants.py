"""`--variant KEY=N,...`: a kernel timed with some of its module's launch settings replaced, beside
the shipped settings in the same call, so a setting is chosen from one call's numbers."""

from __future__ import annotations

import contextlib
from collections.abc import Callable


@contextlib.contextmanager
def patched(overrides: dict):
    """Modules with some settings replaced while timing: {(module, name): value}, {} as shipped."""
    defaults = {key: getattr(*key) for key in overrides}
    for (module, name), value in overrides.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for (module, name), value in defaults.items():
            setattr(module, name, value)


def variant(text: str, keys: dict[str, Callable[[int], dict]]) -> dict:
    """`KEY=N,KEY=N` as the module settings it replaces, each KEY one of `keys`."""
    overrides = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in keys or not value.isdigit():
            raise SystemExit(f"--variant {text!r}: each item is KEY=N with KEY one of {', '.join(keys)}")
        overrides |= keys[key](int(value))
    return overrides
