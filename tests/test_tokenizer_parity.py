"""dllm_jax's tokenizer (tokenizers + jinja2, no transformers) against transformers' AutoTokenizer on
the same folders: ids, text, special ids and chat prompts agree; loading imports neither
transformers nor torch (nor JAX)."""

import json
import subprocess
import sys

import pytest
from conftest import save_tiny_tokenizer
from transformers import AutoTokenizer
from transformers.utils import logging as hf_logging

from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.text.tokenizer import Tokenizer

TEXTS = [
    "What is 2 + 2?",
    "  leading and trailing  ",
    "héllo wörld ✓\nsecond line",
    "13+5-1-9",
    "sort: 3 9 1 4",
    "special <|eot_id|> and <|mdm_mask|> inside",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "13+5-1-9"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "  sort: 3 9 1 4\n"}],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"},
        {"role": "user", "content": "What is 2 + 2?"},
    ],
]


def _legacy_layout(folder):
    """The layout of older checkpoints (LLaDA-8B-Instruct's among them): the special tokens in
    special_tokens_map.json, the chat template in tokenizer_config.json (save_pretrained writes
    both elsewhere today: tokenizer_config.json and chat_template.jinja)."""
    config = json.loads((folder / "tokenizer_config.json").read_text())
    special = {name: config.pop(name) for name in ("bos_token", "eos_token", "pad_token", "mask_token")}
    config.pop("added_tokens_decoder", None)
    config["chat_template"] = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "special_tokens_map.json").write_text(json.dumps({k: {"content": v} for k, v in special.items()}))
    return folder


@pytest.fixture(scope="module", params=["tiny-llada", "tiny-dream", "bpe", "legacy"])
def folder(request, tmp_path_factory):
    if request.param.startswith("tiny-"):
        return tiny_model_path(request.param)
    made = save_tiny_tokenizer(tmp_path_factory.mktemp(request.param))
    return _legacy_layout(made) if request.param == "legacy" else made


@pytest.fixture(scope="module")
def pair(folder):
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config.json's model_type "llada" is unknown to transformers
    try:
        reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    finally:
        hf_logging.set_verbosity(verbosity)
    return Tokenizer.from_dir(folder), reference


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_text_agree_with_transformers(pair, text):
    ours, reference = pair
    ids = reference.encode(text, add_special_tokens=False)
    assert ours.encode(text) == ids
    with_specials = ids + [reference.mask_token_id] + ids
    assert ours.decode(with_specials) == reference.decode(with_specials, skip_special_tokens=True)


def test_decode_stops_at_eos_where_transformers_would_be_cut(pair):
    ours, reference = pair
    ids = reference.encode("fox", add_special_tokens=False)
    assert ours.decode(ids + [reference.eos_token_id] + ids) == reference.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_prompts_agree_with_transformers(pair, messages):
    ours, reference = pair
    text = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == text
    assert ours.apply_chat_template(messages) == reference.encode(text, add_special_tokens=False)


def test_special_ids_and_vocabulary_agree_with_transformers(pair):
    ours, reference = pair
    assert (ours.eos_id, ours.mask_id) == (reference.eos_token_id, reference.mask_token_id)
    assert ours.vocab_size == len(reference)
    assert ours.has_chat_template


def test_a_declared_special_token_missing_from_tokenizer_json_is_added_as_transformers_adds_it(tmp_path):
    folder = save_tiny_tokenizer(tmp_path)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config["extra_special_tokens"] = ["<|new_special|>"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    ours = Tokenizer.from_dir(folder)
    reference = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    text = "a <|new_special|> b"
    assert ours.encode(text) == reference.encode(text, add_special_tokens=False)
    assert ours.vocab_size == len(reference)
    ids = ours.encode(text)
    assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True) == "a  b"


def test_loading_and_encoding_import_neither_transformers_torch_nor_jax():
    code = (
        "import sys; from dllm_jax.models.embedded import tiny_model_path; "
        "from dllm_jax.text.tokenizer import Tokenizer; "
        "t = Tokenizer.from_dir(tiny_model_path()); t.decode(t.encode('hi', chat=True)); "
        "print(sorted(m for m in ('transformers', 'torch', 'jax') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"
