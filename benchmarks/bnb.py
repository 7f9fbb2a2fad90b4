"""The transformers + bitsandbytes baseline model as QLoRA users load it: NF4 with double quantization,
bf16 compute, SDPA attention. The training and the decoding baselines load the same one; the GPU tests
also load it in fp32, to see how far bf16 moves transformers' own numbers."""

from __future__ import annotations

import torch


def load_nf4_model(checkpoint, device: str, dtype: torch.dtype = torch.bfloat16):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quantization = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
    )
    return AutoModelForCausalLM.from_pretrained(
        str(checkpoint),
        quantization_config=quantization,
        dtype=dtype,
        device_map={"": device},
        attn_implementation="sdpa",
    )
