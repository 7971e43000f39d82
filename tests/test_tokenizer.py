import socket

import numpy as np
import pytest
import tokenizers
from conftest import save_tiny_tokenizer

from dllm_jax.text.tokenizer import Tokenizer, TokenizerError, has_tokenizer_files

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer_dir):
    return Tokenizer.from_dir(tiny_tokenizer_dir)


@pytest.fixture(scope="module")
def raw(tiny_tokenizer_dir):
    """The same tokenizer.json through the `tokenizers` library alone: the independent expectation."""
    return tokenizers.Tokenizer.from_file(str(tiny_tokenizer_dir / "tokenizer.json"))


def test_plain_encode_adds_no_special_tokens(tokenizer, raw):
    ids = tokenizer.encode("The quick brown fox")
    assert ids == raw.encode("The quick brown fox").ids
    assert tokenizer.eos_id not in ids and raw.token_to_id("<|startoftext|>") not in ids


@pytest.mark.parametrize("text", ["What is 2 + 2?", "  leading and trailing  ", "héllo wörld ✓\nsecond line", ""])
def test_decode_inverts_encode(tokenizer, text):
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_chat_template_wraps_one_user_turn(tokenizer, raw):
    expected = (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n"
        "What is 2 + 2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    # the template trims the message
    assert tokenizer.chat_prompt("  What is 2 + 2?\n") == expected
    ids = tokenizer.encode("  What is 2 + 2?\n", chat=True)
    assert ids == raw.encode(expected).ids
    assert ids[0] == raw.token_to_id("<|startoftext|>")
    assert ids.count(raw.token_to_id("<|start_header_id|>")) == 2
    assert ids.count(raw.token_to_id("<|eot_id|>")) == 1


def test_decode_stops_at_the_first_eos_and_drops_special_tokens(tokenizer):
    eos, mask = tokenizer.eos_id, tokenizer.mask_id
    ids = tokenizer.encode("The") + [mask] + tokenizer.encode(" fox") + [eos] + tokenizer.encode(" junk") + [eos]
    assert tokenizer.decode(ids) == "The fox"
    assert tokenizer.decode(np.asarray(ids, dtype=np.int32)) == "The fox"


def test_special_ids_come_from_the_tokenizer(tokenizer, raw):
    assert tokenizer.eos_id == raw.token_to_id("<|endoftext|>")
    assert tokenizer.mask_id == raw.token_to_id("<|mdm_mask|>")
    assert tokenizer.has_chat_template


def test_chat_without_a_template_is_a_clear_error(tmp_path):
    tokenizer = Tokenizer.from_dir(save_tiny_tokenizer(tmp_path, chat_template=None))
    assert not tokenizer.has_chat_template
    assert tokenizer.encode("hi") == tokenizer.encode("hi", chat=False)
    with pytest.raises(TokenizerError, match="no chat template"):
        tokenizer.encode("hi", chat=True)


def test_loading_never_opens_a_connection(tiny_tokenizer_dir, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the tokenizer tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    tokenizer = Tokenizer.from_dir(tiny_tokenizer_dir)
    assert tokenizer.decode(tokenizer.encode("offline")) == "offline"


def test_bad_folders_are_tokenizer_errors(tmp_path):
    with pytest.raises(TokenizerError, match="not found"):
        Tokenizer.from_dir(tmp_path / "absent")
    assert not has_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{ this is not a tokenizer")
    assert has_tokenizer_files(tmp_path)
    with pytest.raises(TokenizerError, match="cannot load the tokenizer"):
        Tokenizer.from_dir(tmp_path)
