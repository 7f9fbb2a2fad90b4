"""Choosing tokens and stopping: greedy or sampled (temperature, top-k, top-p, a seed), a batch of
prompts decoded together, each row ending at a stop token, its token budget or the model's context."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from qlora_cli.core.errors import QLoraError
from qlora_cli.generate.decoding import DecodingEngine


@dataclass(frozen=True)
class Sampling:
    """temperature 0 is greedy; top_k 0 and top_p 1 keep every token."""

    max_new_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0


def sampling_problem(sampling: Sampling) -> str | None:
    if not math.isfinite(sampling.temperature) or sampling.temperature < 0:
        return f"--temperature must be 0 (greedy) or a positive number, got {sampling.temperature:g}"
    if not 0 < sampling.top_p <= 1:
        return f"--top-p must be in (0, 1], got {sampling.top_p:g}"
    if sampling.top_k < 0:
        return f"--top-k must be 0 (off) or more, got {sampling.top_k}"
    if sampling.max_new_tokens < 1:
        return f"--max-new-tokens must be at least 1, got {sampling.max_new_tokens}"
    return None


def seeded_draws(sampling: Sampling, device: torch.device) -> torch.Generator:
    """The generator a command's sampled tokens are drawn from, one for all its batches or turns: each
    batch seeded anew would draw what the one before drew (best-of-N samples would repeat)."""
    return torch.Generator(device=device).manual_seed(sampling.seed)


class Sampler:
    """Picks each row's next token from its logits; sampled draws come from one seeded generator, so a
    run with the same seed, prompts and batch repeats exactly."""

    def __init__(self, sampling: Sampling, device: torch.device, draws: torch.Generator | None = None):
        if problem := sampling_problem(sampling):
            raise QLoraError(problem)
        self.sampling = sampling
        self.generator = draws if draws is not None else seeded_draws(sampling, device)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        s = self.sampling
        if s.temperature == 0:
            return logits.argmax(dim=-1)
        # Shifted so each row's best logit is 0 and the rest are negative, no temperature, however
        # small, can overflow the softmax into inf/nan. The floor at fp32's smallest normal number keeps
        # the best logit's 0 / temperature from becoming 0 / 0 where denormals flush to zero.
        logits = logits.float()
        temperature = max(s.temperature, torch.finfo(torch.float32).tiny)
        logits = (logits - logits.amax(dim=-1, keepdim=True)) / temperature
        if s.top_k and s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1:
            ordered, order = torch.sort(logits, dim=-1, descending=True)
            probs = torch.softmax(ordered, dim=-1)
            # Drop a token once the more likely ones already reach top_p; the likeliest always stays.
            drop = (torch.cumsum(probs, dim=-1) - probs) >= s.top_p
            logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
        probs = torch.softmax(logits, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)[:, 0]


@dataclass
class Completion:
    """One prompt's generated tokens (the stop token left out) and why generation ended:
    "stop" (a stop token), "length" (max_new_tokens) or "context" (the model's last position)."""

    prompt_tokens: int
    ids: list[int] = field(default_factory=list)
    finish: str = ""


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    tokens: int = 0


TokenCallback = Callable[[int, int], None]


def generate_ids(
    engine: DecodingEngine,
    prompts: Sequence[Sequence[int]],
    sampling: Sampling,
    stop_ids: set[int],
    *,
    on_token: TokenCallback | None = None,
    timing: Timing | None = None,
    draws: torch.Generator | None = None,
) -> list[Completion]:
    """Decode every prompt (token ids, none empty, each shorter than the model's context) as one batch.
    on_token(row, id) hears each kept token as it is chosen; timing, when given, receives the prefill
    and decode times; `draws` (seeded_draws) carries the random stream on from an earlier call."""
    device = engine.decoder.device
    sampler = Sampler(sampling, device, draws)
    limit = engine.max_positions
    longest = max(len(p) for p in prompts)
    if longest >= limit:
        # Callers refuse such prompts with their own message (prompt_inputs.check_fits, chat's fit).
        raise ValueError(f"a prompt of {longest} tokens leaves no room in the model's context of {limit}")
    cache, step = engine.prepare(len(prompts), min(limit, longest + sampling.max_new_tokens))
    completions = [Completion(len(p)) for p in prompts]
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    started = time.perf_counter()
    logits = engine.prefill(cache, prompts)
    for number in range(sampling.max_new_tokens):
        chosen = sampler(logits)
        if number == 0:
            sync()
            prefilled = time.perf_counter()
        for row, token in enumerate(chosen.tolist()):
            completion = completions[row]
            if completion.finish:
                continue
            if token in stop_ids:
                completion.finish = "stop"
                continue
            completion.ids.append(token)
            if on_token is not None:
                on_token(row, token)
            if len(completion.ids) == sampling.max_new_tokens:
                completion.finish = "length"
            elif completion.prompt_tokens + len(completion.ids) >= cache.capacity:
                completion.finish = "context"
        if all(c.finish for c in completions):
            break
        # Finished rows keep stepping (their results unused) at a position the cache holds.
        logits = step(chosen, lengths.clamp(max=cache.capacity - 1))
        lengths += 1
    sync()
    if timing is not None:
        timing.prefill_s += prefilled - started
        timing.decode_s += time.perf_counter() - prefilled
        timing.decode_steps += number
        timing.tokens += sum(len(c.ids) for c in completions)
    return completions
