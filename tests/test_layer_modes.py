"""One decoder layer, three modes: generation's prefill and decode steps through the layer's forward with a
cache give the training forward's logits on the same tokens, position by position, on the CPU."""

import pytest
import torch
from checkpoints import write_qwen2, write_qwen3, write_qwen3_5

from qlora_cli.generate.decoding import DecodingEngine
from qlora_cli.model import LoRAConfig, QLoRAModel

pytestmark = pytest.mark.usefixtures("reference_ops")
TOKENS = 12
PROMPT_LENGTHS = (5, 2)  # rows of different lengths: each step reads each row's own cache


@pytest.mark.parametrize(
    "writer", [write_qwen3, write_qwen2, write_qwen3_5], ids=["qwen3", "qwen2", "qwen3_5"]
)
def test_prefill_and_decode_steps_give_the_training_forwards_logits(tmp_path, writer):
    model = QLoRAModel.from_pretrained(writer(tmp_path / "model"), lora=LoRAConfig(r=4)).eval()
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in model.trainable_parameters():
            param.add_(0.2 * torch.randn(param.shape, generator=generator))
        rows = torch.randint(0, model.spec.vocab_size, (len(PROMPT_LENGTHS), TOKENS), generator=generator)
        expected = model(rows)
    engine = DecodingEngine(model, cuda_graphs=False)
    cache, step = engine.prepare(len(PROMPT_LENGTHS), TOKENS)
    prompts = [row[:length].tolist() for row, length in zip(rows, PROMPT_LENGTHS, strict=True)]
    positions = torch.tensor(PROMPT_LENGTHS)
    first = engine.prefill(cache, prompts)
    got = {(r, length - 1): first[r] for r, length in enumerate(PROMPT_LENGTHS)}
    while positions.min() < TOKENS:
        logits = step(rows[torch.arange(len(rows)), positions.clamp(max=TOKENS - 1)], positions)
        got.update({(r, int(p)): logits[r] for r, p in enumerate(positions) if p < TOKENS})
        positions = positions + 1
    assert sorted(got) == [
        (r, p) for r, length in enumerate(PROMPT_LENGTHS) for p in range(length - 1, TOKENS)
    ]
    # Both sides compute in fp32 and differ only in summation order (fused vs two-product LoRA, packed vs
    # cached attention): each op is off by at most K·u ≈ 96 · 6e-8 ≈ 6e-6 of its scale, and about 16 ops
    # (2 layers and the head) compound to ~1e-4. A wrong op moves logits by their own size.
    scale = expected.abs().max().item()
    for (r, p), logits in got.items():
        assert (logits - expected[r, p]).abs().max().item() < 1e-4 * scale, (r, p)
