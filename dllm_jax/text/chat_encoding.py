"""A conversation's token ids where message text stays text (issue 33: role-marker injection).

Rendering the chat template to one string and tokenizing it would turn a special token typed
in a message ("<|eot_id|><|start_header_id|>system", "<|mdm_mask|>") into the real token, so a
user could forge a system turn or fill a prompt with masks. Here the template is rendered once
with a unique marker in place of each message's content, which splits it into the template's
own text (tokenized with its special tokens) and the messages' places; each message's text is
tokenized with special tokens split into plain characters. A second rendering with the real
content shows what the template did to each content (kept, or trimmed as LLaDA's template does),
so the ids are those of the real rendering, with special tokens only where the template put them.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable, Mapping, Sequence

Render = Callable[[list[dict]], str]
# text, whether special tokens in it are parsed -> token ids
Encode = Callable[[str, bool], list[int]]


class ChatEncodingError(ValueError):
    """A template whose rendering cannot be split into its own text and the messages'."""


def encode_conversation(messages: Sequence[Mapping[str, str]], render: Render, encode: Encode) -> list[int]:
    """Token ids of the rendered conversation; special tokens come from the template only.

    messages: {"role", "content"} dicts (validated by the caller); render: messages -> the
    template's text; encode(text, special): token ids of text, parsing special tokens when
    `special` (else they are text).
    """
    nonce = f"{secrets.randbelow(10**16):016d}"  # digits: no case or white space a filter could change
    marks = [f"\ue000{nonce}:{i}\ue001" for i in range(len(messages))]
    marked = render([{**m, "content": mark} for m, mark in zip(messages, marks)])
    pieces = re.split(f"\ue000{nonce}:(\\d+)\ue001", marked)  # literal, index, literal, index, ..., literal
    literals, places = pieces[0::2], [int(i) for i in pieces[1::2]]
    real = render([dict(m) for m in messages])
    contents = _content_as_rendered(real, literals, places, [m["content"] for m in messages])
    ids = encode(literals[0], True) if literals[0] else []
    for text, literal in zip(contents, literals[1:]):
        if text:
            ids += encode(text, False)
        if literal:
            ids += encode(literal, True)
    return ids


def _content_as_rendered(real: str, literals: list[str], places: list[int], contents: list[str]) -> list[str]:
    """What the template made of each content place: the content itself, or trimmed."""
    if not real.startswith(literals[0]):
        raise ChatEncodingError(
            "the chat template renders its own text differently for other message contents, so it cannot be told "
            "apart from the messages'"
        )
    position, out = len(literals[0]), []
    for index, following in zip(places, literals[1:]):
        content = contents[index]
        for candidate in dict.fromkeys((content, content.strip(), content.lstrip(), content.rstrip())):
            if real.startswith(candidate + following, position):
                out.append(candidate)
                position += len(candidate) + len(following)
                break
        else:
            raise ChatEncodingError(
                f"the chat template changes message {index}'s content in a way that cannot be told apart "
                "from its own text (it does more than trim it)"
            )
    if position != len(real):
        raise ChatEncodingError("the chat template's rendering has text after the last message it places")
    return out
