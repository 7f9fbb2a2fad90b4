"""The chat template a config chooses: the tokenizer's own, one of those qlora ships, or the user's jinja.

The shipped ones render what Axolotl's templates of the same name render. `chatml`, `qwen_25` (Qwen2.5's
default system message and tool turns) and `qwen3` (think blocks) write ChatML turns; `llama3` writes
Llama 3's header turns; the `mistral_*` ones write [INST] turns closed by the eos token. Each template
says which tokens its turns need, so a template the vocabulary cannot write is refused by what the
tokenizer holds, and which text ends an assistant turn (where generation stops).
"""

from __future__ import annotations

from dataclasses import dataclass

from qlora_cli.config.checks import template_problem
from qlora_cli.core.errors import QLoraError
from qlora_cli.core.names import FALLBACK_TEMPLATE, SHIPPED_TEMPLATES
from qlora_cli.sources.tokenizer import ChatTokenizer

_TOOL_TURNS = (
    "{%- if message.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + (message.content or '') + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
)
_TOOL_CALLS = (
    "{%- for call in message.tool_calls or [] %}"
    "{%- set function = call.function or call %}"
    "{%- if not loop.first or content %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (function.name | tojson) + ', \"arguments\": ' }}"
    "{{- function.arguments if function.arguments is string else (function.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
)

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

