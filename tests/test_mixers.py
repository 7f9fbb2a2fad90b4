"""The layer-kind seam: a mixer registered for a kind is all a decoder layer needs to run that kind."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from checkpoints import TINY_SPEC
from torch import nn

from qlora_cli.core.ops import Op
from qlora_cli.model import LoRAConfig
from qlora_cli.model.layers import DecoderLayer
from qlora_cli.model.mixers import MIXERS
from qlora_cli.sources.spec import LAYER_KIND_TENSORS, LayerKindTensors

pytestmark = pytest.mark.usefixtures("reference_ops")


class ScaledProjection(nn.Module):
    """A mixer no family has: the input scaled per channel by a trained weight, through o_proj."""

    groups = {"o": ("o_proj",)}
    checkpoint_module = "self_attn"

    def __init__(self, spec, trainable_norms, attention_backend, mlp_backward_bytes):
        super().__init__()
        self.scale = nn.Parameter(torch.full((spec.hidden_size,), 0.5))

    def forward(self, h, position_ids, doc_ids, inv_freq, project, cache):
        return project.run(Op.O_PROJ, "o", h * self.scale)


def _rms_norm(x, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def test_a_layer_kind_plugs_in_through_the_mixer_registry(monkeypatch):
    """A spec naming an unknown kind, the registry's mixer for it and its tensors' row, nothing else: the
    checkpoint's tensors follow the row, and the layer runs the mixer between its norms and the MLP,
    forward and backward, LoRA on its projection trained."""
    monkeypatch.setitem(MIXERS, "scaled_projection", ScaledProjection)
    monkeypatch.setitem(
        LAYER_KIND_TENSORS,
        "scaled_projection",
        LayerKindTensors(
            "self_attn",
            lambda spec: {"o_proj": (spec.hidden_size, spec.hidden_size)},
            lambda spec: {"scale": (spec.hidden_size,)},
            lambda spec: (),
        ),
    )
    spec = dataclasses.replace(TINY_SPEC, layer_types=("scaled_projection",))
    assert set(spec.layer_tensors(0)) == {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "self_attn.o_proj.weight",
        "self_attn.scale",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    lora = LoRAConfig(r=4, target_modules=("o_proj",))
    layer = DecoderLayer(spec, lora, "auto")
    assert list(layer.projections) == ["o", "gate_up", "down"]
    generator = torch.Generator().manual_seed(0)
    shapes, weights = spec.projection_shapes("scaled_projection"), {}
    for group in layer.projections.values():
        for name in group.names:
            weights[name] = 0.1 * torch.randn(shapes[name], generator=generator)
            group.set_weight(name, weights[name])
        group.reset_lora(generator)
    o = layer.projections["o"]
    with torch.no_grad():
        o.lora_B["o_proj"].normal_(0.0, 0.1, generator=generator)
    x = torch.randn(2, 5, spec.hidden_size, generator=generator, requires_grad=True)
    positions = torch.arange(5).expand(2, 5)
    out, residual = layer(x, None, positions, None, spec.rope_frequencies()[0])

    eps = spec.rms_norm_eps
    scaled = _rms_norm(x, eps) * layer.mixer.scale
    lora_a, lora_b = o.lora_A["o_proj"], o.lora_B["o_proj"]
    mixed = scaled @ weights["o_proj"].T + o.scaling * (scaled @ lora_a.T) @ lora_b.T
    h = _rms_norm(x + mixed, eps)
    mlp = (F.silu(h @ weights["gate_proj"].T) * (h @ weights["up_proj"].T)) @ weights["down_proj"].T
    torch.testing.assert_close(residual, x + mixed)
    torch.testing.assert_close(out, mlp)

    (out + residual).square().sum().backward()
    trained = [layer.mixer.scale, lora_a, lora_b, x]
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in trained)
