"""The model's tokenizer and chat template, read from a Hugging Face model folder.

Only `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` are read (JSON and text, never
pickles). Chat templates are code from the model's author, so they render in jinja2's immutable sandbox
with the few helpers chat templates expect, the way transformers renders them.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer

from qlora_cli.core.errors import QLoraError
from qlora_cli.sources.hf_files import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, TOKENIZER_FILE

# Every file of a model folder that from_folder reads.
FILES_READ = (TOKENIZER_FILE, TOKENIZER_CONFIG, CHAT_TEMPLATE_FILE)


def _token_text(value: Any) -> str | None:
    """Special tokens are written either as plain strings or as AddedToken dicts with a "content" key."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    """Lets a template refuse input, e.g. roles out of order."""
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(format: str) -> str:
    """Today's date for templates that print it (Llama 3.2's, Mistral Small's), as transformers gives it."""
    return datetime.now().strftime(format)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False
):
    """Plain JSON: jinja2's own tojson escapes <, > and & for HTML, which would change the prompt text."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _template_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _one_line(error: Exception) -> str:
    return " ".join(f"{type(error).__name__}: {error}".split())


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise QLoraError(f"{path}: cannot read ({_one_line(error)})") from None
    if not isinstance(data, dict):
        raise QLoraError(f"{path}: expected a JSON object")
    return data


def _pick_template(template: Any, source: Path) -> str | None:
    """A config holds one template string, or a list of named ones of which "default" is the chat one."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list) and template and all(isinstance(t, dict) for t in template):
        named = {t.get("name"): t.get("template") for t in template}
        chosen = named.get("default", template[0].get("template"))
        if isinstance(chosen, str):
            return chosen
    raise QLoraError(f"{source}: chat_template must be a string or a list of {{name, template}} objects")


