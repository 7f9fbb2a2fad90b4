"""Rows to text: each dataset type renders a row as (text, trained) pieces; only trained text gets labels.

Types follow Axolotl's names. `chat_template` renders messages (or ShareGPT `conversations` with
`from`/`value`) with the chosen chat template, maps dataset roles (human, gpt, ...) to the template's
(user, assistant, ...), and trains the content of the turns whose role is in roles_to_train plus, per
train_on_eos, their end-of-turn token; role headers are never trained. `alpaca` variants, `completion`,
`text` and `input_output` build their text here and end it with the end-of-sequence token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qlora_cli.config.checks import type_problem
from qlora_cli.config.schema import DatasetConfig, InstructionFormat
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.jsonl import json_type
from qlora_cli.core.names import DATASET_TYPES
from qlora_cli.sources.chat_templates import CHATML
from qlora_cli.sources.tokenizer import ChatTokenizer

ALPACA_SYSTEM = "Below is an instruction that describes a task, paired with an input that provides further context. Write a response that appropriately completes the request.\n\n"
ALPACA_SYSTEM_NO_INPUT = "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
ALPACA_STYLES = {
    "instruct": ("### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n",
                 "### Instruction:\n{instruction}\n\n### Response:\n"),
    "chat": ("USER: {instruction}\n{input}\nASSISTANT:", "USER: {instruction}\nASSISTANT:"),
}  # fmt: skip

# The roles chat templates render, and the names datasets give them: Axolotl's defaults (human, gpt),
# the assistant names of real ShareGPT dumps (chatgpt, bing, bard), OpenAssistant's prompter, Gemma's
# model, and LLaMA-Factory's function/observation tool turns.
TEMPLATE_ROLES = ("system", "user", "assistant", "tool")
DEFAULT_ROLES = {
    **dict.fromkeys(("human", "user", "prompter"), "user"),
    **dict.fromkeys(("gpt", "chatgpt", "bing", "bard", "bot", "model", "assistant"), "assistant"),
    "system": "system",
    **dict.fromkeys(("tool", "function", "observation"), "tool"),
}
_SENTINEL = "\ue000qlora-content\ue001"


@dataclass(frozen=True)
class PromptFormat:
    """What a dataset `type` renders: kind is alpaca, chat, completion, text or input_output; style is
    alpaca's prompt layout (instruct, chat, chatml, or the chosen chat_template)."""

    kind: str
    style: str = ""


_TYPES = {name: PromptFormat(kind, style) for name, (kind, style) in DATASET_TYPES.items()}


def prompt_format(name: str | InstructionFormat) -> PromptFormat:
    problem = type_problem(name)
    if problem:
        raise QLoraError(problem)
    return _TYPES[name] if isinstance(name, str) else PromptFormat("alpaca", "user_defined")


@dataclass
class Rendered:
    """A row as (text, trained) pieces; for chats also its roles, and whether any turn was meant to train."""

    segments: list[tuple[str, bool]]
    roles: tuple[str, ...] = ()
    trains_a_turn: bool = True


def string_field(row: dict, name: str, where: str, *, optional: bool = False) -> str:
    if name not in row or (optional and row[name] is None):
        if optional:
            return ""
        raise QLoraError(f"{where}: missing field {name!r}")
    value = row[name]
    if not isinstance(value, str):
        raise QLoraError(f"{where}: field {name!r} must be a string, got {json_type(value)}")
    return value


def _end_token(spec: DatasetConfig, tokenizer: ChatTokenizer) -> tuple[str, bool]:
    return tokenizer.eos_token, spec.train_on_eos != "none"


# ----- alpaca, completion, text, input_output -----


