import pytest
from transformers import AutoTokenizer

from dllm_jax.text import tiny_tokenizer as tt

pytestmark = pytest.mark.unit


def test_text_round_trips_character_by_character():
    tok = tt.build_tiny_tokenizer()
    text = "(23+45)*3-17\n#### 187 sort: 5 3 9 " + "".join(tt.CHARACTERS)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text)
    assert tok.decode(ids) == text


def test_special_tokens_are_single_ids_and_skippable():
    tok = tt.build_tiny_tokenizer()
    assert len(tok) == len(tt.CHARACTERS) + len(tt.SPECIAL_TOKENS) <= tt.TINY_VOCAB_SIZE
    ids = [tok.convert_tokens_to_ids(s) for s in tt.SPECIAL_TOKENS]
    assert len(set(ids)) == len(ids) and min(ids) >= len(tt.CHARACTERS)
    assert tok(tt.MASK + tt.EOT + tt.EOS, add_special_tokens=False)["input_ids"] == [
        tok.mask_token_id,
        tok.convert_tokens_to_ids(tt.EOT),
        tok.eos_token_id,
    ]
    assert tok.pad_token_id == tok.eos_token_id
    assert tok.convert_ids_to_tokens(tok.bos_token_id) == tt.BOS
    assert (
        tok.decode(tok("1+1=2" + tt.EOT + tt.EOS * 3, add_special_tokens=False)["input_ids"], skip_special_tokens=True)
        == "1+1=2"
    )
    # a character outside the vocabulary becomes <|unk|>, never a silent drop
    assert tok("é", add_special_tokens=False)["input_ids"] == [tok.unk_token_id]
    # plain encoding adds nothing (add_bos_token false, as LLaDA)
    assert tok("7", add_special_tokens=True)["input_ids"] == tok("7", add_special_tokens=False)["input_ids"]


def test_saved_tokenizer_loads_offline_with_the_llada_chat_template(tmp_path):
    tt.save_tiny_tokenizer(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    tok = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    built = tt.build_tiny_tokenizer()
    for token in tt.SPECIAL_TOKENS:
        assert tok.convert_tokens_to_ids(token) == built.convert_tokens_to_ids(token)
    text = tok.apply_chat_template([{"role": "user", "content": "  (7+5)*3 \n"}], tokenize=False)
    assert text == (
        "<|startoftext|><|start_header_id|>user<|end_header_id|>\n\n(7+5)*3<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    two_turns = tok.apply_chat_template(
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}], tokenize=False
    )
    assert two_turns.count(tt.BOS) == 1 and two_turns.endswith("assistant<|end_header_id|>\n\n")
