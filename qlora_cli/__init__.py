"""qlora: QLoRA fine-tuning of Qwen2, Qwen2.5 and Qwen3 models on our own Triton kernels."""

__version__ = "0.1.0"
