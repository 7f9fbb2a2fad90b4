"""The config schema: defaults, types, ranges, suggestions, overrides, and the shipped configs."""

from pathlib import Path

import pytest

from qlora_cli.config.loading import config_from_dict, load_config
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import ALL_PROJECTIONS
from qlora_cli.core.wording import count, number

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MINIMAL = {"base_model": "Qwen/Qwen2.5-0.5B", "datasets": [{"path": "data.jsonl", "type": "alpaca"}]}


def _with(**keys):
    return {**MINIMAL, **keys}


def test_counts_and_numbers_read_as_words():
    assert [count(n, "step") for n in (0, 1, 2, 1234)] == ["0 steps", "1 step", "2 steps", "1,234 steps"]
    assert (count(1, "process", "processes"), count(2, "process", "processes")) == (
        "1 process",
        "2 processes",
    )
    assert [number(v) for v in (1 << 20, 65536.0, 0.5, 1e-6)] == ["1,048,576", "65,536", "0.5", "1e-06"]


def test_a_range_names_its_bounds_in_full():
    with pytest.raises(
        QLoraError, match=r"'sequence_len': expected a value >= 8 and <= 1,048,576, got 2000000$"
    ):
        config_from_dict(_with(sequence_len=2_000_000))


def test_defaults_follow_the_qlora_paper():
    config = config_from_dict(MINIMAL)
    assert config.quantize and config.adapter == "qlora"
    assert config.target_modules == list(ALL_PROJECTIONS)
    assert (config.lora_r, config.lora_alpha, config.learning_rate) == (16, 32.0, 2e-4)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"lora_rr": 8}, "unknown config key 'lora_rr' (did you mean 'lora_r'?)"),
        ({"learning_rat": 1e-4}, "did you mean 'learning_rate'?"),
        ({"lora_r": 0}, "config key 'lora_r': expected a value >= 1"),
        ({"lora_r": "eight"}, "config key 'lora_r': expected an integer, got 'eight'"),
        ({"lora_r": 8.5}, "config key 'lora_r': expected an integer"),
        ({"lora_dropout": 1.0}, "config key 'lora_dropout': expected a value >= 0 and < 1"),
        ({"sample_packing": "yes"}, "config key 'sample_packing': expected true or false"),
        (
            {"lr_scheduler": "step"},
            "config key 'lr_scheduler': expected one of 'cosine', 'linear', 'constant'",
        ),
        ({"lora_target_modules": ["q_proj", "qkv"]}, "unknown module 'qkv'"),
        (
            {"lora_target_modules": "q_proj"},
            "'lora_target_modules': expected a list of strings, got 'q_proj'",
        ),
        ({"datasets": {"path": "a.jsonl"}}, "'datasets': expected a list, each a mapping, got {"),
        ({"lora_target_modules": ["q_prj"], "lora_target_linear": True}, "unknown module 'q_prj'"),
        ({"datasets": []}, "expected at least one dataset"),
        ({"datasets": [{"path": "a.jsonl", "tpye": "alpaca"}]}, "did you mean 'datasets[0].type'?"),
        ({"datasets": [{"type": "alpaca"}]}, "missing the required key 'datasets[0].path'"),
        ({"fp16": True}, "config key 'fp16' is not supported"),
        ({"load_in_4bit": False}, "'qlora' needs load_in_4bit: true"),
        ({"fp8": True, "adapter": "lora", "load_in_4bit": False}, "'fp8': it multiplies the NF4 base in FP8"),
        ({"gradient_checkpointing": "auto"}, "'auto' needs memory_budget_gb"),
    ],
)
def test_bad_values_name_the_key_and_what_was_expected(keys, message):
    with pytest.raises(QLoraError) as err:
        config_from_dict(_with(**keys))
    assert message in str(err.value)


def test_missing_required_key():
    with pytest.raises(QLoraError, match="missing the required key 'base_model'"):
        config_from_dict({"datasets": MINIMAL["datasets"]})


def test_axolotl_spellings_are_accepted():
    config = config_from_dict(_with(learning_rate="1e-4", flash_attention=True, lora_target_linear=True))
    assert config.learning_rate == 1e-4
    assert config.target_modules == list(ALL_PROJECTIONS)


