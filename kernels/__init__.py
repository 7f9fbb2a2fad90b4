"""Triton kernels for the QLoRA decoder block, each beside its plain-torch reference.

Every module has the same five parts: reference, Triton kernel(s), launcher, autograd Function,
public function. The public function runs Triton on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1, which is how CI checks kernels) and the reference otherwise. Where triton is
not installed (pyproject installs it on Linux only) the kernels are not defined and every call
runs the reference. `formats/` is no op: it says what each frozen-weight format (NF4, a plain
tensor) can do, for the ops and the model to ask.
"""

from qlora_kernels._dispatch import TRITON_AVAILABLE, triton_setup_error

__all__ = ["TRITON_AVAILABLE", "triton_setup_error"]
