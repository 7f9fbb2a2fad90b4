"""Names every layer shares: the projections LoRA can target, the dataset types, the chat template names.

The rules that read them live with the config checks (qlora_cli/config/checks.py); the data layer and the
sources map each name to what it renders.
"""

# The projections LoRA can target, as transformers names them: an attention layer's and the MLP's (every
# family), and those of a Qwen3.5 linear-attention (Gated DeltaNet) layer. A model's adapter holds the
# targeted ones its layers have.
STANDARD_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LINEAR_ATTENTION_PROJECTIONS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")
ALL_PROJECTIONS = STANDARD_PROJECTIONS + LINEAR_ATTENTION_PROJECTIONS
# A MoE layer's routed experts as transformers 5 holds them, fused below `mlp.experts.`: the parameters
# LoRA on routed experts targets (PEFT's and Axolotl's `target_parameters`), in the order the module
# registers them, which is the order PEFT nests its wrappers in (qlora_cli/model/mlps/expert_lora.py).
EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
# What a user may name the routed experts by in lora_target_modules (the module, and the fused gate/up
# parameter): refused there rather than left untrained, since they are lora_target_parameters' to name.
ROUTED_EXPERT_TARGETS = ("experts", "gate_up_proj")

# Axolotl's ShareGPT types (deprecated there for chat_template) are chat_template, which reads
# `conversations` with from/value as well as `messages`.
_SHAREGPT_TYPES = (
    "sharegpt",
    "sharegpt:chat",
    "sharegpt:chatml",
    "sharegpt.load_role",
    "sharegpt.load_guanaco",
    "sharegpt.load_ultrachat",
    "sharegpt_simple",
    "sharegpt_simple.load_role",
)
# Each dataset `type` qlora reads, as (kind, style): kind is alpaca, chat, completion, text or
# input_output; style is alpaca's prompt layout (instruct, chat, chatml, or the chosen chat_template).
DATASET_TYPES = {
    "chat_template": ("chat", ""),
    "chat_template.default": ("chat", ""),
    **dict.fromkeys(_SHAREGPT_TYPES, ("chat", "")),
    "alpaca": ("alpaca", "instruct"),
    "alpaca_instruct": ("alpaca", "instruct"),
    "alpaca:instruct": ("alpaca", "instruct"),
    "alpaca:alpaca": ("alpaca", "instruct"),
    "alpaca_chat": ("alpaca", "chat"),
    "alpaca:chat": ("alpaca", "chat"),
    "alpaca_chat.load": ("alpaca", "chat"),
    "alpaca:chatml": ("alpaca", "chatml"),
    "alpaca_chatml": ("alpaca", "chatml"),
    "alpaca:chat_template": ("alpaca", "chat_template"),
    "completion": ("completion", ""),
    "text": ("text", ""),
    "input_output": ("input_output", ""),
}
COMMON_TYPES = "chat_template, sharegpt, alpaca, alpaca_chat, alpaca:chatml, completion, text, input_output"

# The chat templates qlora ships (qlora_cli/sources/chat_templates.py holds their text), and every name
# `chat_template` takes.
SHIPPED_TEMPLATES = (
    "chatml",
    "qwen_25",
    "qwen3",
    "llama3",
    "mistral_v1",
    "mistral_v2v3",
    "mistral_v3_tekken",
    "mistral_v7_tekken",
)
CHAT_TEMPLATE_NAMES = ("tokenizer_default", *SHIPPED_TEMPLATES, "jinja")
FALLBACK_TEMPLATE = "tokenizer_default_fallback_"
