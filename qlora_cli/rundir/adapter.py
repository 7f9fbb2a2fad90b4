"""The adapter in PEFT's layout: tensor names, adapter_config.json, and loading it back.

PEFT names a LoRA tensor after the module it wraps inside `PeftModel(<the base's class>)`, e.g.
`base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`, or `...layers.0.linear_attn.in_proj_qkv...`
in a Qwen3.5 Gated DeltaNet layer; a vision-language checkpoint's decoder sits under
`model.language_model.` (ModelSpec.decoder_prefix). Trained norms are saved the way PEFT saves
`modules_to_save`, under the norm's own name.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from qlora_cli.config.schema import TrainConfig
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.model.mixers import MIXERS
from qlora_cli.model.mlps.expert_lora import EXPERTS_MODULE, target_parameters, wrapper_paths
from qlora_cli.rundir.names import ADAPTER_CONFIG, ADAPTER_WEIGHTS
from qlora_cli.sources.spec import DECODER_PREFIX

PREFIX = "base_model.model."


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """Every trainable tensor of the model under its PEFT name (live parameters, not copies)."""
    named: dict[str, torch.Tensor] = {}
    decoder = PREFIX + model.spec.decoder_prefix
    for index, layer in enumerate(model.layers):
        base = f"{decoder}layers.{index}."
        for group in layer.projections.values():
            for proj, a in group.lora_A.items():
                module = f"{base}{layer.module_of[proj]}.{proj}"
                named[f"{module}.lora_A.weight"] = a
                named[f"{module}.lora_B.weight"] = group.lora_B[proj]
        expert_lora = layer.mlp.expert_lora
        if expert_lora is not None:
            for name, path in wrapper_paths(expert_lora.lora_A).items():
                module = f"{base}{EXPERTS_MODULE}.{path}"
                named[f"{module}lora_A.weight"] = expert_lora.lora_A[name]
                named[f"{module}lora_B.weight"] = expert_lora.lora_B[name]
        if model.lora is not None and model.lora.train_norms:
            named[f"{base}input_layernorm.weight"] = layer.input_layernorm
            named[f"{base}post_attention_layernorm.weight"] = layer.post_attention_layernorm
            mixer = layer.mixer
            for norm, weight in mixer.trained_norms().items():
                named[f"{base}{mixer.checkpoint_module}.{norm}.weight"] = weight
    if model.lora is not None and model.lora.train_norms:
        named[f"{decoder}norm.weight"] = model.norm
    return named


def adapter_state_dict(model) -> dict[str, torch.Tensor]:
    return {
        name: t.detach().to("cpu", torch.float32).contiguous() for name, t in trainable_tensors(model).items()
    }


def norm_module_names(model) -> list[str]:
    """The norm modules a PEFT adapter must list in modules_to_save when norms train.

    PEFT picks every module whose name ends with a listed one, so the final norm is named in full: a bare
    `norm` would also pick a vision tower's merger norm, which the adapter does not hold.
    """
    if model.lora is None or not model.lora.train_norms:
        return []
    names = ["input_layernorm", "post_attention_layernorm", model.spec.decoder_prefix + "norm"]
    for mixer in MIXERS.values():
        names += mixer.adapter_norms(model.spec)
    return names


def adapted_projections(model) -> set[str]:
    """The projections that carry LoRA in this model: the targeted ones its layers have."""
    return {proj for layer in model.layers for group in layer.projections.values() for proj in group.lora_A}


def adapter_config(model, config: TrainConfig) -> dict:
    lora = model.lora
    experts = {"target_parameters": target_parameters(lora.expert_targets)} if lora.expert_targets else {}
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": config.base_model,
        "revision": config.revision,
        "r": lora.r,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "use_rslora": lora.use_rslora,
        "target_modules": sorted(adapted_projections(model)),
        "modules_to_save": norm_module_names(model) or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        **experts,
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


# What an adapter's modules_to_save may name: the norms, as qlora writes them or PEFT users do.
NORM_MODULES = {
    "input_layernorm",
    "post_attention_layernorm",
    "norm",
    *(prefix + "norm" for prefix in DECODER_PREFIX.values()),
    *(norm for mixer in MIXERS.values() for norm in mixer.norm_modules),
}


def read_peft_adapter(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """adapter_config.json and adapter_model.safetensors of a PEFT LoRA adapter folder."""
    folder = Path(folder)
    try:
        saved = json.loads((folder / ADAPTER_CONFIG).read_text(encoding="utf-8"))
        tensors = load_file(str(folder / ADAPTER_WEIGHTS))
    except FileNotFoundError as err:
        raise QLoraError(
            f"lora_model_dir {folder}: no {Path(err.filename).name} (a PEFT adapter folder has "
            f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
        ) from None
    except (SafetensorError, OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise QLoraError(f"lora_model_dir {folder}: cannot read the adapter ({err})") from None
    if not isinstance(saved, dict) or saved.get("peft_type") != "LORA":
        raise QLoraError(f"lora_model_dir {folder}: {ADAPTER_CONFIG} is not a LoRA adapter's")
    return saved, tensors


def _adapter_targets(saved: dict, source: str) -> list[str]:
    targets = saved.get("target_modules")
    if targets == "all-linear":
        return list(ALL_PROJECTIONS)
    if isinstance(targets, str):
        targets = [targets]
    if not isinstance(targets, list) or not targets or set(targets) - set(ALL_PROJECTIONS):
        raise QLoraError(
            f"lora_model_dir {source}: target_modules {saved.get('target_modules')!r} are not among "
            f"{', '.join(ALL_PROJECTIONS)}"
        )
    return [p for p in ALL_PROJECTIONS if p in targets]


def adopt_adapter_shape(config: TrainConfig, saved: dict, source: str) -> tuple[TrainConfig, list[str]]:
    """The config with the shape of the adapter it starts from (rank, alpha, dropout, targets, rsLoRA,
    norms), as PEFT loads an adapter with its own settings; a note names each key that changed."""
    unsupported = [
        key
        for key in ("use_dora", "fan_in_fan_out", "layers_to_transform", "rank_pattern", "alpha_pattern")
        if saved.get(key)
    ]
    extra_modules = set(saved.get("modules_to_save") or []) - NORM_MODULES
    if unsupported or extra_modules:
        what = ", ".join(unsupported + sorted(extra_modules))
        raise QLoraError(f"lora_model_dir {source}: the adapter uses {what}, which qlora does not train")
    try:
        adopted = {
            "lora_r": int(saved["r"]),
            "lora_alpha": float(saved["lora_alpha"]),
            "lora_dropout": float(saved.get("lora_dropout") or 0.0),
            "peft_use_rslora": bool(saved.get("use_rslora", False)),
            "train_norms": bool(saved.get("modules_to_save")),
            "lora_target_parameters": list(saved.get("target_parameters") or []),
        }
    except (KeyError, TypeError, ValueError) as err:
        raise QLoraError(f"lora_model_dir {source}: {ADAPTER_CONFIG} has no valid {err}") from None
    targets = _adapter_targets(saved, source)
    changed = [
        f"{key} {getattr(config, key)!r} -> {value!r}"
        for key, value in adopted.items()
        if getattr(config, key) != value
    ]
    if set(config.target_modules) != set(targets):
        changed.append(f"lora_target_modules -> {targets}")
    adopted.update(lora_target_modules=targets, lora_target_linear=False)
    notes = (
        [f"lora_model_dir: training continues the adapter's shape ({'; '.join(changed)})"] if changed else []
    )
    if adopted["lora_target_parameters"] and adopted["lora_dropout"]:
        raise QLoraError(
            f"lora_model_dir {source}: the adapter puts LoRA on routed experts (target_parameters) with "
            f"lora_dropout {adopted['lora_dropout']:g}, which PEFT does not load; set lora_dropout to 0 in "
            f"its {ADAPTER_CONFIG}"
        )
    return dataclasses.replace(config, **adopted), notes
