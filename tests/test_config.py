"""The config schema: defaults, types, ranges, suggestions, overrides, and the shipped configs."""

from pathlib import Path

import pytest

from qlora_cli.config import ALL_PROJECTIONS, config_from_dict, load_config
from qlora_cli.errors import QLoraError

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
MINIMAL = {"base_model": "Qwen/Qwen2.5-0.5B", "datasets": [{"path": "data.jsonl", "type": "alpaca"}]}


def _with(**keys):
    return {**MINIMAL, **keys}


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
        ({"datasets": []}, "expected at least one dataset"),
        ({"datasets": [{"path": "a.jsonl", "tpye": "alpaca"}]}, "did you mean 'datasets[0].type'?"),
        ({"datasets": [{"type": "alpaca"}]}, "missing the required key 'datasets[0].path'"),
        ({"fp16": True}, "config key 'fp16' is not supported"),
        ({"load_in_4bit": False}, "'qlora' needs load_in_4bit: true"),
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
    with pytest.raises(QLoraError, match="unknown config key 'lora_rank'"):
        load_config(path, ["lora_rank=4"])


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    config = load_config(path)
    assert config.datasets
