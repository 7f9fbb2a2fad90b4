"""The chat template a config chooses: the tokenizer's own, one of the few qlora ships, or the user's jinja.

The shipped templates write the ChatML turns every Qwen vocabulary has (<|im_start|>, <|im_end|>):
`chatml` plain, `qwen_25` with Qwen2.5's default system message and tool turns, `qwen3` with Qwen3's
think blocks. Axolotl's other names (llama3, mistral, gemma, ...) write tokens Qwen models lack.
"""

from __future__ import annotations

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

SHIPPED = dict(zip(SHIPPED_TEMPLATES, (CHATML, QWEN_25, QWEN3), strict=True))


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
        return tokenizer.with_chat_template(SHIPPED[name], f"chat_template {name}")
    if name.startswith(FALLBACK_TEMPLATE):
        if tokenizer.chat_template is not None:
            return tokenizer
        fallback = name.removeprefix(FALLBACK_TEMPLATE)
        return tokenizer.with_chat_template(SHIPPED[fallback], f"chat_template {fallback}")
    return tokenizer.with_chat_template(name, "chat_template")
