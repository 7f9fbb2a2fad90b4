"""Triton kernels for the QLoRA decoder block, each beside its plain-torch reference.

Every module has the same five parts: reference, Triton kernel(s), launcher, autograd Function,
public function. The public function runs Triton on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1, which is how CI checks kernels) and the reference otherwise. Where triton is
not installed (pyproject installs it on Linux only) the kernels are not defined and every call
runs the reference. `formats/` is no op: it says what each frozen-weight format (NF4, a plain
tensor) can do, for the ops and the model to ask.
"""

import sys

if __name__ == "kernels":
    # Imported as `kernels`: the repository root is on sys.path (`python -m` from it) and this folder
    # shadows Hugging Face's `kernels`, which transformers imports when it is installed. Hand over to
    # that package, the next `kernels` on the path, as the importer then reads sys.modules.
    import importlib.machinery
    import importlib.util
    import os

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != _root]
    _spec = importlib.machinery.PathFinder.find_spec("kernels", _rest)
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (this folder installs as qlora_kernels)")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module
    _spec.loader.exec_module(_module)
else:
    from qlora_kernels._dispatch import TRITON_AVAILABLE, triton_setup_error

    __all__ = ["TRITON_AVAILABLE", "triton_setup_error"]
