"""The training config: flat YAML with Axolotl's key names, as typed dataclasses.

Every key has a type, a default and a range, declared once on the dataclass field; qlora_cli/config/checks.py
reads those declarations, so an error always names the key and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from qlora_cli.core.names import ALL_PROJECTIONS, EXPERT_PARAMETERS


def _range(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False, hi_open: bool = False):
    """Field metadata: the allowed numeric interval, shown in errors."""
    return {"range": (lo, hi, lo_open, hi_open)}


def expert_parameter(value: str) -> str | None:
    """The fused expert parameter (EXPERT_PARAMETERS) a target_parameters value names, or None. PEFT
    matches a value as a suffix of the parameter's full name; qlora adapts every MoE layer, so a value
    may lead with `experts.` or `mlp.experts.`, but not with a path that picks layers."""
    *path, name = value.split(".")
    if name not in EXPERT_PARAMETERS or len(path) > 2 or path != ["mlp", "experts"][2 - len(path) :]:
        return None
    return name


@dataclass
class InstructionFormat:
    """`type:` as a mapping: the prompt is `system_format` (when there is a system text) followed by
    `format` ({instruction}, {input}) or, for rows without input, `no_input_format`; without `format`,
    Alpaca's layout with these field names."""

    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = "system"
    system_prompt: str = ""
    system_format: str = "{system}"
    format: str | None = None
    no_input_format: str | None = None


@dataclass
class DatasetConfig:
    """One entry of `datasets` (or `test_datasets`), with Axolotl's keys; qlora_cli/data/prompts.py renders rows.

    field_messages, message_field_role and message_field_content left unset read `messages` with
    role/content, or ShareGPT's `conversations` with from/value, whichever the rows have.
    """

    path: str
    type: str | InstructionFormat = "alpaca"
    split: str = "train"
    revision: str | None = None
    name: str | None = None
    data_files: str | list[str] | dict[str, str | list[str]] | None = None
    ds_type: Literal["json", "jsonl", "parquet", "arrow", "csv"] | None = None
    field_messages: str | None = None
    message_property_mappings: dict[str, str] = field(default_factory=dict)
    message_field_role: str | None = None
    message_field_content: str | None = None
    message_field_training: str = "training"
    roles: dict[str, list[str]] = field(default_factory=dict)
    roles_to_train: list[str] = field(default_factory=lambda: ["assistant"])
    train_on_eos: Literal["turn", "all", "last", "none"] | bool = "turn"
    drop_system_message: bool = False
    field_instruction: str = "instruction"
    field_input: str = "input"
    field_output: str = "output"
    field_system: str = "system"
    field_prompt: str = "prompt"
    field_completion: str = "completion"
    field_text: str = "text"
    chat_template: str | None = None
    chat_template_jinja: str | None = None
    shards: int | None = field(default=None, metadata=_range(1, None))
    shards_idx: int = field(default=0, metadata=_range(0, None))
    trust_remote_code: bool = False
    field: str | None = None  # last: the name `field` hides dataclasses.field in the class body below it

    def __post_init__(self):
        # Axolotl's train_on_eos is a word; a boolean (qlora's older form) means turn or none.
        if isinstance(self.train_on_eos, bool):
            self.train_on_eos = "turn" if self.train_on_eos else "none"
        if self.ds_type == "jsonl":
            self.ds_type = "json"


@dataclass
class SpecialTokens:
    """Tokens of the vocabulary to use as pad, end-of-sequence or begin-of-sequence token."""

    pad_token: str | None = None
    eos_token: str | None = None
    bos_token: str | None = None