def test_yaml_errors_name_the_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("base_model: x\nlora_r: [1,\n")
    with pytest.raises(QLoraError, match=r"YAML syntax error at line \d+"):
        load_config(path)


def test_a_key_set_twice_is_refused_naming_both_lines(tmp_path):
    """YAML loaders keep the last of two equal keys without a word: the earlier value would not train."""
    path = tmp_path / "twice.yaml"
    path.write_text(
        "base_model: x\nlora_r: 8\ndatasets:\n  - path: a.jsonl\n    type: alpaca\n    type: completion\n"
    )
    with pytest.raises(
        QLoraError, match=r"at line 6, column 5: 'type' is set twice \(lines 5 and 6\); keep one$"
    ):
        load_config(path)
    path.write_text("base_model: x\nlora_r: 8\nlora_r: 16\n")
    with pytest.raises(QLoraError, match=r"'lora_r' is set twice \(lines 2 and 3\)"):
        load_config(path)
    path.write_text("base_model: x\n? [a, b]\n: 1\n")  # a key no mapping can hold: one line too
    with pytest.raises(QLoraError, match=r"at line 2, column 3: found unhashable key"):
        load_config(path)


def test_missing_file(tmp_path):
    with pytest.raises(QLoraError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    with pytest.raises(QLoraError, match="mapping"):
        load_config(path)


def test_set_overrides_keys_with_yaml_values(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("base_model: x\ndatasets:\n  - path: a.jsonl\n    type: alpaca\n")
    config = load_config(path, ["lora_r=8", "sample_packing=true", "datasets.0.path=b.jsonl", "max_steps=3"])
    assert (config.lora_r, config.sample_packing, config.datasets[0].path, config.max_steps) == (
        8,
        True,
        "b.jsonl",
        3,
    )
    with pytest.raises(QLoraError, match="expects key=value"):
        load_config(path, ["lora_r"])
    with pytest.raises(QLoraError, match="no item 3"):
        load_config(path, ["datasets.3.path=c.jsonl"])
    with pytest.raises(
        QLoraError, match=r"^--set test_datasets.0.path: 'test_datasets' is not set, so it has no item 0$"
    ):
        load_config(path, ["test_datasets.0.path=c.jsonl"])
    path.write_text(path.read_text() + "lora_r: 8\nfsdp:\n")
    for override, message in [
        ("lora_r.x=1", "--set lora_r.x: 'lora_r' is not a mapping"),
        ("lora_r.x.y=1", "--set lora_r.x.y: 'lora_r' is not a mapping"),
        ("datasets.0.type.field=x", "--set datasets.0.type.field: 'datasets.0.type' is not a mapping"),
        ("fsdp.0=x", "--set fsdp.0: 'fsdp' is not set, so it has no item 0"),
        ("datasets.1=x", "--set datasets.1: no item 1 in 'datasets'"),
    ]:
        with pytest.raises(QLoraError) as refused:
            load_config(path, [override])
        assert str(refused.value) == message
    with pytest.raises(QLoraError, match="unknown config key 'lora_rank'"):
        load_config(path, ["lora_rank=4"])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    config = load_config(path)
    assert config.datasets


@pytest.mark.parametrize(("key", "value"), [("learning_rate", 0), ("lora_alpha", 0), ("adam_epsilon", 0)])
def test_a_value_at_an_excluded_lower_bound_is_refused(key, value):
    with pytest.raises(QLoraError, match=f"config key '{key}': expected a value > 0, got 0"):
        config_from_dict(_with(**{key: value}))


def test_every_problem_is_reported_together():
    raw = _with(
        lora_rr=8,
        learning_rate=0,
        sample_packing="yes",
        lora_modules_to_save=["embed_tokens"],
        evals_per_epoch=2,
        eval_steps=5,
        datasets=[{"path": "a.jsonl", "tpye": "alpaca"}, {"type": "text"}],
    )
    with pytest.raises(QLoraError) as err:
        config_from_dict(raw)
    lines = str(err.value).splitlines()
    assert lines[0] == "the config has 7 problems:"
    for part in (
        "unknown config key 'lora_rr' (did you mean 'lora_r'?)",
        "config key 'learning_rate': expected a value > 0, got 0",
        "config key 'sample_packing': expected true or false",
        "config key 'lora_modules_to_save' is not supported",
        "config keys 'evals_per_epoch' and 'eval_steps' are both set",
        "did you mean 'datasets[0].type'?",
        "missing the required key 'datasets[1].path'",
    ):
        assert sum(part in line for line in lines[1:]) == 1, part


def test_a_failed_key_does_not_add_rules_about_its_default():
    with pytest.raises(QLoraError) as err:
        config_from_dict(_with(adapter="lora2", load_in_4bit=False))
    assert str(err.value).startswith("config key 'adapter': expected one of") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "keys",
    [
        {"special_tokens": None, "resume_from_checkpoint": None, "lora_model_dir": None},
        {"load_in_8bit": False, "fp16": None, "train_on_inputs": False, "lora_modules_to_save": []},
        {"hub_model_id": "", "early_stopping_patience": None, "plugins": [], "wandb_project": None},
        {"optimizer": None, "gradient_checkpointing": None, "val_set_size": None},
    ],
)
def test_empty_values_ask_for_nothing(keys):
    config = config_from_dict(_with(**keys))
    assert config == config_from_dict(MINIMAL)
    assert config.notes == []


@pytest.mark.parametrize(
    ("keys", "note"),
    [
        (
            {"lora_mlp_kernel": True, "lora_qkv_kernel": True, "lora_o_kernel": True},
            "lora_mlp_kernel, lora_qkv_kernel, lora_o_kernel: qlora's NF4 + LoRA projections always run as fused kernels",
        ),
        (
            {"attn_implementation": "flash_attention_2"},
            "attn_implementation: qlora's attention is always fused",
        ),
        ({"flash_attention": True}, "flash_attention: qlora's attention is always fused"),
        (
            {"plugins": ["axolotl.integrations.liger.LigerPlugin"]},
            "plugins: Liger's kernels do what qlora's fused kernels already do",
        ),
        (
            {"plugins": ["axolotl.integrations.cut_cross_entropy.CutCrossEntropyPlugin"]},
            "plugins: Cut Cross Entropy do what qlora's fused kernels already do",
        ),
        (
            {"fsdp": ["full_shard"], "fsdp_config": {"fsdp_offload_params": True}},
            "fsdp, fsdp_config: qlora runs several GPUs as data parallel",
        ),
        ({"deepspeed": "deepspeed_configs/zero2.json"}, "each GPU holds the whole NF4 model"),
        ({"trust_remote_code": True}, "never runs code from a model repo"),
        ({"torch_compile": True}, "torch_compile: qlora's hot paths are hand-written Triton kernels"),
        ({"local_rank": 0}, "local_rank: torchrun gives each process its rank"),
        ({"debug": True}, "debug: `qlora data CONFIG --show N` prints tokenized rows"),
        (
            {"eval_table_size": 5, "eval_max_new_tokens": 128},
            "eval_table_size, eval_max_new_tokens: evaluation",
        ),
        ({"save_only_model": True}, "save_only_model: checkpoints always hold the optimizer state too"),
    ],
)
def test_keys_qlora_already_honours_are_noted_once(keys, note):
    config = config_from_dict(_with(**keys))
    assert config == config_from_dict(MINIMAL)
    assert len(config.notes) == 1 and note in config.notes[0]


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("adamw_torch_fused", "adamw_torch_fused"),
        ("adamw_torch", "adamw_torch"),
        ("adamw", "adamw_torch"),
        ("adamw_bnb_8bit", "adamw_torch_fused"),
        ("paged_adamw_8bit", "adamw_torch_fused"),
        ("paged_adamw_32bit", "adamw_torch_fused"),
        ("adamw_8bit", "adamw_torch_fused"),
        ("adamw_torch_4bit", "adamw_torch_fused"),
    ],
)
def test_optimizer_names(name, expected):
    config = config_from_dict(_with(optimizer=name))
    assert config.optimizer == expected
    noted = [n for n in config.notes if n.startswith(f"optimizer: {name} runs as fused AdamW")]
    assert len(noted) == (1 if name not in ("adamw_torch_fused", "adamw_torch", "adamw") else 0)


