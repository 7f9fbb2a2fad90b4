"""Axolotl's keys that are not qlora's own: each one is mapped onto a qlora key, noted as already
how qlora works, or refused with what to change.

Axolotl configs carry many keys for features qlora does its own way (fused kernels, flash
attention, 8-bit optimizers, sharded data parallel) or lacks. Translating them here, before the
typed check in config.py, keeps that check about qlora's own keys and lets one error list every
problem of a config. A key whose value is empty, null or false asks for nothing: it is accepted
without a note, whatever qlora thinks of the feature.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_ATTENTION = "qlora's attention is always fused (its own Triton kernel or torch's; the 'attention' key picks)"
_LORA_KERNELS = "qlora's NF4 + LoRA projections always run as fused kernels (QKV and gate/up in one each)"
_CROSS_ENTROPY = "qlora's lm_head + cross-entropy is always fused and chunked: full logits are never built"
_NORM = "qlora's RMSNorm (with the residual add) is always a fused kernel"
_ROPE = "qlora's RoPE (with QK-norm on Qwen3) is always a fused kernel"
_SWIGLU = "qlora's SwiGLU is always a fused kernel"
_COMPILE = "qlora's hot paths are hand-written Triton kernels; torch.compile is not used"
_ARCHITECTURE = "the architecture is read from the model's config.json"
_TOKENIZER = "qlora reads the model's tokenizer.json with the tokenizers library"
_SCALE = (
    "qlora runs several GPUs as data parallel (--nproc or torchrun): each GPU holds the whole NF4 "
    "model, nothing is sharded"
)
_DDP = "qlora sets up DDP itself for data parallel"
_LOADER = "qlora tokenizes before training and builds each batch in the training process"
_PACKING = "qlora packs rows with its own planner"
_EVAL_SAMPLES = (
    "evaluation logs eval_loss and eval_ppl, no sample answers: run `qlora generate` on a checkpoint"
)

# The value changes nothing: qlora already works this way. One note names the keys that share a reason.
ALREADY_KEYS = {
    "flash_attention": _ATTENTION,
    "sdp_attention": _ATTENTION,
    "xformers_attention": _ATTENTION,
    "flex_attention": _ATTENTION,
    "attn_implementation": _ATTENTION,
    "lora_mlp_kernel": _LORA_KERNELS,
    "lora_qkv_kernel": _LORA_KERNELS,
    "lora_o_kernel": _LORA_KERNELS,
    "unsloth_lora_mlp": _LORA_KERNELS,
    "unsloth_lora_qkv": _LORA_KERNELS,
    "unsloth_lora_o": _LORA_KERNELS,
    "flash_attn_fuse_qkv": _LORA_KERNELS,
    "flash_attn_fuse_mlp": _LORA_KERNELS,
    "cut_cross_entropy": _CROSS_ENTROPY,
    "liger_cross_entropy": _CROSS_ENTROPY,
    "liger_fused_linear_cross_entropy": _CROSS_ENTROPY,
    "flash_attn_cross_entropy": _CROSS_ENTROPY,
    "unsloth_cross_entropy_loss": _CROSS_ENTROPY,
    "liger_rms_norm": _NORM,
    "liger_layer_norm": _NORM,
    "flash_attn_rms_norm": _NORM,
    "unsloth_rms_norm": _NORM,
    "liger_rope": _ROPE,
    "unsloth_rope": _ROPE,
    "fused_attn_kernel": _ROPE,
    "liger_glu_activation": _SWIGLU,
    "torch_compile": _COMPILE,
    "torch_compile_backend": _COMPILE,
    "torch_compile_mode": _COMPILE,
    "tf32": "qlora computes in bf16 (with bf16: false, fp32 matmuls keep torch's full precision)",
    "strict": "qlora always checks keys strictly",
    "local_rank": "torchrun gives each process its rank (qlora train --nproc N)",
    "debug": "`qlora data CONFIG --show N` prints tokenized rows with the trained tokens marked",
    "eval_table_size": _EVAL_SAMPLES,
    "eval_max_new_tokens": _EVAL_SAMPLES,
    "save_only_model": "checkpoints always hold the optimizer state too, so a resume continues exactly",
    "model_type": _ARCHITECTURE,
    "model_config_type": _ARCHITECTURE,
    "is_llama_derived_model": _ARCHITECTURE,
    "is_qwen_derived_model": _ARCHITECTURE,
    "is_mistral_derived_model": _ARCHITECTURE,
    "is_falcon_derived_model": _ARCHITECTURE,
    "tokenizer_type": _TOKENIZER,
    "tokenizer_use_fast": _TOKENIZER,
    "tokenizer_legacy": _TOKENIZER,
    "trust_remote_code": "qlora builds Qwen2/Qwen3 from its own code and never runs code from a model repo",
    "gradient_checkpointing_kwargs": "qlora recomputes layers with its own checkpointing (never reentrant)",
    "group_by_length": "qlora packs or pads per micro-batch",
    "pad_to_sequence_len": "packed rows fill sequence_len; unpacked micro-batches pad to their longest row",
    "sample_packing_eff_est": _PACKING,
    "sample_packing_group_size": _PACKING,
    "sample_packing_bin_size": _PACKING,
    "multipack_real_batches": _PACKING,
    "pretrain_multipack_attn": _PACKING,
    "dataloader_num_workers": _LOADER,
    "dataloader_pin_memory": _LOADER,
    "dataloader_prefetch_factor": _LOADER,
    "fsdp": _SCALE,
    "fsdp_config": _SCALE,
    "fsdp_version": _SCALE,
    "deepspeed": _SCALE,
    "ddp_timeout": _DDP,
    "ddp_bucket_cap_mb": _DDP,
    "ddp_broadcast_buffers": _DDP,
    "ddp_find_unused_parameters": _DDP,
    "include_tokens_per_second": "tokens per second are always logged",
    "save_safetensors": "qlora always writes safetensors",
    "eval_batch_size": "evaluation uses micro_batch_size",
    "dataset_prepared_path": "qlora tokenizes in memory at the start of each run; nothing is cached",
    "dataset_processes": "the Rust tokenizer already uses every core",
    "dataset_num_proc": "the Rust tokenizer already uses every core",
    "shuffle_merged_datasets": "qlora shuffles the training rows every epoch, by seed",
}

_NO_NEW_TOKENS = "qlora cannot add tokens, the embeddings stay frozen: use tokens the vocabulary has"

# Honouring these needs a feature qlora lacks, and ignoring them would change the run: refused when set.
REFUSED_KEYS = {
    "fp16": "qlora computes in bf16 or fp32: remove it and set bf16: true (or auto), or bf16: false",
    "float16": "qlora computes in bf16 or fp32: remove it and set bf16: true (or auto), or bf16: false",
    "lora_modules_to_save": "only LoRA adapters (and norms, with train_norms: true) train here: remove it",
    "unfrozen_parameters": "only LoRA adapters (and norms, with train_norms: true) train here: remove it",
    "peft_use_dora": "DoRA is not implemented: remove it for plain LoRA",
    "loraplus_lr_ratio": "LoRA+ is not implemented: remove it for one learning rate",
    "lora_fan_in_fan_out": "Qwen's projections are plain linear layers: remove it",
    "peft_layers_to_transform": "LoRA goes on every layer: remove it",
    "lora_layers_to_transform": "LoRA goes on every layer: remove it",
    "tokens": _NO_NEW_TOKENS,
    "added_tokens_overrides": _NO_NEW_TOKENS,
    "tokenizer_config": "the tokenizer is read from base_model's folder: remove it",
    "base_model_config": "config.json is read from base_model's folder: remove it",
    "hub_model_id": "qlora does not upload: remove it and upload output_dir after training (`hf upload`)",
    "push_dataset_to_hub": "qlora does not upload: remove it",
    "rl": "qlora trains supervised fine-tuning only: remove it",
    "reward_model": "qlora trains supervised fine-tuning only: remove it",
    "process_reward_model": "qlora trains supervised fine-tuning only: remove it",
    "s2_attention": "shifted sparse attention would change the model's attention: remove it",
    "neftune_noise_alpha": "NEFTune embedding noise is not implemented: remove it",
    "early_stopping_patience": "early stopping is not implemented: remove it and pick max_steps or num_epochs",
}

# Axolotl's optimizer names that qlora runs as fused AdamW: LoRA's optimizer state is small (two fp32
# moments of the adapters), so 8-bit, 4-bit or paged state would save little and cost accuracy.
ADAMW_VARIANTS = {
    "adamw_bnb_8bit",
    "adamw_8bit",
    "paged_adamw_8bit",
    "paged_adamw_32bit",
    "paged_adamw",
    "adamw_torch_4bit",
    "adamw_torch_8bit",
    "ao_adamw_4bit",
    "ao_adamw_8bit",
    "ao_adamw_fp8",
    "adamw_anyprecision",
    "adamw_hf",
    "adamw_apex_fused",
    "optimi_adamw",
}
OPTIMIZER_ALIASES = {"adamw": "adamw_torch"}

# Liger and Cut Cross Entropy do what qlora's own kernels already do; other plugins add behaviour.
KNOWN_PLUGINS = {
    "axolotl.integrations.liger.LigerPlugin": "Liger's kernels",
    "axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin": "Cut Cross Entropy",
}


def is_unset(value: Any) -> bool:
    """Empty, null or false: the key asks for nothing."""
    return value is None or value is False or value == "" or value == [] or value == {}


@dataclass
class Translation:
    """A config in qlora's own keys, with the notes to print and the problems found on the way."""

    raw: dict
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def _plugins(value: Any, out: Translation) -> None:
    names = value if isinstance(value, list) else [value]
    for name in names:
        if name in KNOWN_PLUGINS:
            out.notes.append(f"plugins: {KNOWN_PLUGINS[name]} do what qlora's fused kernels already do")
        else:
            out.problems.append(
                f"config key 'plugins': {name!r} is not supported (only Liger and Cut Cross Entropy, whose "
                "work qlora's kernels already do): remove it"
            )


