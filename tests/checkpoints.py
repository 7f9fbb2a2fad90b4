"""Tiny random Qwen2 / Qwen3 checkpoints written by transformers itself, for tests to load."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from qlora_cli.sources.weights import ModelSpec

REPO_ROOT = Path(__file__).resolve().parent.parent
DEMO_TOKENIZER = REPO_ROOT / "configs" / "demo" / "tiny-qwen3"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
)


# Qwen2.5-7B's shape, for tests that need real sizes without a checkpoint on disk.
QWEN25_7B = ModelSpec(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_layers=28,
    num_heads=28,
    num_kv_heads=4,
    head_dim=128,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    attention_bias=True,
    qk_norm=False,
    dtype=torch.bfloat16,
)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every weight random (biases and norms too), so no code path hides behind zeros or ones."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            else:
                param.copy_(0.08 * noise)


def write_qwen2(
    folder: Path, *, vocab_size: int = 160, seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen2: q/k/v bias, tied embeddings, GQA (4 query heads on 2 kv heads)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    settings = {
        **TINY,
        "vocab_size": vocab_size,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        **overrides,
    }
    return _save(Qwen2ForCausalLM(Qwen2Config(**settings)), folder, seed, dtype)


def write_qwen3(
    folder: Path, *, vocab_size: int = 160, seed: int = 0, dtype=torch.float32, **overrides
) -> Path:
    """Qwen3: QK-norm, untied lm_head, head_dim (24) unlike hidden / heads (16), no q/k/v bias."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    settings = {**TINY, "vocab_size": vocab_size, "head_dim": 24, "tie_word_embeddings": False, **overrides}
    return _save(Qwen3ForCausalLM(Qwen3Config(**settings)), folder, seed, dtype)


def _save(model, folder: Path, seed: int, dtype) -> Path:
    _randomize(model, seed)
    model = model.to(dtype)
    folder = Path(folder)
    model.save_pretrained(folder, safe_serialization=True)
    return folder


def add_demo_tokenizer(folder: Path) -> Path:
    """The demo's tokenizer, so a tiny checkpoint can train on the demo's data."""
    for name in TOKENIZER_FILES:
        shutil.copy(DEMO_TOKENIZER / name, Path(folder) / name)
    return folder


def load_transformers(folder: Path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


DEMO_DATA = REPO_ROOT / "configs" / "demo" / "data" / "train.jsonl"


def subprocess_env(**extra: str) -> dict[str, str]:
    """A child process's environment: reference ops, unbuffered output, and this checkout on the
    path, so that scripts a test writes import it whether or not qlora is installed."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "TRITON_INTERPRET": "0", "PYTHONUNBUFFERED": "1", "PYTHONPATH": path, **extra}


def write_run(folder: Path, rows: int = 48, **config) -> Path:
    """A tiny Qwen3 with the demo tokenizer, the first `rows` demo examples, and a config for them."""
    import yaml

    folder = Path(folder)
    model = add_demo_tokenizer(write_qwen3(folder / "model", vocab_size=1024))
    data = folder / "train.jsonl"
    data.write_text("".join(DEMO_DATA.read_text().splitlines(keepends=True)[:rows]))
    settings = {
        "base_model": str(model),
        "datasets": [{"path": str(data), "type": "chat_template"}],
        "sequence_len": 128,
        "micro_batch_size": 2,
        "max_steps": 6,
        "learning_rate": 1e-3,
        "warmup_steps": 1,
        "lora_r": 4,
        "output_dir": str(folder / "out"),
        "device": "cpu",
        "gradient_checkpointing": False,
        "seed": 3,
    }
    settings.update(config)
    path = folder / "config.yaml"
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path
