"""Triton kernels for the QLoRA decoder block, each beside its plain-torch reference.

Every module has the same five parts: reference, Triton kernel(s), launcher, autograd Function,
public function. The public function runs Triton on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1, which is how CI checks kernels) and the reference otherwise. Where triton is
not installed (pyproject installs it on Linux only) the kernels are not defined and every call
runs the reference. `formats/` is no op: it says what each frozen-weight format (NF4, a plain
tensor) can do, for the ops and the model to ask.
"""

import sys


def _hugging_face_kernels_spec():
    """Imported as `kernels` (the repository root is on sys.path under `python -m` from it), this folder
    shadows Hugging Face's `kernels`, which transformers imports when it is installed: find that one."""
    import importlib.machinery
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != root]
    return importlib.machinery.PathFinder.find_spec("kernels", rest)


_spec = _hugging_face_kernels_spec() if __name__ == "kernels" else None
if _spec is not None:
    # The importer reads sys.modules after this body runs, so the replacement is what `import` returns.
    import importlib.util

    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
else:
    # Without Hugging Face's package transformers still probes `kernels`, finds this folder and imports
    # it; with no __version__ here it counts the package as absent.
    from qlora_kernels._dispatch import TRITON_AVAILABLE, triton_setup_error

    __all__ = ["TRITON_AVAILABLE", "triton_setup_error"]