QWEN_25 = (
    "{%- if not messages or messages[0].role != 'system' %}"
    "{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set content = message.content or '' %}" + _TOOL_TURNS + "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Assistant turns after the last user message carry their reasoning in a think block (empty when there
# is none); earlier ones drop it, as Qwen3 shows past turns.
QWEN3 = (
    "{%- set ns = namespace(last_query=-1) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content or '' %}" + _TOOL_TURNS + "{%- elif message.role == 'assistant' %}"
    "{%- set reasoning = message.reasoning_content or '' %}"
    "{%- if '</think>' in content %}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if loop.index0 > ns.last_query %}"
    "{{- '<think>\\n' + reasoning.strip('\\n') + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- content }}" + _TOOL_CALLS + "{{- '<|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}"
)

# Llama 3.0 Instruct's turns (Axolotl's `llama3`): BOS, then a header per message and content trimmed;
# no default system message and no date, so a row renders the same on any day.
LLAMA3 = (
    "{%- for message in messages %}"
    "{%- set content = message.content or '' %}"
    "{%- if content is not string %}"
    "{%- set content = content | selectattr('text', 'defined') | map(attribute='text') | join('') %}"
    "{%- endif %}"
    "{%- if loop.first %}{{- bos_token }}{%- endif %}"
    "{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + content | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)


def _mistral(user: str, assistant: str, system_on: str) -> str:
    """Mistral's [INST] turns: roles alternate from a user turn, an assistant turn ends with eos, and the
    system message joins the first user turn (`first`) or only a final user turn (`last`: a training row,
    which ends with the assistant, renders without it, as Mistral's own v2/v3 templates do)."""
    return (
        "{%- if messages and messages[0].role == 'system' %}"
        "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
        "{%- else %}{%- set system = '' %}{%- set turns = messages %}{%- endif %}"
        "{{- bos_token }}"
        "{%- for message in turns %}"
        "{%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
        "{%- endif %}"
        "{%- set content = message.content or '' %}"
        "{%- if message.role == 'user' %}"
        f"{{%- if system and loop.{system_on} %}}{{%- set content = system + '\\n\\n' + content %}}{{%- endif %}}"
        f"{{{{- {user} }}}}"
        f"{{%- else %}}{{{{- {assistant} + eos_token }}}}"
        "{%- endif %}"
        "{%- endfor %}"
    )


MISTRAL_V1 = _mistral("' [INST] ' + content + ' [/INST]'", "' ' + content", "first")
MISTRAL_V2V3 = _mistral("'[INST] ' + content + '[/INST]'", "' ' + content | trim", "last")
MISTRAL_V3_TEKKEN = _mistral("'[INST]' + content + '[/INST]'", "content", "last")

# Mistral Small 3's: a system prompt always, Mistral's default one (with today's date) when the chat has none.
MISTRAL_V7_TEKKEN = (
    "{%- set default_system = 'You are Mistral Small 3, a Large Language Model (LLM) created by Mistral AI, a "
    "French startup headquartered in Paris.\\nYour knowledge base was last updated on 2023-10-01. The current "
    "date is ' + strftime_now('%Y-%m-%d') + '.\\n\\nWhen you\\'re not sure about some information, you say "
    "that you don\\'t have the information and don\\'t make up anything.\\nIf the user\\'s question is not "
    "clear, ambiguous, or does not provide enough context for you to accurately answer the question, you do "
    'not try to answer it right away and you rather ask the user to clarify their request (e.g. "What are '
    'some good restaurants around me?" => "Where are you?" or "When is the next flight to Tokyo" => '
    '"Where do you travel from?")\' %}'
    "{{- bos_token }}"
    "{%- if messages and messages[0].role == 'system' %}"
    "{%- set system = messages[0].content %}{%- set turns = messages[1:] %}"
    "{%- else %}{%- set system = default_system %}{%- set turns = messages %}{%- endif %}"
    "{{- '[SYSTEM_PROMPT]' + system + '[/SYSTEM_PROMPT]' }}"
    "{%- for message in turns %}"
    "{%- set content = message.content or '' %}"
    "{%- if message.role == 'user' %}{{- '[INST]' + content + '[/INST]' }}"
    "{%- elif message.role == 'system' %}{{- '[SYSTEM_PROMPT]' + content + '[/SYSTEM_PROMPT]' }}"
    "{%- elif message.role == 'assistant' %}{{- content + eos_token }}"
    "{%- else %}{{- raise_exception('Only user, system and assistant roles are supported!') }}"
    "{%- endif %}"
    "{%- endfor %}"
)


@dataclass(frozen=True)
class ShippedTemplate:
    """A template qlora ships: its jinja, the tokens its turns write (the vocabulary must hold each as one
    token), whether it starts with the BOS token, and the text that ends an assistant turn (None: the
    tokenizer's eos token)."""

    text: str
    tokens: tuple[str, ...]
    end_of_turn: str | None
    needs_bos: bool = False


_CHATML_TOKENS = ("<|im_start|>", "<|im_end|>")
_LLAMA3_TOKENS = ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Mistral v0.1/v0.2 spell [INST] with ordinary tokens; v0.3 and tekken hold it as one control token.
_TEKKEN_TOKENS = ("[INST]", "[/INST]")

SHIPPED = dict(
    zip(
        SHIPPED_TEMPLATES,
        (
            ShippedTemplate(CHATML, _CHATML_TOKENS, "<|im_end|>"),
            ShippedTemplate(QWEN_25, _CHATML_TOKENS, "<|im_end|>"),
            ShippedTemplate(QWEN3, _CHATML_TOKENS, "<|im_end|>"),
            ShippedTemplate(LLAMA3, _LLAMA3_TOKENS, "<|eot_id|>", needs_bos=True),
            ShippedTemplate(MISTRAL_V1, (), None, needs_bos=True),
            ShippedTemplate(MISTRAL_V2V3, (), None, needs_bos=True),
            ShippedTemplate(MISTRAL_V3_TEKKEN, _TEKKEN_TOKENS, None, needs_bos=True),
            ShippedTemplate(
                MISTRAL_V7_TEKKEN,
                (*_TEKKEN_TOKENS, "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"),
                None,
                needs_bos=True,
            ),
        ),
        strict=True,
    )
)


def _missing(template: ShippedTemplate, tokenizer: ChatTokenizer) -> str | None:
    """What the tokenizer lacks to write the template's turns, or None."""
    lacking = [token for token in template.tokens if tokenizer.token_to_id(token) is None]
    if lacking:
        return repr(lacking[0])
    return "a BOS token" if template.needs_bos and tokenizer.bos_token is None else None


def _shipped(tokenizer: ChatTokenizer, name: str, asked: str) -> ChatTokenizer:
    """The shipped template `name` (the config asked for `asked`), if the tokenizer can write it."""
    template = SHIPPED[name]
    lacking = _missing(template, tokenizer)
    if lacking is not None:
        fitting = [other for other, t in SHIPPED.items() if _missing(t, tokenizer) is None]
        raise QLoraError(
            f"config key 'chat_template': '{asked}' writes {lacking}, which the tokenizer of {tokenizer.source} "
            f"lacks; use one it can write ({', '.join(['tokenizer_default', *fitting])}), "
            "or put a template in chat_template_jinja"
        )
    end_of_turn = template.end_of_turn or tokenizer.eos_token
    return tokenizer.with_chat_template(template.text, f"chat_template {name}", end_of_turn=end_of_turn)


def choose_template(tokenizer: ChatTokenizer, name: str | None, jinja: str | None) -> ChatTokenizer:
    """The tokenizer with the chat template the config names (the tokenizer itself by default)."""
    problem = template_problem(name, jinja)
    if problem:
        raise QLoraError(problem)
    if jinja is not None and name in (None, "jinja"):
        return tokenizer.with_chat_template(jinja, "chat_template_jinja")
    if name is None or name == "tokenizer_default":
        return tokenizer
    if name in SHIPPED:
        return _shipped(tokenizer, name, name)
    if name.startswith(FALLBACK_TEMPLATE):
        if tokenizer.chat_template is not None:
            return tokenizer
        return _shipped(tokenizer, name.removeprefix(FALLBACK_TEMPLATE), name)
    return tokenizer.with_chat_template(name, "chat_template")