def _load_in_8bit(value: Any, out: Translation) -> None:
    if out.raw.get("load_in_4bit") is True:
        out.problems.append(
            "config keys 'load_in_8bit' and 'load_in_4bit' are both true: keep load_in_4bit for NF4 (QLoRA)"
        )
        return
    out.raw["load_in_4bit"] = False
    out.notes.append(
        "load_in_8bit: qlora has no 8-bit base, so the base stays in bf16 (twice the memory of 8-bit); "
        "load_in_4bit: true with adapter: qlora takes half of it"
    )


def _bfloat16(value: Any, out: Translation) -> None:
    out.raw.setdefault("bf16", True)


def _optimizer(value: Any, out: Translation) -> None:
    if value in ADAMW_VARIANTS:
        out.raw["optimizer"] = "adamw_torch_fused"
        out.notes.append(
            f"optimizer: {value} runs as fused AdamW (adamw_torch_fused): LoRA's optimizer state is small"
        )
    elif value in OPTIMIZER_ALIASES:
        out.raw["optimizer"] = OPTIMIZER_ALIASES[value]
    else:
        out.raw["optimizer"] = value


def _gradient_checkpointing(value: Any, out: Translation) -> None:
    if value == "offload":
        out.raw["gradient_checkpointing"] = True
        if out.raw.get("activation_offloading") is False:
            out.problems.append(
                "config key 'gradient_checkpointing': 'offload' asks for activation offloading, and "
                "activation_offloading is false: remove one of them"
            )
        out.raw["activation_offloading"] = True
    elif value == "offload_disk":
        out.problems.append(
            "config key 'gradient_checkpointing': 'offload_disk' is not supported: qlora offloads to host "
            "memory (use 'offload')"
        )
    else:
        out.raw["gradient_checkpointing"] = value


