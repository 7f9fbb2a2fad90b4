"""The adapter in PEFT's layout: tensor names, adapter_config.json, and loading it back.

PEFT names a LoRA tensor after the module it wraps inside `PeftModel(Qwen*ForCausalLM)`, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`; trained norms are saved the way
PEFT saves `modules_to_save`, under the norm's own name.
"""

from __future__ import annotations

import torch

from qlora_cli.config import TrainConfig
from qlora_cli.errors import QLoraError

PREFIX = "base_model.model."


def _module_path(proj: str) -> str:
    return ("self_attn." if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp.") + proj


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """Every trainable tensor of the model under its PEFT name (live parameters, not copies)."""
    named: dict[str, torch.Tensor] = {}
    for index, layer in enumerate(model.layers):
        base = f"{PREFIX}model.layers.{index}."
        for group in layer.projections.values():
            for proj, a in group.lora_A.items():
                named[f"{base}{_module_path(proj)}.lora_A.weight"] = a
                named[f"{base}{_module_path(proj)}.lora_B.weight"] = group.lora_B[proj]
        if model.lora is not None and model.lora.train_norms:
            named[f"{base}input_layernorm.weight"] = layer.input_layernorm
            named[f"{base}post_attention_layernorm.weight"] = layer.post_attention_layernorm
            if layer.q_norm is not None:
                named[f"{base}self_attn.q_norm.weight"] = layer.q_norm
                named[f"{base}self_attn.k_norm.weight"] = layer.k_norm
    if model.lora is not None and model.lora.train_norms:
        named[f"{PREFIX}model.norm.weight"] = model.norm
    return named


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().to("cpu", torch.float32).contiguous() for name, t in trainable_tensors(model).items()
    }


def norm_module_names(model) -> list[str]:
    """The norm modules a PEFT adapter must list in modules_to_save when norms train."""
    if model.lora is None or not model.lora.train_norms:
        return []
    names = ["input_layernorm", "post_attention_layernorm", "norm"]
    if model.spec.qk_norm:
        names += ["q_norm", "k_norm"]
    return names


def adapter_config(model, config: TrainConfig) -> dict:
    lora = model.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.base_model,
        "revision": config.revision,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": sorted(lora.target_modules),
        "modules_to_save": norm_module_names(model) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
    }


def load_adapter_state(model, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Copy saved adapter tensors into the live parameters, refusing any that do not fit."""
    live = trainable_tensors(model)
    missing = [name for name in live if name not in tensors]
    if missing:
        raise QLoraError(
            f"{source}: adapter has no tensor {missing[0]} (was it trained with other LoRA targets?)"
        )
    for name, param in live.items():
        saved = tensors[name]
        if saved.shape != param.shape:
            raise QLoraError(
                f"{source}: adapter tensor {name} has shape {list(saved.shape)}, the model needs {list(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(saved)
