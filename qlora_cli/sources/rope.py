"""RoPE settings from config.json and the frequencies they give, computed as transformers 5.x computes them.

config.json spells RoPE three ways: transformers 5.x writes one `rope_parameters` dict, 4.x wrote
`rope_theta` next to a `rope_scaling` dict, and older dicts say `type` for `rope_type`. A `rope_scaling`
dict wins over `rope_parameters`, and top-level `rope_theta` / `partial_rotary_factor` fill what the dict
lacks, as transformers' `convert_rope_params_to_dict` does. The frequencies are static for every type
qlora takes: `dynamic` rescales only past max_position_embeddings, which training never reaches
(sequence_len is refused above it), so it rotates as `default` does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from qlora_cli.core.errors import QLoraError

ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")
DEFAULT_THETA = 10000.0

# Keys each type cannot do without (transformers raises on a missing one too).
_REQUIRED = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}
# Types whose pretraining length defaults to max_position_embeddings when the dict lacks it.
_NEEDS_ORIGINAL_LENGTH = ("llama3", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """How a RoPE type rescales the default frequencies; `default` leaves them alone."""

    rope_type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None
    high_freq_factor: float | None = None
    attention_factor: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class RopeConfig:
    """What config.json says about RoPE, in one place whichever way it was spelt."""

    theta: float
    scaling: RopeScaling
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] = ()


def _number(params: dict, key: str, where: str) -> float | None:
    value = params.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise QLoraError(f"{where}: rope parameter '{key}' must be a number, got {value!r}")
    return float(value)


def _first(*values):
    """The first value that is set: a null in config.json means the key is absent."""
    return next(value for value in values if value is not None)


def rope_config(cfg: dict, where: str, *, default_partial_rotary_factor: float = 1.0) -> RopeConfig:
    """The RoPE settings of a decoder config (the text config of a vision-language one)."""
    params = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise QLoraError(f"{where}: rope_parameters must be a mapping, got {params!r}")
    if any(isinstance(value, dict) for value in params.values()):
        raise QLoraError(f"{where}: RoPE settings per layer type are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "mrope":  # Qwen-VL's legacy spelling of default RoPE over (t, h, w) positions
        kind = "default"
    if kind not in ROPE_TYPES:
        raise QLoraError(
            f"{where}: rope scaling '{kind}' is not supported; qlora supports {', '.join(ROPE_TYPES)}"
        )
    missing = [key for key in _REQUIRED.get(kind, ()) if params.get(key) is None]
    if missing:
        raise QLoraError(f"{where}: rope scaling '{kind}' needs the rope parameter '{missing[0]}'")
    theta = _first(params.get("rope_theta"), cfg.get("rope_theta"), DEFAULT_THETA)
    partial = _first(
        params.get("partial_rotary_factor"), cfg.get("partial_rotary_factor"), default_partial_rotary_factor
    )
    numbers = {"rope_theta": theta, "partial_rotary_factor": partial}
    if any(isinstance(v, bool) or not isinstance(v, int | float) for v in numbers.values()):
        raise QLoraError(f"{where}: rope_theta and partial_rotary_factor must be numbers, got {numbers}")
    if not 0 < partial <= 1:
        raise QLoraError(f"{where}: partial_rotary_factor must be in (0, 1], got {partial}")
    original = params.get("original_max_position_embeddings")
    if original is None and kind in _NEEDS_ORIGINAL_LENGTH:
        original = cfg.get("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    if kind in _NEEDS_ORIGINAL_LENGTH and not isinstance(original, int):
        raise QLoraError(f"{where}: rope scaling '{kind}' needs original_max_position_embeddings")
    scaling = RopeScaling(
        rope_type=kind,
        factor=_number(params, "factor", where) or 1.0,
        original_max_position_embeddings=original,
        low_freq_factor=_number(params, "low_freq_factor", where),
        high_freq_factor=_number(params, "high_freq_factor", where),
        attention_factor=_number(params, "attention_factor", where),
        beta_fast=_number(params, "beta_fast", where),
        beta_slow=_number(params, "beta_slow", where),
        mscale=_number(params, "mscale", where),
        mscale_all_dim=_number(params, "mscale_all_dim", where),
        truncate=bool(params.get("truncate", True)),
    )
    section = params.get("mrope_section", cfg.get("mrope_section")) or ()
    return RopeConfig(float(theta), scaling, float(partial), tuple(int(s) for s in section))


def _default_inv_freq(theta: float, dim: int, device) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    old = s.original_max_position_embeddings
    low_wavelen, high_wavelen = old / s.low_freq_factor, old / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(theta: float, dim: int, s: RopeScaling, device) -> tuple[torch.Tensor, float]:
    if s.attention_factor is not None:
        attention = s.attention_factor
    elif s.mscale and s.mscale_all_dim:
        attention = _yarn_mscale(s.factor, s.mscale) / _yarn_mscale(s.factor, s.mscale_all_dim)
    else:
        attention = _yarn_mscale(s.factor)
    beta_fast, beta_slow = s.beta_fast or 32, s.beta_slow or 1  # a 0 is the default too, as in transformers
    old = s.original_max_position_embeddings

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(old / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp(
        (torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1
    )
    extrapolation = 1 - ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device).float() / dim)
    inv_freq = (1.0 / (s.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def rope_frequencies(
    theta: float, dim: int, scaling: RopeScaling, device: torch.device | None = None
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim / 2] fp32, attention_scaling) for RoPE over `dim` dims of each head: the scaling
    multiplies cos and sin, as in transformers, so it scales q·k by its square; it is 1 for every type
    but yarn."""
    kind = scaling.rope_type
    if kind == "yarn":
        return _yarn(theta, dim, scaling, device)
    inv_freq = _default_inv_freq(theta, dim, device)
    if kind == "linear":
        inv_freq = inv_freq / scaling.factor
    elif kind == "llama3":
        inv_freq = _llama3(inv_freq, scaling)
    return inv_freq, 1.0
