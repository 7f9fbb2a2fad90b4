"""Reading checkpoints: config.json variants, sharded safetensors, and every way a checkpoint is broken."""

import json

import pytest
import torch
from checkpoints import write_qwen2, write_qwen3
from safetensors.torch import load_file, save_file

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.weights import read_spec, spec_from_config, stream_tensors

QWEN2_CONFIG = {
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "rope_theta": 1000000.0,
    "torch_dtype": "bfloat16",
    "tie_word_embeddings": True,
}


def test_qwen2_spec_derives_head_dim_and_bias():
    spec = spec_from_config(QWEN2_CONFIG)
    assert (spec.head_dim, spec.attention_bias, spec.qk_norm, spec.dtype) == (64, True, False, torch.bfloat16)


def test_qwen3_spec_with_dtype_and_rope_parameters():
    cfg = {k: v for k, v in QWEN2_CONFIG.items() if k not in ("rope_theta", "torch_dtype")}
    cfg.update(
        model_type="qwen3",
        head_dim=128,
        dtype="float32",
        rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )
    spec = spec_from_config(cfg)
    assert (spec.head_dim, spec.attention_bias, spec.qk_norm, spec.rope_theta) == (128, False, True, 5e5)
    assert spec.dtype == torch.float32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"model_type": "llama"}, "model_type 'llama' is not supported"),
        ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, "rope scaling 'yarn' is not supported"),
        ({"torch_dtype": "int8"}, "dtype 'int8' is not one of"),
        ({"hidden_size": None}, "hidden_size"),
    ],
)
def test_unsupported_configs_are_refused_by_name(change, message):
    cfg = {**QWEN2_CONFIG, **change}
    if change.get("hidden_size", 0) is None:
        del cfg["hidden_size"]
    with pytest.raises(QLoraError, match=message):
        spec_from_config(cfg)


def test_folder_without_config(tmp_path):
    with pytest.raises(QLoraError, match="has no config.json"):
        read_spec(tmp_path)


def test_streams_every_expected_tensor_once(tmp_path):
    folder = write_qwen3(tmp_path)
    spec = read_spec(folder)
    names = [name for name, _ in stream_tensors(folder, spec)]
    assert sorted(names) == sorted(spec.expected_tensors())


def test_sharded_checkpoint_with_index(tmp_path):
    folder = write_qwen2(tmp_path / "one")
    tensors = load_file(folder / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "config.json").write_text((folder / "config.json").read_text())
    for shard, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, sharded / shard)
    weight_map = {n: shard for shard, shard_names in shards.items() for n in shard_names}
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    spec = read_spec(sharded)
    streamed = dict(stream_tensors(sharded, spec))
    assert all(torch.equal(streamed[n], tensors[n]) for n in spec.expected_tensors())


def test_missing_tensor_is_named(tmp_path):
    folder = write_qwen2(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj\.weight"):
        list(stream_tensors(folder, read_spec(folder)))


def test_wrong_shape_is_named(tmp_path):
    folder = write_qwen2(tmp_path)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 64)
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(QLoraError, match=r"k_proj\.weight has shape \[8, 64\], expected \[32, 64\]"):
        list(stream_tensors(folder, read_spec(folder)))


def test_truncated_file_is_refused(tmp_path):
    folder = write_qwen2(tmp_path)
    path = folder / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(QLoraError, match="truncated or corrupt"):
        list(stream_tensors(folder, read_spec(folder)))


def test_garbage_file_is_refused(tmp_path):
    folder = write_qwen2(tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(QLoraError, match="not a valid safetensors file"):
        list(stream_tensors(folder, read_spec(folder)))
