"""The Ollama Modelfile beside a GGUF export.

Ollama renders prompts with Go templates, not the Jinja template in the GGUF. When the run's chat
template renders chats as plain ChatML (Qwen's <|im_start|>role ... <|im_end|> turns), possibly with a
default system turn, the Modelfile says the same in Go; the probe below checks that by rendering the
run's template, so a template that does anything else gets no TEMPLATE line rather than a wrong one.
"""

from __future__ import annotations

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.tokenizer import ChatTokenizer
from qlora_cli.sources.turn_ends import stop_tokens

START, END = "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{{- range .Messages }}"
    + START
    + "{{ .Role }}\n{{ .Content }}"
    + END
    + "\n{{ end }}"
    + START
    + "assistant\n"
)
_PROBE = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3+3?"},
]
_SYSTEM = {"role": "system", "content": "Answer briefly."}


def chatml(messages: list[dict]) -> str:
    """What CHATML_TEMPLATE renders for `messages`, with the generation prompt."""
    turns = "".join(f"{START}{m['role']}\n{m['content']}{END}\n" for m in messages)
    return f"{turns}{START}assistant\n"


def _render(tokenizer: ChatTokenizer, messages: list[dict]) -> str | None:
    try:
        return tokenizer.render_chat(messages, add_generation_prompt=True)
    except QLoraError:
        return None


def chatml_system(tokenizer: ChatTokenizer) -> tuple[bool, str | None]:
    """(whether the template is ChatML, the system prompt it adds when a chat has none)."""
    if tokenizer.chat_template is None or _render(tokenizer, [_SYSTEM, *_PROBE]) != chatml(
        [_SYSTEM, *_PROBE]
    ):
        return False, None
    plain = _render(tokenizer, _PROBE)
    if plain == chatml(_PROBE):
        return True, None
    rest = chatml(_PROBE)
    head = f"{START}system\n"
    if plain and plain.startswith(head) and plain.endswith(END + "\n" + rest):
        return True, plain[len(head) : -len(END + "\n" + rest)]
    return False, None


_WHITESPACE = " \t\r\n"
_UNQUOTABLE = "# Left out: the {}, whose quotes before a space or line break no Modelfile quoting holds."


def quote(text: str, marks: tuple[str, ...] = ('"""', '"')) -> str | None:
    """`text` as a quoted Modelfile argument that Ollama reads back as `text`, with the first of `marks`
    that can hold it; None where none can.

    Modelfiles have no escapes: a quoted argument ends at the first space or line break that follows
    its closing mark. So a mark holds text in which that mark never precedes whitespace, and `"` also
    needs text that does not open with `""` (read as the opening of a triple quote).
    """
    for mark in marks:
        opens_triple = mark == '"' and text.startswith('""')
        ends_early = any(c in _WHITESPACE and text[:i].endswith(mark) for i, c in enumerate(text))
        if not opens_triple and not ends_early:
            return mark + text + mark
    return None


def modelfile(gguf_name: str, tokenizer: ChatTokenizer, variables: dict) -> str:
    """FROM the GGUF, the run's chat format as a Go TEMPLATE (and SYSTEM) when it is ChatML, and the
    tokens that end an answer, where `qlora generate` stops (`variables`: the template's)."""
    is_chatml, system = chatml_system(tokenizer)
    lines = [f"FROM ./{gguf_name}"]
    if is_chatml:
        lines.append(f"TEMPLATE {quote(CHATML_TEMPLATE)}")
        if system is not None:
            quoted = quote(system)
            lines.append(f"SYSTEM {quoted}" if quoted else _UNQUOTABLE.format("default system prompt"))
    else:
        lines.insert(
            0, "# The chat template is not plain ChatML; Ollama derives one from the GGUF's chat template."
        )
    for token in stop_tokens(tokenizer, variables):
        quoted = quote(token, ('"', '"""'))
        lines.append(f"PARAMETER stop {quoted}" if quoted else _UNQUOTABLE.format(f"stop token {token!r}"))
    return "\n".join(lines) + "\n"
