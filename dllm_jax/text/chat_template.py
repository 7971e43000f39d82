"""A model folder's chat template, rendered as transformers renders it, within a time and size bound.

The environment is the one transformers' ``apply_chat_template`` builds: Jinja2's immutable
sandbox with ``trim_blocks`` and ``lstrip_blocks``, the loop-control extension, a ``tojson``
that does not escape HTML, ``raise_exception`` and ``strftime_now``, and the
``{% generation %}`` block (rendered as its body). The template sees ``messages``,
``add_generation_prompt``, ``tools`` and ``documents`` (None) and the special tokens by name
(``bos_token``, ``eos_token``, ...).

A template is code that came with a model folder, so rendering it is bounded: more than
``RENDER_SECONDS`` of work (nested loops) or more than ``RENDER_CHARS`` characters of output
(``'x' * 10**9``, repeated output) stops it with a TokenizerError naming where the template came
from, instead of hanging the prompt check or a server thread. The time bound is enforced by a
trace function in the rendering thread (about 50 us per render of a typical template).
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from dllm_jax.text.errors import TokenizerError

# The most a render may take and write. A long prompt is far below either: a chat prompt of
# 100k tokens is well under 1M characters and renders in milliseconds.
RENDER_SECONDS = 2.0
RENDER_CHARS = 2**24

# Jinja compiles templates to Python code with this file name; the trace function follows the
# lines of these frames only (loops in a template are lines of its frame, without calls).
_TEMPLATE_FILENAME = "<template>"


class _RenderLimit(Exception):
    """Raised inside a render that ran out of time or characters."""


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers marks the assistant's tokens with
    it for training masks): rendered as its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


class _BoundedSandbox(ImmutableSandboxedEnvironment):
    """The sandbox, with ``*`` and ``**`` checked before they build a huge string, list or number
    (one C-level operation the time bound cannot interrupt)."""

    intercepted_binops = frozenset(("*", "**"))

    def call_binop(self, context: jinja2.runtime.Context, operator: str, left: Any, right: Any) -> Any:
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and isinstance(count, int) and not isinstance(count, bool):
                    if len(sequence) * count > RENDER_CHARS:
                        raise _RenderLimit(f"'*' would build {len(sequence) * count} items")
        elif isinstance(left, int) and isinstance(right, int) and right > 0:
            if max(abs(left).bit_length(), 1) * right > 8 * RENDER_CHARS:
                raise _RenderLimit(f"{left} ** {right} is too large")
        return super().call_binop(context, operator, left, right)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _environment() -> ImmutableSandboxedEnvironment:
    env = _BoundedSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return env


class ChatTemplate:
    """One compiled chat template.

    source: where it came from, e.g. "MODEL/tokenizer_config.json"; every error names it.
    special_tokens: the names the template may use for special tokens ("bos_token": "<s>", ...).
    """

    def __init__(self, text: str, *, source: str, special_tokens: Mapping[str, str] | None = None):
        if not isinstance(text, str) or not text:
            raise TokenizerError(f"{source}: the chat template is not a non-empty string")
        self.text = text
        self.source = source
        self.special_tokens = dict(special_tokens or {})
        try:
            self._template = _environment().from_string(text)
        except jinja2.exceptions.TemplateSyntaxError as e:
            raise TokenizerError(
                f"{source}: the chat template is not valid Jinja (line {e.lineno}: {e.message})"
            ) from None
        except RecursionError:
            raise TokenizerError(f"{source}: the chat template is nested too deeply") from None

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True) -> str:
        """The conversation as text (ending with the assistant header when add_generation_prompt).

        Raises:
          TokenizerError naming the template's source: the template rejects the messages
          (raise_exception, an error of its own), or it exceeds RENDER_SECONDS or RENDER_CHARS.
        """
        context = {
            **self.special_tokens,
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "tools": None,
            "documents": None,
        }
        try:
            return _bounded_render(self._template, context)
        except _RenderLimit as e:
            raise TokenizerError(f"{self.source}: the chat template was stopped: {e}") from None
        except RecursionError:
            raise TokenizerError(f"{self.source}: the chat template recursed too deeply") from None
        except jinja2.exceptions.SecurityError as e:
            raise TokenizerError(f"{self.source}: the chat template does what the sandbox forbids ({e})") from None
        except jinja2.exceptions.TemplateError as e:
            raise TokenizerError(f"{self.source}: the chat template rejects these messages ({e})") from None
        except Exception as e:  # an error in the template's own expressions (TypeError, KeyError, ...)
            raise TokenizerError(
                f"{self.source}: the chat template failed on these messages ({type(e).__name__}: {e})"
            ) from None


def _bounded_render(template: jinja2.Template, context: dict[str, Any]) -> str:
    """template.render(context), stopped by _RenderLimit past RENDER_SECONDS or RENDER_CHARS."""
    deadline = time.monotonic() + RENDER_SECONDS

    def check_time() -> None:
        if time.monotonic() > deadline:
            raise _RenderLimit(f"it ran for more than {RENDER_SECONDS:g} s (a loop that does not end?)")

    def trace_lines(frame, event, arg):
        check_time()
        return trace_lines

    def trace_calls(frame, event, arg):
        check_time()
        return trace_lines if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    chunks, size = [], 0
    previous = sys.gettrace()
    sys.settrace(trace_calls)
    try:
        for chunk in template.generate(**context):
            size += len(chunk)
            if size > RENDER_CHARS:
                raise _RenderLimit(f"it wrote more than {RENDER_CHARS} characters")
            chunks.append(chunk)
    finally:
        sys.settrace(previous)
    return "".join(chunks)
