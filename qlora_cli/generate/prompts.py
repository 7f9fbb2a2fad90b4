"""The prompts `qlora generate` is given, as text or chats, turned into the token ids the model reads.

A prompt is a string (--prompt, or a `prompt` field) or a chat (a `messages` field: role/content objects,
as chat datasets write them). Unless --raw, a string becomes one user turn and every chat is rendered
with the run's chat template and the generation prompt, as training rendered its turns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from qlora_cli.core.errors import QLoraError
from qlora_cli.core.jsonl import json_lines, json_type
from qlora_cli.core.text import text_problem
from qlora_cli.core.wording import count, number
from qlora_cli.sources.tokenizer import ChatTokenizer


@dataclass
class Prompt:
    """A string prompt or a chat, and where it came from (for error lines)."""

    where: str
    text: str | None = None
    messages: list[dict] | None = None

    def record(self) -> dict:
        """The prompt as the output file shows it."""
        return {"prompt": self.text} if self.messages is None else {"messages": self.messages}


def _messages(value, where: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise QLoraError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
    for index, message in enumerate(value):
        at = f"{where}: message {index}"
        if not isinstance(message, dict):
            raise QLoraError(f"{at}: expected an object, got {json_type(message)}")
        if not isinstance(message.get("role"), str):
            raise QLoraError(f"{at}: field 'role' must be a string")
        if not isinstance(message.get("content"), str):
            raise QLoraError(f"{at}: field 'content' must be a string")
    return value


def read_prompt_file(path: Path) -> list[Prompt]:
    """A .jsonl file, one object per line with `prompt` (a string) or `messages` (a chat)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise QLoraError(f"--prompts {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise QLoraError(f"--prompts {path}: cannot read it ({err})") from None
    prompts = []
    for where, row in json_lines(path, text):
        if "messages" in row:
            prompts.append(Prompt(where, messages=_messages(row["messages"], where)))
        elif isinstance(row.get("prompt"), str):
            prompts.append(Prompt(where, text=row["prompt"]))
        elif "prompt" in row:
            raise QLoraError(f"{where}: field 'prompt' must be a string, got {json_type(row['prompt'])}")
        else:
            raise QLoraError(f"{where}: the row has neither 'prompt' nor 'messages'")
    if not prompts:
        raise QLoraError(f"--prompts {path} holds no prompts")
    return prompts


def check_text(text: str, where: str) -> None:
    if problem := text_problem(text):
        raise QLoraError(f"{where} {problem}")


def gather_prompts(texts: list[str], prompt_file: Path | None) -> list[Prompt]:
    """--prompt strings first, then the file's rows."""
    prompts = [Prompt(f"--prompt {index + 1}", text=text) for index, text in enumerate(texts)]
    if prompt_file is not None:
        prompts += read_prompt_file(prompt_file)
    for prompt in prompts:
        for message in prompt.messages or [{"content": prompt.text}]:
            check_text(message["content"], f"{prompt.where}: the prompt")
    if not prompts:
        raise QLoraError("no prompt given; add --prompt TEXT or --prompts FILE.jsonl")
    return prompts


def with_system(messages: list[dict], system: str | None) -> list[dict]:
    """The chat with `system` as its system turn (replacing one it has)."""
    if system is None:
        return messages
    rest = messages[1:] if messages and messages[0].get("role") == "system" else messages
    return [{"role": "system", "content": system}, *rest]


def render_prompt(
    prompt: Prompt, tokenizer: ChatTokenizer, *, raw: bool, system: str | None, variables: dict
) -> list[int]:
    """The token ids the model continues from."""
    if raw:
        if prompt.messages is not None:
            raise QLoraError(f"{prompt.where}: a chat ('messages') needs the chat template; drop --raw")
        ids = tokenizer.encode(prompt.text)
    else:
        messages = prompt.messages or [{"role": "user", "content": prompt.text}]
        try:
            text = tokenizer.render_chat(
                with_system(messages, system), add_generation_prompt=True, **variables
            )
        except QLoraError as err:
            raise QLoraError(f"{prompt.where}: {err}") from None
        ids = tokenizer.encode(text)
    if not ids:
        raise QLoraError(f"{prompt.where}: the prompt is empty")
    return ids


def check_fits(prompt: Prompt, ids: list[int], context: int) -> None:
    """A prompt must leave the model at least one position to answer in."""
    if len(ids) >= context:
        raise QLoraError(
            f"{prompt.where}: the prompt is {count(len(ids), 'token')}, more than the model's context of "
            f"{number(context)} (max_position_embeddings) leaves room for; shorten it to at most "
            f"{count(context - 1, 'token')}"
        )