@dataclass
class TrainConfig:
    base_model: str
    datasets: list[DatasetConfig]
    revision: str | None = None
    load_in_4bit: bool = True
    adapter: Literal["qlora", "lora"] = "qlora"
    lora_r: int = field(default=16, metadata=_range(1, 4096))
    lora_alpha: float = field(default=32.0, metadata=_range(0, None, lo_open=True))
    lora_dropout: float = field(default=0.0, metadata=_range(0, 1, hi_open=True))
    lora_target_modules: list[str] = field(default_factory=lambda: list(ALL_PROJECTIONS))
    lora_target_linear: bool = False
    # A MoE model's routed experts' fused parameters LoRA adapts, as PEFT's target_parameters names them.
    lora_target_parameters: list[str] = field(default_factory=list)
    peft_use_rslora: bool = False
    train_norms: bool = False
    sequence_len: int = field(default=2048, metadata=_range(8, 1 << 20))
    sample_packing: bool = False
    micro_batch_size: int = field(default=1, metadata=_range(1, 65536))
    gradient_accumulation_steps: int = field(default=1, metadata=_range(1, 65536))
    num_epochs: float = field(default=1.0, metadata=_range(0, None, lo_open=True))
    max_steps: int | None = field(default=None, metadata=_range(1, None))
    optimizer: Literal["adamw_torch_fused", "adamw_torch"] = "adamw_torch_fused"
    learning_rate: float = field(default=2e-4, metadata=_range(0, None, lo_open=True))
    lr_scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    warmup_steps: int | None = field(default=None, metadata=_range(0, None))
    warmup_ratio: float = field(default=0.0, metadata=_range(0, 1))
    weight_decay: float = field(default=0.0, metadata=_range(0, None))
    adam_beta1: float = field(default=0.9, metadata=_range(0, 1, hi_open=True))
    adam_beta2: float = field(default=0.999, metadata=_range(0, 1, hi_open=True))
    adam_epsilon: float = field(default=1e-8, metadata=_range(0, None, lo_open=True))
    max_grad_norm: float = field(default=1.0, metadata=_range(0, None))
    val_set_size: int | float = field(default=0.0, metadata=_range(0, None))
    eval_steps: int | None = field(default=None, metadata=_range(1, None))
    evals_per_epoch: int | None = field(default=None, metadata=_range(1, None))
    eval_sample_packing: bool | None = None
    output_dir: str = "./outputs/qlora"
    overwrite_output_dir: bool = False
    save_steps: int | None = field(default=None, metadata=_range(1, None))
    saves_per_epoch: int | None = field(default=None, metadata=_range(1, None))
    save_first_step: bool = False
    save_total_limit: int | None = field(default=None, metadata=_range(1, None))
    resume_from_checkpoint: str | None = None
    auto_resume_from_checkpoints: bool = False
    lora_model_dir: str | None = None
    special_tokens: SpecialTokens = field(default_factory=SpecialTokens)
    loss_watchdog_threshold: float | None = field(default=None, metadata=_range(0, None, lo_open=True))
    loss_watchdog_patience: int | None = field(default=None, metadata=_range(1, None))
    logging_steps: int = field(default=1, metadata=_range(1, None))
    wandb_project: str | None = None
    wandb_entity: str | None = None
    wandb_name: str | None = None
    wandb_mode: Literal["online", "offline", "disabled"] | None = None
    wandb_run_id: str | None = None
    wandb_watch: bool | Literal["false", "gradients", "parameters", "all"] | None = None
    wandb_log_model: bool | Literal["false", "checkpoint", "end"] | None = None
    use_tensorboard: bool = False
    mlflow_tracking_uri: str | None = None
    mlflow_experiment_name: str | None = None
    mlflow_run_name: str | None = None
    seed: int = 42
    bf16: bool | Literal["auto"] = "auto"
    # The frozen NF4 projections multiply in FP8 (e4m3) on Ada and Hopper GPUs (kernels/fp8.py).
    fp8: bool = False
    gradient_checkpointing: bool | Literal["auto"] = True
    activation_offloading: bool | Literal["auto"] = "auto"
    memory_budget_gb: float | None = field(default=None, metadata=_range(0, None, lo_open=True))
    attention: Literal["auto", "triton", "sdpa", "flex"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    cuda_graphs: bool | Literal["auto"] = "auto"
    test_datasets: list[DatasetConfig] = field(default_factory=list)
    train_on_inputs: bool = False
    chat_template: str | None = None
    chat_template_jinja: str | None = None
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    dataset_exact_deduplication: bool = False
    excess_length_strategy: Literal["truncate", "drop"] = "truncate"
    # What translating Axolotl's keys had to say; printed once when the run starts, never saved.
    notes: list[str] = field(default_factory=list, compare=False, repr=False, metadata={"derived": True})

    @property
    def target_modules(self) -> list[str]:
        # Every projection, where a model has it; a MoE layer's routed experts only by lora_target_parameters.
        return list(ALL_PROJECTIONS) if self.lora_target_linear else list(self.lora_target_modules)

    @property
    def expert_targets(self) -> tuple[str, ...]:
        """The routed experts' fused parameters lora_target_parameters names, in EXPERT_PARAMETERS' order
        (values naming none are the config checks' to refuse)."""
        named = {expert_parameter(value) for value in self.lora_target_parameters}
        return tuple(name for name in EXPERT_PARAMETERS if name in named)

    @property
    def quantize(self) -> bool:
        return self.load_in_4bit
