"""The CUDA caching allocator's setting for training runs, chosen before CUDA starts."""

from __future__ import annotations

import os
from importlib.metadata import version


def prefer_expandable_segments() -> None:
    """Keep reserved memory close to allocated: with expandable segments the caching allocator grows
    one mapping instead of caching blocks of every odd size a long row allocates. It takes effect
    only before CUDA's allocator starts, so the CLI sets it first thing; a PYTORCH_CUDA_ALLOC_CONF
    or PYTORCH_ALLOC_CONF of the user's wins."""
    if "PYTORCH_CUDA_ALLOC_CONF" in os.environ or "PYTORCH_ALLOC_CONF" in os.environ:
        return
    major, minor = (int(part) for part in version("torch").split(".")[:2])
    name = "PYTORCH_ALLOC_CONF" if (major, minor) >= (2, 9) else "PYTORCH_CUDA_ALLOC_CONF"
    os.environ[name] = "expandable_segments:True"
