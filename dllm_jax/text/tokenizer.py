"""Text <-> token ids through a checkpoint's own fast tokenizer (``tokenizer.json``), offline.

The folder is read as transformers reads it (``tokenizer.json`` through the ``tokenizers``
library; the special tokens of ``tokenizer_config.json``, or of ``special_tokens_map.json`` for
folders of the legacy layout; the chat template of ``chat_template.jinja`` or of
``tokenizer_config.json``), without importing transformers: loading takes a fraction of a second
instead of the several seconds of transformers' import (which imports torch). The results are
those of transformers' ``AutoTokenizer`` (tests/test_tokenizer_parity.py).

LLaDA's tokenizer adds no BOS/EOS on plain text; only its chat template inserts the BOS string
(reference-spec A.5). Loading never touches the network: files are read from the folder only.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from dllm_jax.common.json_file import read_json, read_text
from dllm_jax.text.chat_encoding import ChatEncodingError, encode_conversation
from dllm_jax.text.chat_template import ChatTemplate
from dllm_jax.text.errors import TokenizerError

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
CHAT_TEMPLATE_FILE = "chat_template.jinja"
# The files that make up a Hugging Face tokenizer folder (copied along with a checkpoint).
TOKENIZER_FILES = (TOKENIZER_FILE, CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, CHAT_TEMPLATE_FILE)
# The named special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES); a chat template sees each by name.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Size bounds of the files read (the largest published tokenizer.json files are tens of MB).
_MAX_TOKENIZER_BYTES = 1 << 30
_MAX_CONFIG_BYTES = 64 << 20
_MAX_TEMPLATE_BYTES = 16 << 20

__all__ = ["TOKENIZER_FILES", "Tokenizer", "TokenizerError", "has_tokenizer_files", "tokens_within"]


def has_tokenizer_files(path: str | Path) -> bool:
    """True when the folder holds at least one of TOKENIZER_FILES."""
    return any((Path(path) / name).is_file() for name in TOKENIZER_FILES)


def _check_unicode(text: str, what: str) -> None:
    """Raises TokenizerError for text that is not valid Unicode (lone surrogates), which the
    Rust tokenizer rejects with a bare TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise TokenizerError(
            f"{what}not valid Unicode text: {e.reason} at character {e.start} ({text[e.start : e.end]!r})"
        ) from None


