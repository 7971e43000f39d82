"""The embedded tiny DiffusionGemma (dllm_jax/assets/tiny-diffusiongemma, its README says how it
was trained): it resolves by name, reads back as the family's config with its chat template, and
answers held-out tiny tasks through the reference generation (tests/diffusion_gemma_reference.py).
dllm-generate answering with it by name (the engine's canvas loop) is checked in
tests/test_diffusion_gemma_sharding.py, whose dllm-generate test runs it by name."""

import pytest
from transformers import AutoTokenizer

from dllm_jax.evaluation import tiny_tasks
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.diffusion_gemma_config import AttentionKind, DiffusionGemmaConfig
from dllm_jax.models.embedded import model_folder, tiny_model_path
from dllm_jax.text.tiny_tokenizer import build_tiny_tokenizer
from scripts import train_tiny_diffusion_gemma as tr

NAME = "tiny-diffusiongemma"
# The first 32 held-out problems: exact matches the embedded weights reach with the trainer's
# decoding (GENERATION, seed 0), measured on the CPU (see the README); a margin of one problem
# for float differences between JAX versions that change a sampled token.
CHECKED_PROBLEMS = 32
MEASURED_CORRECT = 11  # 0.344 (arith 0.15, sort 0.667); of all 256: 0.457 (inverse-CDF sample)


@pytest.fixture(scope="module")
def embedded():
    return read_checkpoint(tiny_model_path(NAME), dtype="float32")


@pytest.mark.unit
def test_the_embedded_folder_resolves_by_name_and_reads_back(embedded):
    info, _ = embedded
    assert model_folder(NAME) == tiny_model_path(NAME)
    config = info.config
    assert isinstance(config, DiffusionGemmaConfig) and not info.skipped
    assert config.canvas_length == tr.CANVAS_LENGTH and config.top_k_experts < config.n_experts
    assert set(config.layer_types) == {AttentionKind.SLIDING, AttentionKind.FULL}
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(NAME))
    built = build_tiny_tokenizer(tr.MAX_POSITIONS, tr.FAMILY)
    assert tr.prompt_ids(tokenizer, "sort: 3 1 2") == tr.prompt_ids(built, "sort: 3 1 2")
    assert tokenizer.eos_token_id in config.eos_token_ids and tokenizer.pad_token_id == config.pad_token_id


@pytest.mark.integration  # a whole evaluation (32 held-out problems through the reference)
def test_the_embedded_model_answers_held_out_problems(embedded):
    info, weights = embedded
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path(NAME))
    accuracy = tr.held_out_accuracy(info.config, weights, tokenizer, tiny_tasks.held_out_problems(CHECKED_PROBLEMS))
    assert accuracy["all"] * CHECKED_PROBLEMS >= MEASURED_CORRECT - 1, accuracy
