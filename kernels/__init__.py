"""Triton kernels for the QLoRA decoder block, each beside its plain-torch reference.

Every module has the same five parts: reference, Triton kernel(s), launcher, autograd Function,
public function. The public function runs Triton on CUDA tensors (and on CPU tensors under
TRITON_INTERPRET=1, which is how CI checks kernels) and the reference otherwise.
"""