def _token_text(value: Any, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken object
    ({"content": ..., ...}); None for null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TokenizerError(f"{where}: expected a token string or an object with a 'content' string, got {value!r:.80}")


def _cleaned_up(text: str) -> str:
    """transformers' clean_up_tokenization: no space before punctuation and contractions (for
    WordPiece tokenizers that ask for it; BPE tokenizers never get it)."""
    for spaced, joined in (
        (" .", "."),
        (" ?", "?"),
        (" !", "!"),
        (" ,", ","),
        (" ' ", "'"),
        (" n't", "n't"),
        (" 'm", "'m"),
        (" 's", "'s"),
        (" 've", "'ve"),
        (" 're", "'re"),
    ):
        text = text.replace(spaced, joined)
    return text


class Tokenizer:
    """Encodes prompts (optionally through the chat template) and decodes generated ids.

    backend: a ``tokenizers.Tokenizer`` (its truncation and padding are switched off).
    special_tokens: the named special tokens ("eos_token": "<|endoftext|>", ...), which the
      chat template sees by name; eos_id and mask_id are their ids.
    chat_template: the compiled template, or None.
    clean_up_spaces: transformers' clean_up_tokenization_spaces after decoding.
    source: the folder it came from, for messages.
    """

    def __init__(
        self,
        backend: Any,
        *,
        special_tokens: Mapping[str, str] | None = None,
        chat_template: ChatTemplate | None = None,
        clean_up_spaces: bool = False,
        source: str = "the tokenizer",
    ):
        self._backend = backend
        self._backend.no_truncation()
        self._backend.no_padding()
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = chat_template
        self._clean_up_spaces = clean_up_spaces
        self.source = source

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Loads the tokenizer files of a checkpoint folder, without any network access.

        Raises:
          TokenizerError naming the file: no tokenizer.json, a file that is not what it should
          be, a special token of the wrong type, a chat template that does not compile.
        """
        import tokenizers  # the Rust library: about 0.1 s to import

        path = Path(path)
        if not path.is_dir():
            raise TokenizerError(f"{path}: tokenizer folder not found")
        tokenizer_file = path / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            others = [name for name in TOKENIZER_FILES[1:] if (path / name).is_file()]
            legacy = " (tokenizer.model: a SentencePiece tokenizer, which dllm_jax does not read)"
            raise TokenizerError(
                f"{path}: no {TOKENIZER_FILE}, which dllm_jax needs to encode text"
                f"{legacy if (path / 'tokenizer.model').is_file() else ''}"
                f"{'; the folder has only ' + ', '.join(others) if others else ''}"
            )
        text = read_text(tokenizer_file, max_bytes=_MAX_TOKENIZER_BYTES, error=TokenizerError)
        try:
            backend = tokenizers.Tokenizer.from_str(text)
        except Exception as e:  # the Rust library raises a bare Exception
            raise TokenizerError(f"{tokenizer_file}: cannot load the tokenizer ({' '.join(str(e).split())})") from None
        config = _read_config(path)
        special = {name: _token_text(config.get(name), f"{path / CONFIG_FILE}: {name}") for name in SPECIAL_TOKEN_NAMES}
        declared = [token for token in special.values() if token is not None] + _extra_special_tokens(path, config)
        known = {token.content for token in backend.get_added_tokens_decoder().values()}
        missing = list(dict.fromkeys(token for token in declared if token not in known))
        if missing:  # as transformers does: a declared special token the tokenizer lacks is added
            backend.add_special_tokens(missing)
        clean_up = config.get("clean_up_tokenization_spaces", False) is True and type(backend.model).__name__ != "BPE"
        return cls(
            backend,
            special_tokens=special,
            chat_template=_chat_template(path, config, special),
            clean_up_spaces=clean_up,
            source=str(path),
        )

    @classmethod
    def from_transformers(cls, hf_tokenizer: Any) -> Tokenizer:
        """Wraps a tokenizer built in memory by transformers (e.g. the embedded models' trainer)."""
        special = dict(hf_tokenizer.special_tokens_map)
        template = hf_tokenizer.chat_template
        if isinstance(template, dict):
            template = template.get("default")
        backend = hf_tokenizer.backend_tokenizer
        return cls(
            backend,
            special_tokens=special,
            chat_template=ChatTemplate(template, source="the tokenizer", special_tokens=special) if template else None,
            clean_up_spaces=bool(hf_tokenizer.clean_up_tokenization_spaces) and type(backend.model).__name__ != "BPE",
        )

    @property
    def eos_id(self) -> int | None:
        """The end-of-sequence id (LLaDA: ``<|endoftext|>``), or None if the tokenizer defines none."""
        return self._token_id("eos_token")

    @property
    def mask_id(self) -> int | None:
        """The mask token id when the tokenizer declares a mask token, else None (use the model config's)."""
        return self._token_id("mask_token")

    def _token_id(self, name: str) -> int | None:
        token = self.special_tokens.get(name)
        return None if token is None else self._backend.token_to_id(token)

    @property
    def vocab_size(self) -> int:
        """Ids the tokenizer can produce: [0, vocab_size), added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return self.chat_template is not None

    def chat_prompt(self, text: str) -> str:
        """The chat template rendered for one user turn, ending with the assistant header."""
        return self.render_chat([{"role": "user", "content": text}])

    def render_chat(self, messages: Sequence[Mapping[str, str]]) -> str:
        """The chat template rendered for a conversation, ending with the assistant header.

        messages: [{"role": "system" | "user" | "assistant", "content": str}, ...], in order.
        """
        if self.chat_template is None:
            raise TokenizerError("the tokenizer has no chat template; encode the prompt with chat=False")
        if isinstance(messages, (str, Mapping)) or not isinstance(messages, Sequence) or not messages:
            raise TokenizerError(
                f"messages: expected a non-empty list of {{'role', 'content'}} dicts, got {type(messages).__name__}"
            )
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or not all(
                isinstance(message.get(k), str) for k in ("role", "content")
            ):
                raise TokenizerError(
                    f"message {i}: expected a dict with 'role' and 'content' strings, got {message!r:.80}"
                )
        return self.chat_template.render(messages, add_generation_prompt=True)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        """Token ids of a conversation ({"role", "content"} messages, system turns included)
        rendered by the chat template (``render_chat``), ending with the assistant header.

        A message's content is text: special tokens typed in it are tokenized as characters,
        only the template's own text carries them (dllm_jax.text.chat_encoding)."""
        self.render_chat(messages)  # validates the messages and the template
        for i, message in enumerate(messages):
            _check_unicode(message["content"], f"message {i}: ")
        try:
            return encode_conversation(messages, self.render_chat, self._encode)
        except ChatEncodingError as e:
            raise TokenizerError(str(e)) from None

    def _encode(self, text: str, special_tokens: bool) -> list[int]:
        backend = self._backend if special_tokens else self._text_backend
        return backend.encode(text, add_special_tokens=False).ids

    @functools.cached_property
    def _text_backend(self) -> Any:
        """A copy of the backend that encodes special tokens' text as characters (its own
        object: the setting is the backend's state, and prompts are encoded from threads)."""
        backend = copy.deepcopy(self._backend)
        backend.encode_special_tokens = True
        return backend

    def encode(self, text: str, *, chat: bool = False, special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``chat=True`` the text is one user turn of the chat template.

        Special tokens are added only by the template (its BOS and headers), never by the tokenizer.
        special_tokens: a special token's text in ``text`` (``<|mdm_mask|>``) is that token;
        False: it is its characters (always so for a chat turn's text).

        Raises:
          TokenizerError for text it cannot encode: not a str, or not valid Unicode (e.g. a lone
          surrogate such as JSON's "\\ud800", or an argument that was not UTF-8).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"expected text (str), got {type(text).__name__}")
        _check_unicode(text, "")
        if chat:
            return self.apply_chat_template([{"role": "user", "content": text}])
        return self._encode(text, special_tokens)

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` up to (not including) the first EOS, with special tokens dropped.

        ids: any integer sequence (list, numpy or jax array of shape [T]).
        """
        ids = [int(i) for i in ids]
        eos = self.eos_id
        if eos is not None and eos in ids:
            ids = ids[: ids.index(eos)]
        text = self._backend.decode(ids, skip_special_tokens=True)
        return _cleaned_up(text) if self._clean_up_spaces else text


def _read_config(path: Path) -> dict[str, Any]:
    """tokenizer_config.json ({} when absent), with special_tokens_map.json merged over it for
    folders of the legacy layout (no added_tokens_decoder), as transformers merges them."""
    config: dict[str, Any] = {}
    if (path / CONFIG_FILE).is_file():
        config = _read_object(path / CONFIG_FILE)
    if "added_tokens_decoder" not in config and (path / SPECIAL_TOKENS_MAP_FILE).is_file():
        for key, value in _read_object(path / SPECIAL_TOKENS_MAP_FILE).items():
            if key in ("extra_special_tokens", "additional_special_tokens") and isinstance(value, list):
                existing = list(config.get("extra_special_tokens") or config.get("additional_special_tokens") or [])
                config["extra_special_tokens"] = existing + [v for v in value if v not in existing]
            else:
                config[key] = value
    return config


def _read_object(path: Path) -> dict[str, Any]:
    value = read_json(path, max_bytes=_MAX_CONFIG_BYTES, error=TokenizerError)
    if not isinstance(value, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _extra_special_tokens(path: Path, config: dict[str, Any]) -> list[str]:
    """The special tokens besides the named ones: extra_special_tokens (a list, or a dict of
    model-specific names), its older name additional_special_tokens, and other "*_token" keys."""
    where = f"{path / CONFIG_FILE}"
    tokens: list[str] = []
    for key in ("extra_special_tokens", "additional_special_tokens"):
        values = config.get(key) or []
        if isinstance(values, dict):  # model-specific names: {"image_token": "<image>", ...}
            values = list(values.values())
        if not isinstance(values, list):
            raise TokenizerError(f"{where}: {key}: expected a list of tokens, got {type(values).__name__}")
        tokens += [_token_text(v, f"{where}: {key}") for v in values]
    for key, value in config.items():
        if key.endswith("_token") and key not in SPECIAL_TOKEN_NAMES and isinstance(value, (str, dict)):
            tokens.append(_token_text(value, f"{where}: {key}"))
    return [token for token in tokens if token]


def _chat_template(path: Path, config: dict[str, Any], special: dict[str, str | None]) -> ChatTemplate | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (a string, or a list of
    {"name", "template"} of which "default" is used); None when the folder has neither."""
    names = {k: v for k, v in special.items() if v is not None}
    template_file = path / CHAT_TEMPLATE_FILE
    if template_file.is_file():
        text = read_text(template_file, max_bytes=_MAX_TEMPLATE_BYTES, error=TokenizerError)
        return ChatTemplate(text, source=str(template_file), special_tokens=names)
    template = config.get("chat_template")
    where = f"{path / CONFIG_FILE}"
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        if "default" not in named:
            raise TokenizerError(f"{where}: chat_template: a list of templates without one named 'default'")
        template = named["default"]
    if template is None:
        return None
    return ChatTemplate(template, source=where, special_tokens=names)


def tokens_within(decode: Callable[[Sequence[int]], str], ids: Sequence[int], length: int) -> int:
    """The most leading ids whose decoded text fits in `length` characters (what a stop-string
    cut leaves as completion tokens). Decoded prefix lengths grow with the number of ids, so
    this is a binary search: O(log n) decodes."""
    low, high = 0, len(ids)
    while low < high:
        mid = (low + high + 1) // 2
        if len(decode(ids[:mid])) <= length:
            low = mid
        else:
            high = mid - 1
    return low