@pytest.mark.parametrize("name", ["sgd", "adafactor", "lion_8bit", "muon"])
def test_optimizers_other_than_adamw_are_refused(name):
    with pytest.raises(
        QLoraError, match="config key 'optimizer': expected one of 'adamw_torch_fused', 'adamw_torch'"
    ):
        config_from_dict(_with(optimizer=name))


def test_mapped_keys():
    config = config_from_dict(_with(gradient_checkpointing="offload"))
    assert config.gradient_checkpointing is True and config.activation_offloading is True
    config = config_from_dict(_with(load_in_8bit=True, adapter="lora"))
    assert config.load_in_4bit is False and config.adapter == "lora"
    assert any(n.startswith("load_in_8bit: qlora has no 8-bit base") for n in config.notes)
    assert config_from_dict(_with(bfloat16=True)).bf16 is True
    assert config_from_dict(_with(bfloat16=True, bf16=False)).bf16 is False


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        (
            {"gradient_checkpointing": "offload", "activation_offloading": False},
            "'offload' asks for activation offloading",
        ),
        ({"gradient_checkpointing": "offload_disk"}, "'offload_disk' is not supported"),
        (
            {"activation_offloading": "yes"},
            "config key 'activation_offloading': expected true or false or one of 'auto', got 'yes'",
        ),
        ({"load_in_8bit": True, "load_in_4bit": True}, "'load_in_8bit' and 'load_in_4bit' are both true"),
        ({"load_in_8bit": True}, "'qlora' needs load_in_4bit: true (use adapter: lora)"),
        ({"fp16": True}, "config key 'fp16' is not supported: qlora computes in bf16 or fp32"),
        (
            {"plugins": ["axolotl.integrations.kd.KDPlugin"]},
            "'axolotl.integrations.kd.KDPlugin' is not supported",
        ),
        ({"lora_modules_to_save": ["lm_head"]}, "config key 'lora_modules_to_save' is not supported"),
        ({"peft_use_dora": True}, "DoRA is not implemented"),
        ({"hub_model_id": "me/model"}, "qlora does not upload"),
        ({"rl": "dpo"}, "supervised fine-tuning only"),
        ({"tokens": ["<new>"]}, "qlora cannot add tokens"),
        ({"saves_per_epoch": 2, "save_steps": 3}, "'saves_per_epoch' and 'save_steps' are both set"),
        ({"warmup_steps": 2, "warmup_ratio": 0.1}, "'warmup_steps' and 'warmup_ratio' are both set"),
        ({"evals_per_epoch": 0}, "config key 'evals_per_epoch': expected a value >= 1"),
        ({"loss_watchdog_patience": 3}, "'loss_watchdog_patience' needs loss_watchdog_threshold"),
        ({"loss_watchdog_threshold": 0}, "'loss_watchdog_threshold': expected a value > 0"),
        ({"special_tokens": {"pad_tokn": "x"}}, "did you mean 'special_tokens.pad_token'?"),
        ({"special_tokens": "x"}, "config key 'special_tokens': expected a mapping"),
        (
            {"resume_from_checkpoint": "out/checkpoint-2", "auto_resume_from_checkpoints": True},
            "'resume_from_checkpoint' and 'auto_resume_from_checkpoints' are both set",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused_naming_what_to_change(keys, message):
    with pytest.raises(QLoraError) as err:
        config_from_dict(_with(**keys))
    assert message in str(err.value)


def test_new_keys_are_saved_and_read_back(tmp_path):
    from qlora_cli.config.loading import read_yaml, save_config

    config = config_from_dict(
        _with(
            evals_per_epoch=4,
            saves_per_epoch=1,
            eval_sample_packing=False,
            special_tokens={"pad_token": "<|endoftext|>"},
            activation_offloading=True,
            loss_watchdog_threshold=5.0,
            loss_watchdog_patience=2,
            optimizer="paged_adamw_8bit",
        )
    )
    save_config(config, tmp_path / "config.yaml")
    saved = read_yaml(tmp_path / "config.yaml")
    assert "notes" not in saved
    again = config_from_dict(saved)
    assert again == config and again.notes == []
    assert again.special_tokens.pad_token == "<|endoftext|>" and again.optimizer == "adamw_torch_fused"