MAPPED_KEYS = {
    "plugins": _plugins,
    "load_in_8bit": _load_in_8bit,
    "bfloat16": _bfloat16,
    "optimizer": _optimizer,
    "gradient_checkpointing": _gradient_checkpointing,
}
# qlora's own keys among them: Axolotl spells some of their values differently.
_OWN_KEYS_MAPPED = {"optimizer", "gradient_checkpointing"}


def _conversation(datasets: Any, key: str, out: Translation) -> Any:
    """Axolotl's older `conversation:` of a dataset named the FastChat template of `type: sharegpt`;
    its `chatml` is qlora's `chat_template: chatml`, and the others have no template of that name here."""
    if not isinstance(datasets, list):
        return datasets
    entries = []
    for index, entry in enumerate(datasets):
        if isinstance(entry, dict) and "conversation" in entry:
            entry = dict(entry)
            name, where = entry.pop("conversation"), f"{key}[{index}]"
            if name == "chatml" and entry.get("chat_template") in (None, "chatml"):
                entry["chat_template"] = "chatml"
                out.notes.append(f"{where}.conversation: chatml is chat_template: chatml")
            elif not is_unset(name):
                out.problems.append(
                    f"config key '{where}.conversation' is Axolotl's older FastChat template name for "
                    f"type: sharegpt; write chat_template: chatml, tokenizer_default or jinja (with "
                    f"chat_template_jinja) on the dataset instead of conversation: {name}"
                )
        entries.append(entry)
    return entries


def translate(raw: dict) -> Translation:
    """Axolotl's keys in `raw` turned into qlora's, with a note per noted key and every refusal."""
    out = Translation(raw={k: v for k, v in raw.items() if not _is_axolotl_only(k)})
    for key in ("datasets", "test_datasets"):
        if key in out.raw:
            out.raw[key] = _conversation(out.raw[key], key, out)
    already: dict[str, list[str]] = {}
    for key, value in raw.items():
        if is_unset(value):
            continue
        if key in MAPPED_KEYS:
            MAPPED_KEYS[key](value, out)
        elif key in ALREADY_KEYS:
            already.setdefault(ALREADY_KEYS[key], []).append(key)
        elif key in REFUSED_KEYS:
            out.problems.append(f"config key '{key}' is not supported: {REFUSED_KEYS[key]}")
    out.notes += [f"{', '.join(keys)}: {reason}" for reason, keys in already.items()]
    return out


def _is_axolotl_only(key: Any) -> bool:
    return key in ALREADY_KEYS or key in REFUSED_KEYS or (key in MAPPED_KEYS and key not in _OWN_KEYS_MAPPED)
