"""qlora: QLoRA fine-tuning of Qwen2, Qwen2.5, Qwen3, Qwen3 MoE, Qwen3.5/3.6, Qwen3.5/3.6 MoE, Llama 3.x and Mistral models on our own Triton kernels."""

__version__ = "0.1.0"
