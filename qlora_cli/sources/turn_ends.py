"""The tokens that end a model's answer under a run's chat template: where `qlora generate` and `chat`
stop, what a merged export's generation_config.json and an Ollama Modelfile stop on, and the GGUF's
end-of-turn token, so that every place a trained model answers stops where training taught it to."""

from __future__ import annotations

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.tokenizer import ChatTokenizer

_PROBE = "\ue000qlora-answer\ue001"
# Llama 3 closes a chat turn with <|eot_id|>, a tool call's turn with <|eom_id|> and a text with
# <|end_of_text|>; a model may end its answer with any of them.
_ALSO_ENDS = {"<|eot_id|>": ("<|eom_id|>", "<|end_of_text|>")}


def end_of_turn(tokenizer: ChatTokenizer, variables: dict) -> str | None:
    """The special token that closes an assistant turn: the one a shipped template declares, else the
    first special token the chat template writes after an assistant's answer, if it writes one."""
    if tokenizer.end_of_turn is not None:
        return tokenizer.end_of_turn
    if tokenizer.chat_template is None:
        return None
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = tokenizer.render_chat(messages, **variables)
    except QLoraError:
        return None
    after = text[text.find(_PROBE) + len(_PROBE) :] if _PROBE in text else ""
    found = [(after.find(t), t) for t in tokenizer.special_tokens if t in after]
    return min(found)[1] if found else None


def stop_tokens(tokenizer: ChatTokenizer, variables: dict) -> list[str]:
    """The end of a turn first, the other ends of its family, then eos: those the vocabulary holds."""
    turn_end = end_of_turn(tokenizer, variables)
    ends = [*([turn_end, *_ALSO_ENDS.get(turn_end, ())] if turn_end else []), tokenizer.eos_token]
    held = [token for token in ends if token is not None and tokenizer.token_to_id(token) is not None]
    return list(dict.fromkeys(held))


def stop_ids(tokenizer: ChatTokenizer, variables: dict) -> set[int]:
    return {tokenizer.token_to_id(token) for token in stop_tokens(tokenizer, variables)}
