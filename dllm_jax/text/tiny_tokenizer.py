"""Character-level tokenizers of the embedded tiny models, with each family's special tokens
and chat template (tiny-llada: LLaDA's; tiny-dream: Qwen2's names and ChatML;
tiny-diffusiongemma: Gemma's names and turn format).

Ids 0-94 are the printable ASCII characters (space to "~"), 95 is the newline, then come the
special tokens. Any other character encodes as ``<|unk|>``. The model's embedding has
``TINY_VOCAB_SIZE`` rows; the rows past the tokenizer's last id are padding, as in LLaDA.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

EOS = "<|endoftext|>"
BOS = "<|startoftext|>"
MASK = "<|mdm_mask|>"
START_HEADER = "<|start_header_id|>"
END_HEADER = "<|end_header_id|>"
EOT = "<|eot_id|>"
UNK = "<|unk|>"
SPECIAL_TOKENS = (EOS, BOS, MASK, START_HEADER, END_HEADER, EOT, UNK)

TINY_VOCAB_SIZE = 128
CHARACTERS = tuple(chr(code) for code in range(32, 127)) + ("\n",)

# LLaDA-8B-Instruct's template (reference-spec A.5): BOS before the first message, every message as
# header + role + header end + two newlines + trimmed content + <|eot_id|>, and always an open
# assistant header at the end.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if loop.first -%}{{ bos_token }}{%- endif -%}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (message['content'] | trim) + '<|eot_id|>' }}"
    "{%- endfor -%}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
)


# Dream's (Qwen2's) special tokens: <|endoftext|> ends and pads a sequence, <|im_end|> ends a turn.
DREAM_MASK = "<|mask|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
DREAM_SPECIAL_TOKENS = (EOS, IM_START, IM_END, DREAM_MASK, UNK)

# ChatML, as Qwen2 / Dream use it (without Qwen's default system message, to keep prompts short).
CHATML_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\n' + (message['content'] | trim) + '<|im_end|>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# DiffusionGemma's (Gemma's) special tokens: <eos> ends a sequence, <end_of_turn> a turn, <pad>
# replaces what follows the end. No mask token: the canvas is noised with uniform random tokens.
GEMMA_PAD = "<pad>"
GEMMA_EOS = "<eos>"
GEMMA_BOS = "<bos>"
START_OF_TURN = "<start_of_turn>"
GEMMA_END_OF_TURN = "<end_of_turn>"
GEMMA_UNK = "<unk>"
GEMMA_SPECIAL_TOKENS = (GEMMA_PAD, GEMMA_EOS, GEMMA_BOS, START_OF_TURN, GEMMA_END_OF_TURN, GEMMA_UNK)

# Gemma's turn format: BOS, then each message as <start_of_turn> + role ("model" for the assistant)
# + newline + trimmed content + <end_of_turn> + newline, and an open model turn to answer in.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (message['content'] | trim) + '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)

# The token that ends an answer's turn, per family.
END_OF_TURN = {"llada": EOT, "dream": IM_END, "diffusion_gemma": GEMMA_END_OF_TURN}


def _character_backend(special_tokens: tuple[str, ...], unk: str = UNK) -> Tokenizer:
    vocab = {token: i for i, token in enumerate(CHARACTERS + special_tokens)}
    # BPE without merges is a character-level model; Fuse joins the pieces back without spaces.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(list(special_tokens))
    return backend


def build_tiny_tokenizer(model_max_length: int = 128, family: str = "llada") -> PreTrainedTokenizerFast:
    """The family's tokenizer ("llada", "dream" or "diffusion_gemma"), built in memory (no file access)."""
    if family == "diffusion_gemma":
        return PreTrainedTokenizerFast(
            tokenizer_object=_character_backend(GEMMA_SPECIAL_TOKENS, GEMMA_UNK),
            bos_token=GEMMA_BOS,
            eos_token=GEMMA_EOS,
            pad_token=GEMMA_PAD,
            unk_token=GEMMA_UNK,
            extra_special_tokens=[START_OF_TURN, GEMMA_END_OF_TURN],
            chat_template=GEMMA_TEMPLATE,
            model_max_length=model_max_length,
        )
    if family == "dream":
        return PreTrainedTokenizerFast(
            tokenizer_object=_character_backend(DREAM_SPECIAL_TOKENS),
            eos_token=EOS,
            pad_token=EOS,
            mask_token=DREAM_MASK,
            unk_token=UNK,
            extra_special_tokens=[IM_START, IM_END],
            chat_template=CHATML_TEMPLATE,
            model_max_length=model_max_length,
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=_character_backend(SPECIAL_TOKENS),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=EOS,
        mask_token=MASK,
        unk_token=UNK,
        extra_special_tokens=[START_HEADER, END_HEADER, EOT],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
    )


def save_tiny_tokenizer(out_dir: str | Path, model_max_length: int = 128, family: str = "llada") -> Path:
    """Writes tokenizer.json and tokenizer_config.json (chat template inside it) to out_dir."""
    out_dir = Path(out_dir)
    build_tiny_tokenizer(model_max_length, family).save_pretrained(str(out_dir), save_jinja_files=False)
    return out_dir