def _alpaca(
    row: dict, where: str, spec: DatasetConfig, style: str, tokenizer: ChatTokenizer, **kw
) -> Rendered:
    names = spec.type if style == "user_defined" else spec
    instruction = string_field(row, names.field_instruction, where)
    context = string_field(row, names.field_input, where, optional=True)
    output = string_field(row, names.field_output, where)
    system = string_field(row, names.field_system, where, optional=True)
    end = _end_token(spec, tokenizer)
    if style in ("chatml", "chat_template"):
        user = f"{instruction}\n{context}" if context.strip() else instruction
        messages = [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
        if system:
            messages.insert(0, {"role": "system", "content": system})
        if style == "chatml":
            tokenizer = tokenizer.with_chat_template(CHATML, "chat_template chatml")
        return _chat_turns(messages, where, spec, tokenizer, **kw)
    if style == "user_defined":
        form = spec.type
        system = system or form.system_prompt
        if form.format is not None:
            layout = form.format if context.strip() or form.no_input_format is None else form.no_input_format
            prompt = form.system_format.format(system=system) if system else ""
            prompt += layout.format(instruction=instruction, input=context)
            return Rendered([(prompt, kw["train_on_inputs"]), (output, True), end])
        style = "instruct"
    with_input, without_input = ALPACA_STYLES[style]
    if context.strip():
        prompt = (system or ALPACA_SYSTEM) + with_input.format(instruction=instruction, input=context)
    else:
        prompt = (system or ALPACA_SYSTEM_NO_INPUT) + without_input.format(instruction=instruction)
    return Rendered([(prompt, kw["train_on_inputs"]), (output, True), end])


def _completion(row: dict, where: str, spec: DatasetConfig, tokenizer: ChatTokenizer, **kw) -> Rendered:
    """prompt/completion pairs train the completion; a row with only a text field trains it all, as in Axolotl."""
    text_field = spec.field or spec.field_text
    if spec.field_prompt not in row and spec.field_completion not in row and text_field in row:
        return _text(row, where, spec, tokenizer)
    return Rendered(
        [
            (string_field(row, spec.field_prompt, where), kw["train_on_inputs"]),
            (string_field(row, spec.field_completion, where), True),
            _end_token(spec, tokenizer),
        ]
    )


def _text(row: dict, where: str, spec: DatasetConfig, tokenizer: ChatTokenizer, **kw) -> Rendered:
    return Rendered(
        [(string_field(row, spec.field or spec.field_text, where), True), _end_token(spec, tokenizer)]
    )


def _input_output(row: dict, where: str, spec: DatasetConfig, tokenizer: ChatTokenizer, **kw) -> Rendered:
    """Axolotl's template-free format: {"segments": [{"text": ..., "label": true|false}]}, nothing added."""
    segments = row.get("segments")
    if not isinstance(segments, list) or not segments:
        raise QLoraError(f"{where}: field 'segments' must be a non-empty list of {{text, label}} objects")
    pieces = []
    for index, segment in enumerate(segments):
        at = f"{where}: segment {index}"
        if not isinstance(segment, dict):
            raise QLoraError(f"{at}: expected an object, got {json_type(segment)}")
        label = segment.get("label", True)
        if not isinstance(label, bool):
            raise QLoraError(f"{at}: field 'label' must be true or false, got {json_type(label)}")
        pieces.append((string_field(segment, "text", at), label or kw["train_on_inputs"]))
    return Rendered(pieces)


# ----- chat -----


def _role_map(spec: DatasetConfig) -> dict[str, str]:
    """Dataset role -> template role: the ShareGPT defaults, then the config's `roles` (template: [names])."""
    mapping = dict(DEFAULT_ROLES)
    for target, sources in (spec.roles or {}).items():
        for source in sources:
            mapping[source] = target
    return mapping


def _message_fields(spec: DatasetConfig, first: dict) -> dict[str, str]:
    """Message key -> field in the data; role/content default to role/content, else ShareGPT's from/value."""
    mappings = dict(spec.message_property_mappings or {})
    if spec.message_field_role:
        mappings.setdefault("role", spec.message_field_role)
    if spec.message_field_content:
        mappings.setdefault("content", spec.message_field_content)
    if "role" not in mappings:
        mappings["role"] = "from" if "role" not in first and "from" in first else "role"
    if "content" not in mappings:
        mappings["content"] = "value" if "content" not in first and "value" in first else "content"
    return mappings


def _template_role(role: str, roles: dict[str, str], spec: DatasetConfig, at: str) -> str:
    """The template role of a dataset role; a name neither the defaults nor the config's `roles` map
    would be rendered as it is and never trained, so it stops the run."""
    target = roles.get(role, role)
    if target not in TEMPLATE_ROLES and target not in (spec.roles or {}):
        raise QLoraError(
            f"{at}: role {role!r} is not one the chat template knows ({', '.join(TEMPLATE_ROLES)}); "
            f"name its template role in the dataset's roles, e.g. roles: {{assistant: [{role}]}}"
        )
    return target


def _check_content(message: dict, field: str, at: str) -> None:
    """A message's content is text. Null only where OpenAI's format writes it, in an assistant turn that
    makes tool calls, which templates render as no text; any other null would reach the template, which
    fails on it or renders an empty turn that trains."""
    content = message["content"]
    if isinstance(content, str):
        return
    if content is None and message["role"] == "assistant" and message.get("tool_calls"):
        return
    only_with_tool_calls = " (null only in an assistant turn with tool_calls)" if content is None else ""
    raise QLoraError(
        f"{at}: field {field!r} must be a string, got {json_type(content)}{only_with_tool_calls}"
    )


def chat_messages(row: dict, where: str, spec: DatasetConfig) -> list[dict]:
    """The row's messages with template roles and the keys templates read (role, content, ...)."""
    field = spec.field_messages
    if field is None:
        field = "conversations" if "messages" not in row and "conversations" in row else "messages"
    if field not in row:
        raise QLoraError(
            f"{where}: missing field {field!r} (set field_messages to the column of the messages)"
        )
    raw = row[field]
    if not isinstance(raw, list) or not raw:
        raise QLoraError(f"{where}: field {field!r} must be a non-empty list of messages")
    roles = _role_map(spec)
    fields = _message_fields(spec, raw[0] if isinstance(raw[0], dict) else {})
    mapped_sources = set(fields.values())
    messages = []
    for index, message in enumerate(raw):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise QLoraError(f"{at}: expected an object, got {json_type(message)}")
        role = string_field(message, fields["role"], at)
        if fields["content"] not in message:
            raise QLoraError(f"{at}: missing field {fields['content']!r}")
        converted: dict[str, Any] = {k: v for k, v in message.items() if k not in mapped_sources}
        for key, source in fields.items():
            if key not in ("role", "content") and source in message:
                converted[key] = message[source]
        converted.update(role=_template_role(role, roles, spec, at), content=message[fields["content"]])
        _check_content(converted, fields["content"], at)
        if spec.drop_system_message and converted["role"] == "system":
            continue
        messages.append(converted)
    if not messages:
        raise QLoraError(f"{where}: no messages are left after drop_system_message")
    return messages


def _end_of_turn(turn: str, tokenizer: ChatTokenizer) -> tuple[int, int] | None:
    """Where a turn's end-of-turn token sits in its text: the special token the turn ends with (trailing
    whitespace aside), else its last eos token; None when it has neither."""
    body = turn.rstrip()
    for token in (tokenizer.eos_token, *tokenizer.special_tokens):
        if body.endswith(token):
            return len(body) - len(token), len(body)
    at = turn.rfind(tokenizer.eos_token)
    return None if at < 0 else (at, at + len(tokenizer.eos_token))


def _turn_end(full: str, start: int, turn: str, tokenizer: ChatTokenizer) -> int | None:
    """Where a turn whose own rendering is `turn` ends inside `full`, given it starts at `start`.

    Exact when the conversation's rendering extends the turn's own. Some templates decorate only the
    last assistant turn (Qwen3 adds an empty <think></think> block there), so otherwise the longest tail
    of the turn's own text, end-of-turn token included, found at `start` is taken; None when none is.
    """
    if full.startswith(turn, start):
        return start + len(turn)
    end_of_turn = _end_of_turn(turn, tokenizer)
    longest_cut = end_of_turn[0] if end_of_turn else len(turn) - 1
    for cut in range(1, longest_cut + 1):
        if full.startswith(turn[cut:], start):
            return start + len(turn) - cut
    return None


@dataclass
class _Turn:
    """Where one turn's trained text sits in the conversation's rendering: [start, end), then its
    end-of-turn token at `end_of_turn` (None when the template writes none)."""

    start: int
    end: int
    end_of_turn: tuple[int, int] | None


class _Renderer:
    """Renders a conversation and sub-conversations of it with one tokenizer, template variables and row."""

    def __init__(self, tokenizer: ChatTokenizer, messages: list[dict], where: str, variables: dict):
        self.tokenizer, self.messages, self.where, self.variables = tokenizer, messages, where, variables
        self.full = self.render(messages)

    def render(self, messages: list[dict], gen: bool = False) -> str:
        if not messages and not gen:
            return ""
        try:
            return self.tokenizer.render_chat(messages, add_generation_prompt=gen, **self.variables)
        except QLoraError as error:
            raise QLoraError(f"{self.where}: {error}") from None

    def _with_probe(self, messages: list[dict], index: int) -> tuple[str, int]:
        probe = self.render(
            [*messages[:index], {**messages[index], "content": _SENTINEL}, *messages[index + 1 :]]
        )
        return probe, probe.find(_SENTINEL)

    def _content_start(self, index: int, before: str) -> int | None:
        """After the generation prompt for an assistant turn (what the model writes after it is trained,
        a think block the template adds included), else after the role header the template writes
        before a placeholder content."""
        full = self.full
        if self.messages[index]["role"] == "assistant":
            prompt = self.render(self.messages[:index], gen=True)
            if prompt.startswith(before) and full.startswith(prompt):
                return len(prompt)
        probe, at = self._with_probe(self.messages[: index + 1], index)
        if (
            at < len(before)
            or not probe.startswith(before)
            or not full.startswith(probe[len(before) : at], len(before))
        ):
            return None
        return at

    def _by_prefixes(self, index: int) -> _Turn | None:
        """The turn found by rendering the conversation up to it; None when the template renders earlier
        turns differently once later ones follow (Qwen3 drops a past answer's think block)."""
        full = self.full
        before = self.render(self.messages[:index])
        through = self.render(self.messages[: index + 1])
        if not full.startswith(before) or not through.startswith(before):
            return None
        start = self._content_start(index, before)
        if start is None or not through.startswith(full[:start]):
            return None
        end = _turn_end(full, start, through[start:], self.tokenizer)
        if end is None:
            return None
        end_of_turn = _end_of_turn(full[start:end], self.tokenizer)
        if end_of_turn is None:
            return _Turn(start, end, None)
        return _Turn(start, start + end_of_turn[0], (start + end_of_turn[0], start + end_of_turn[1]))

    def _by_placeholder(self, index: int) -> _Turn | None:
        """The turn found by rendering the whole conversation with a placeholder for its content: what the
        two renderings share before and after the placeholder is not the content; trained text runs on to
        the next end-of-turn token (tool calls the template writes after the content included)."""
        full = self.full
        probe, at = self._with_probe(self.messages, index)
        suffix = probe[at + len(_SENTINEL) :]
        if (
            at < 0
            or not full.startswith(probe[:at])
            or not full.endswith(suffix)
            or len(full) - len(suffix) < at
        ):
            return None
        content_end = len(full) - len(suffix)
        ends = [
            (full.find(token, content_end), token)
            for token in (self.tokenizer.eos_token, *self.tokenizer.special_tokens)
        ]
        found = [(position, token) for position, token in ends if position >= 0]
        if not found:
            return _Turn(at, content_end, None)
        position, token = min(found)
        return _Turn(at, position, (position, position + len(token)))

    def turn(self, index: int) -> _Turn:
        found = self._by_prefixes(index) or self._by_placeholder(index)
        if found is None:
            raise QLoraError(
                f"{self.where}: message {index}: the chat template renders this turn differently inside the "
                "whole conversation, so its trained tokens cannot be found"
            )
        return found


def _chat_turns(
    messages: list[dict], where: str, spec: DatasetConfig, tokenizer: ChatTokenizer, *, train_on_inputs: bool,
    variables: dict,
) -> Rendered:  # fmt: skip
    """The conversation's rendering, cut into trained and untrained text turn by turn."""
    roles_to_train = {_role_map(spec).get(role, role) for role in spec.roles_to_train}
    renderer = _Renderer(tokenizer, messages, where, variables)
    full = renderer.full
    trained: list[tuple[int, int]] = []
    ends: list[tuple[int, int, bool]] = []
    cursor = 0
    for index, message in enumerate(messages):
        flag = message.get(spec.message_field_training)
        train = flag if isinstance(flag, bool) else train_on_inputs or message["role"] in roles_to_train
        if not train and spec.train_on_eos not in ("all", "last"):
            continue
        turn = renderer.turn(index)
        if turn.start < cursor:
            raise QLoraError(
                f"{where}: message {index}: the chat template renders the turns out of order, "
                "so its trained tokens cannot be found"
            )
        if train:
            trained.append((turn.start, turn.end))
        if turn.end_of_turn:
            ends.append((*turn.end_of_turn, train))
        cursor = turn.end_of_turn[1] if turn.end_of_turn else turn.end
    if spec.train_on_eos == "last":
        trained += [(a, b) for a, b, _ in ends[-1:]]
    elif spec.train_on_eos != "none":
        trained += [(a, b) for a, b, turn_trained in ends if turn_trained or spec.train_on_eos == "all"]
    segments: list[tuple[str, bool]] = []
    position = 0
    for start, end in sorted(trained):
        segments += [(full[position:start], False), (full[start:end], True)]
        position = end
    segments.append((full[position:], False))
    trains_a_turn = any(
        train_on_inputs or m["role"] in roles_to_train or m.get(spec.message_field_training) is True
        for m in messages
    )
    return Rendered(segments, tuple(m["role"] for m in messages), trains_a_turn)


def render_row(
    row: dict,
    where: str,
    spec: DatasetConfig,
    tokenizer: ChatTokenizer,
    *,
    train_on_inputs: bool,
    variables: dict,
) -> Rendered:
    """One row of a dataset as trained and untrained text."""
    form = prompt_format(spec.type)
    options = {"train_on_inputs": train_on_inputs, "variables": variables}
    if form.kind == "chat":
        return _chat_turns(chat_messages(row, where, spec), where, spec, tokenizer, **options)
    if form.kind == "alpaca":
        return _alpaca(row, where, spec, form.style, tokenizer, **options)
    render = {"completion": _completion, "text": _text, "input_output": _input_output}[form.kind]
    return render(row, where, spec, tokenizer, **options)
