"""qlora: QLoRA fine-tuning of Qwen2 and 2.5, Qwen3, Qwen3.5/3.6 (and their MoE), Llama 3 and Mistral models on our own Triton kernels."""

__version__ = "0.1.0"
