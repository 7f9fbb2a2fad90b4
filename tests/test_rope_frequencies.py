"""RoPE frequencies from config.json equal transformers' for every type qlora takes; the rest are refused."""

import pytest
import torch
from transformers import LlamaConfig, Qwen3_5TextConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5TextRotaryEmbedding

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.model_config import spec_from_config

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, num_hidden_layers=1,
            vocab_size=32, max_position_embeddings=256)  # fmt: skip

ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                    "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "attention_factor": 1.25,
                              "original_max_position_embeddings": 64, "truncate": False},
}  # fmt: skip


def _transformers(config) -> tuple[torch.Tensor, float]:
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[kind](config)


def _assert_equal(ours, theirs):
    inv_freq, scaling = ours
    assert inv_freq.dtype == torch.float32 and inv_freq.shape == theirs[0].shape
    # Both compute in fp32 with the same operations: equal to fp32 rounding, far inside 1e-6 relative.
    torch.testing.assert_close(inv_freq, theirs[0].float(), rtol=1e-6, atol=0)
    assert scaling == pytest.approx(theirs[1], rel=1e-6)


@pytest.mark.parametrize("name", sorted(ROPES))
@pytest.mark.parametrize("head_dim", [16, 32])
def test_inv_freq_and_attention_scaling_equal_transformers(name, head_dim):
    config = LlamaConfig(**TINY, head_dim=head_dim, rope_parameters=dict(ROPES[name]))
    spec = spec_from_config(config.to_dict())
    assert spec.rope_scaling.rope_type == ROPES[name]["rope_type"]
    _assert_equal(spec.rope_frequencies(), _transformers(config))


def test_yarn_scaling_changes_attention_and_llama3_leaves_high_frequencies():
    """The cases differ from default RoPE where they should, so equality above is not vacuous."""
    default = spec_from_config(
        LlamaConfig(**TINY, rope_parameters=ROPES["default"]).to_dict()
    ).rope_frequencies()
    yarn = spec_from_config(LlamaConfig(**TINY, rope_parameters=ROPES["yarn"]).to_dict()).rope_frequencies()
    assert yarn[1] == pytest.approx(1 + 0.1 * torch.log(torch.tensor(4.0)).item())
    assert not torch.equal(yarn[0], default[0])


def test_legacy_rope_scaling_with_rope_theta_reads_as_rope_parameters():
    legacy = {**TINY, "model_type": "llama", "rope_theta": 500000.0,
              "rope_scaling": {k: v for k, v in ROPES["llama3"].items() if k != "rope_theta"}}  # fmt: skip
    modern = LlamaConfig(**TINY, rope_parameters=dict(ROPES["llama3"]))
    _assert_equal(spec_from_config(legacy).rope_frequencies(), _transformers(modern))
    old_key = {**TINY, "model_type": "llama", "rope_scaling": {"type": "linear", "factor": 2.0}}
    spec = spec_from_config(old_key)
    assert (spec.rope_scaling.rope_type, spec.rope_scaling.factor, spec.rope_theta) == (
        "linear",
        2.0,
        10000.0,
    )
    both = {**old_key, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert spec_from_config(both).rope_scaling.rope_type == "linear"  # rope_scaling wins, as in transformers


def test_qwen3_5_partial_rotary_equals_its_rotary_embedding():
    config = Qwen3_5TextConfig(
        **{**TINY, "head_dim": 16},
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    )  # fmt: skip
    spec = spec_from_config(config.to_dict())
    inv_freq, scaling = spec.rope_frequencies()
    assert inv_freq.shape == (2,) and spec.rotary_dim == 4
    _assert_equal((inv_freq, scaling), Qwen3_5TextRotaryEmbedding.compute_default_rope_parameters(config))


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}, "rope scaling 'longrope' is not supported; qlora supports default, linear, dynamic, llama3, yarn"),
        ({"rope_type": "proportional"}, "rope scaling 'proportional' is not supported"),
        ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0}, "rope scaling 'llama3' needs the rope parameter 'high_freq_factor'"),
        ({"rope_type": "linear"}, "rope scaling 'linear' needs the rope parameter 'factor'"),
        ({"full_attention": {"rope_type": "default"}}, "RoPE settings per layer type are not supported"),
        ({"rope_type": "linear", "factor": "2"}, "rope parameter 'factor' must be a number"),
    ],
)  # fmt: skip
def test_other_rope_settings_are_one_line(rope, message):
    with pytest.raises(QLoraError, match=message) as error:
        spec_from_config({**TINY, "model_type": "llama", "rope_parameters": rope})
    assert "\n" not in str(error.value)