class ChatTokenizer:
    """Text to token ids and back, plus the chat template; no special tokens are ever added implicitly."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        source: str,
        chat_template: str | None = None,
        eos_token: str,
        pad_token: str | None = None,
        bos_token: str | None = None,
        template_source: str | None = None,
        end_of_turn: str | None = None,
    ):
        self._tokenizer = tokenizer
        self._tokenizer.no_padding()
        self._tokenizer.no_truncation()
        self._tokenizer.encode_special_tokens = False
        self.source = source
        self.chat_template = chat_template
        self.eos_token = eos_token
        self.eos_token_id = self._required_id(eos_token, "eos_token")
        self.pad_token = pad_token if pad_token is not None else eos_token
        self.pad_token_id = self._required_id(self.pad_token, "pad_token")
        self.bos_token = bos_token
        self.bos_token_id = None if bos_token is None else self._required_id(bos_token, "bos_token")
        self.special_tokens = [t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special]
        self.template_source = template_source or f"chat template of {source}"
        # The text that closes an assistant turn, where the template declares one (the shipped ones do);
        # None for the tokenizer's own template or the user's jinja, whose turns say it when rendered.
        self.end_of_turn = end_of_turn
        self._template = None
        if chat_template is not None:
            try:
                self._template = _template_environment().from_string(chat_template)
            except jinja2.TemplateError as error:
                raise QLoraError(f"{self.template_source} does not compile ({_one_line(error)})") from None

    @classmethod
    def from_folder(cls, path: str | Path) -> ChatTokenizer:
        """Load a model folder's tokenizer.json, with tokenizer_config.json and chat_template.jinja when present."""
        folder = Path(path)
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise QLoraError(
                f"{folder}: no tokenizer.json (only fast tokenizers in tokenizer.json are supported)"
            )
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:
            raise QLoraError(f"{tokenizer_file}: cannot load tokenizer ({_one_line(error)})") from None

        config_file = folder / TOKENIZER_CONFIG
        config = _read_json(config_file) if config_file.is_file() else {}
        _add_declared_tokens(tokenizer, config.get("added_tokens_decoder"), config_file)

        template_file = folder / CHAT_TEMPLATE_FILE
        if template_file.is_file():
            try:
                template = template_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as error:
                raise QLoraError(f"{template_file}: cannot read ({_one_line(error)})") from None
        else:
            template = _pick_template(config.get("chat_template"), config_file)

        eos_token = _token_text(config.get("eos_token"))
        if eos_token is None:
            if tokenizer.token_to_id("<|endoftext|>") is None:
                raise QLoraError(f"{config_file}: no eos_token, and the vocabulary has no <|endoftext|>")
            eos_token = "<|endoftext|>"
        return cls(
            tokenizer,
            source=str(folder),
            chat_template=template,
            eos_token=eos_token,
            pad_token=_token_text(config.get("pad_token")),
            bos_token=_token_text(config.get("bos_token")),
        )

    def with_chat_template(
        self, chat_template: str, source: str, *, end_of_turn: str | None = None
    ) -> ChatTokenizer:
        """The same tokenizer rendering chats with another template; `source` names it in errors."""
        return ChatTokenizer(
            self._tokenizer,
            source=self.source,
            chat_template=chat_template,
            eos_token=self.eos_token,
            pad_token=self.pad_token,
            bos_token=self.bos_token,
            template_source=source,
            end_of_turn=end_of_turn,
        )

    def use_special_tokens(self, **tokens: str | None) -> None:
        """Take other tokens of the vocabulary as pad_token, eos_token or bos_token (the config's
        special_tokens); a token the vocabulary lacks is refused, since the embeddings stay frozen."""
        missing = [
            (role, token) for role, token in tokens.items() if token and self.token_to_id(token) is None
        ]
        if missing:
            raise QLoraError(
                "; ".join(
                    f"config key 'special_tokens.{role}': {token!r} is not in the vocabulary of {self.source}"
                    for role, token in missing
                )
                + f"; qlora cannot add tokens (the embeddings stay frozen): use tokens it has (its pad token "
                f"is {self.pad_token!r}) or remove the key"
            )
        for role, token in tokens.items():
            if token:
                setattr(self, role, token)
                setattr(self, f"{role}_id", self.token_to_id(token))

    def _required_id(self, token: str, role: str) -> int:
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise QLoraError(f"{self.source}: {role} {token!r} is not in the tokenizer's vocabulary")
        return token_id

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Many texts at once, tokenized in parallel by the Rust library."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = False, **variables: Any) -> str:
        """The chat template's text for `messages`; `variables` reach the template too (e.g. enable_thinking)."""
        if self._template is None:
            raise QLoraError(
                f"{self.source}: the tokenizer has no chat template; "
                "choose one with chat_template: chatml, llama3, mistral_v3_tekken, ... (one its vocabulary can write)"
            )
        context = {
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token,
            "pad_token": self.pad_token,
            **variables,
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
        }
        try:
            return self._template.render(**context)
        except Exception as error:
            raise QLoraError(f"{self.template_source} failed to render ({_one_line(error)})") from None


def _add_declared_tokens(tokenizer: Tokenizer, declared: Any, config_file: Path) -> None:
    """Add tokens tokenizer_config.json declares that tokenizer.json lacks, at the ids it declares."""
    if not isinstance(declared, dict):
        return
    for token_id, entry in sorted(
        declared.items(), key=lambda item: int(item[0]) if item[0].isdigit() else -1
    ):
        content = _token_text(entry)
        if content is None or tokenizer.token_to_id(content) is not None:
            continue
        if not token_id.isdigit():
            raise QLoraError(f"{config_file}: added_tokens_decoder key {token_id!r} is not a token id")
        special = isinstance(entry, dict) and bool(entry.get("special", False))
        token = AddedToken(content, special=special, normalized=False)
        if token.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
        if tokenizer.token_to_id(content) != int(token_id):
            raise QLoraError(
                f"{config_file}: added token {content!r} is declared with id {token_id} "
                f"but tokenizer.json places it at {tokenizer.token_to_id(content)}"
            )
