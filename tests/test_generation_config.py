"""A model folder's generation_config.json gives the defaults of the per-request values a request
leaves unset (issue 31 follow-up): the embedded tiny-diffusiongemma's values resolve from its file,
a value the request sets wins (also at transformers' class default), "none" turns it off, a
default that does not apply to the loop is not taken, and a bad file is one error naming the file
and key. Everything here resolves a request's per-slot values without decoding (the one decode
that shows the embedded model using them is in test_lm_eval_model.py, on its shared loop)."""

from __future__ import annotations

import dataclasses
import json
import logging
import shutil

import pytest
from conftest import tiny_config

from dllm_jax import Engine, SamplingParams
from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.request import slot_values
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.embedded import tiny_model_path
from dllm_jax.models.loading import load_model
from dllm_jax.models.model_source import read_model_config
from dllm_jax.policies.entropy_bound import DenoiseSettings
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.sampling.generation_defaults import GenerationDefaults

pytestmark = pytest.mark.unit

TINY_DG = tiny_model_path("tiny-diffusiongemma")
# its generation_config.json (what its README's accuracy was measured with)
TINY_DG_VALUES = dict(
    max_new_tokens=64,
    max_denoising_steps=16,
    t_min=0.1,
    t_max=0.5,
    entropy_bound=1.0,
    stability_threshold=1,
    confidence_threshold=0.01,
)
# transformers' DiffusionGemmaGenerationConfig defaults: what the engine used before it read the file
CLASS_VALUES = dataclasses.asdict(DenoiseSettings())
# Dream-org/Dream-v0-Instruct-7B's generation_config.json as published
DREAM_FILE = {
    "_from_model_config": True,
    "alg": "origin",
    "alg_temp": None,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
    "eps": 0.001,
    "mask_token_id": None,
    "output_history": False,
    "pad_token_id": 151643,
    "steps": 512,
    "temperature": 0.0,
    "top_k": None,
    "top_p": None,
    "transformers_version": "4.46.2",
}


@pytest.fixture(scope="module")
def dg_config():
    return read_model_config(TINY_DG, dtype="float32")


@pytest.fixture(scope="module")
def dg_decode(dg_config):
    return DecodeConfig(method="diffusion_gemma", gen_length=64, batch_size=2).for_model(dg_config)


def resolve(sampling, decode, defaults, *, max_sequence_length=128, prompt_len=20):
    """The per-slot values of one request, as a session installs them."""
    return slot_values(
        sampling,
        prompt_len,
        decode,
        cfg=False,
        max_sequence_length=max_sequence_length,
        order=0,
        where="request 0",
        defaults=defaults,
    )


def sampler_values(values) -> dict:
    """The DiffusionGemma sampler's per-slot values (t_max as t_min + t_span)."""
    out = {name: values[name] for name in CLASS_VALUES if name != "t_max"}
    out["t_max"] = pytest.approx(values["t_min"] + values["t_span"])
    return out


def test_the_embedded_diffusion_gemma_takes_its_files_values(dg_decode):
    defaults = GenerationDefaults.of_folder(TINY_DG)
    assert dict(defaults.values) == TINY_DG_VALUES
    assert defaults.source == str(TINY_DG / "generation_config.json")
    values = resolve(SamplingParams(), dg_decode, defaults)
    expected = {k: v for k, v in TINY_DG_VALUES.items() if k != "max_new_tokens"}
    assert sampler_values(values) == pytest.approx(expected)
    assert values["max_new_tokens"] == 64
    assert values["step_limit"] == dg_decode.step_limit(20, 64, 16)  # its canvases' bound: 16 steps each
    # the bucket a front end picks for it: the canvases that hold its max_new_tokens
    assert defaults.canvas_bucket(32, 64) == 64 and GenerationDefaults().canvas_bucket(32, 64) == 32
    assert (defaults.canvas_bucket(32, 63), defaults.canvas_bucket(24, 70)) == (32, 48)  # whole canvases that fit


def test_a_value_the_request_sets_wins_also_at_the_class_default(dg_decode):
    explicit = SamplingParams(max_new_tokens=40, **CLASS_VALUES)
    values = resolve(explicit, dg_decode, GenerationDefaults.of_folder(TINY_DG))
    assert sampler_values(values) == pytest.approx(CLASS_VALUES) and values["max_new_tokens"] == 40


def test_generation_config_none_leaves_sampling_params_own_defaults(dg_decode):
    off = GenerationDefaults.of_folder(TINY_DG, "none")
    assert dict(off.values) == {} and off.describe() == "no model defaults"
    values = resolve(SamplingParams(), dg_decode, off)
    assert sampler_values(values) == pytest.approx(CLASS_VALUES) and values["max_new_tokens"] == 64
    with pytest.raises(ValueError, match="generation_config='vllm': expected one of auto, none"):
        GenerationDefaults.of_folder(TINY_DG, "vllm")


def test_the_engine_reads_the_file_unless_told_not_to():
    auto = Engine.from_pretrained("tiny-diffusiongemma")
    off = Engine.from_pretrained("tiny-diffusiongemma", generation_config="none")
    assert dict(auto.generation_defaults.values) == TINY_DG_VALUES and dict(off.generation_defaults.values) == {}
    # a call that passes no DecodeConfig decodes the canvases its max_new_tokens needs
    assert (auto.default_decode_config.gen_length, off.default_decode_config.gen_length) == (64, 32)
    assert load_model("tiny-diffusiongemma").generation_config == json.loads(
        (TINY_DG / "generation_config.json").read_text()
    )
    with pytest.raises(GenerationError, match="generation_config='off'"):
        Engine.from_pretrained("tiny-diffusiongemma", generation_config="off")


def test_dreams_published_file_gives_its_temperature_and_nothing_compiled(caplog):
    with caplog.at_level(logging.DEBUG, logger="dllm_jax.sampling.generation_defaults"):
        defaults = GenerationDefaults.from_hf(DREAM_FILE, source="dream/generation_config.json")
    # null is no default; alg, steps and eps are compiled choices (DecodeConfig), the ids config.json's
    assert dict(defaults.values) == {"temperature": 0.0}
    ignored = ("alg", "bos_token_id", "eos_token_id", "eps", "mask_token_id", "output_history", "pad_token_id", "steps")
    assert defaults.ignored == ignored
    assert f"dream/generation_config.json: not used (no per-request value of dllm_jax): {', '.join(ignored)}" in (
        caplog.text
    )


def test_a_default_is_taken_only_by_a_loop_it_applies_to(dg_decode):
    defaults = GenerationDefaults.from_hf({"temperature": 0.6, "top_k": 5}, source="g.json")
    flash = DecodeConfig(gen_length=32)
    values = resolve(SamplingParams(), flash, defaults, max_sequence_length=512)
    assert (values["temperature"], values["top_k"]) == (pytest.approx(0.6), 5)
    greedy = resolve(SamplingParams(temperature=0.0), flash, defaults, max_sequence_length=512)
    assert greedy["temperature"] == 0.0  # the request's own greedy decoding wins
    # DiffusionGemma's sampler anneals its own temperature: the model's is not taken (nor refused)
    assert (
        resolve(SamplingParams(), dg_decode, defaults)["temperature"],
        defaults.value("top_k", dg_decode, False),
    ) == (
        0.0,
        None,
    )


def test_the_models_max_new_tokens_is_cut_to_the_requests_canvas():
    defaults = GenerationDefaults.from_hf({"max_new_tokens": 1000}, source="g.json")
    decode = DecodeConfig(gen_length=32)
    length = tiny_config().max_sequence_length
    assert resolve(SamplingParams(), decode, defaults, max_sequence_length=length)["max_new_tokens"] == 32
    assert resolve(SamplingParams(gen_length=16), decode, defaults, max_sequence_length=length)["max_new_tokens"] == 16
    with pytest.raises(GenerationError, match="max_new_tokens=1000 is more than this engine's generation bucket"):
        resolve(SamplingParams(max_new_tokens=1000), decode, defaults, max_sequence_length=length)


def test_a_request_at_odds_with_the_models_other_half_names_the_file(dg_decode):
    defaults = GenerationDefaults.of_folder(TINY_DG)  # t_max 0.5
    with pytest.raises(
        GenerationError,
        match=r"request 0: t_max=0.5 must be above t_min=0.6 .*; t_max is the model's default, from .*tiny-diff",
    ):
        resolve(SamplingParams(t_min=0.6), dg_decode, defaults)
    assert resolve(SamplingParams(t_min=0.6, t_max=0.9), dg_decode, defaults)["t_span"] == pytest.approx(0.3)


@pytest.mark.parametrize(
    "text, match",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object of generation settings, got list"),
        ('{"t_min": "0.1"}', r"json: t_min='0.1' \(str\): expected a number or None"),
        ('{"top_p": 1.5}', r"json: top_p=1.5: expected a number in \(0.0, 1.0\]"),
        ('{"max_new_tokens": 0}', "json: max_new_tokens=0: expected an int"),
        ('{"max_denoising_steps": 2.5}', r"json: max_denoising_steps=2.5 \(float\)"),
        ('{"sampler_config": 3}', r"sampler_config=3 \(int\): expected an object"),
        ('{"sampler_config": {"entropy_bound": 0}}', r"sampler_config.entropy_bound: entropy_bound=0.0"),
        ('{"t_min": 0.5, "t_max": 0.5}', "t_max=0.5 must be above t_min=0.5"),
    ],
)
def test_a_bad_file_is_one_error_naming_the_file_and_key(tmp_path, text, match):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ConversionError, match=match) as error:
        GenerationDefaults.of_folder(tmp_path)
    message = str(error.value)
    assert message.startswith(str(tmp_path / "generation_config.json")) and "\n" not in message


@pytest.fixture(scope="module")
def broken_folder(tmp_path_factory):
    """A copy of tiny-diffusiongemma whose generation_config.json has a string for t_min."""
    folder = shutil.copytree(TINY_DG, tmp_path_factory.mktemp("broken") / "tiny")
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, "t_min": "low"}))
    return folder


def test_a_bad_file_stops_the_front_ends_before_the_weights_load(broken_folder, capsys, monkeypatch):
    from dllm_jax.cli.generate import main

    def no_loading(*args, **kwargs):
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr("dllm_jax.models.loading.load_model", no_loading)
    assert main(["--model", str(broken_folder), "--prompt", "sort: 3 1 2", "-q"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {broken_folder}/generation_config.json: t_min='low' (str): expected a number or None"
    # off, the file is not read
    off = GenerationDefaults.of_folder(broken_folder, "none")
    assert dict(off.values) == {}


def test_dllm_generate_sizes_a_diffusion_gemma_bucket_for_the_models_max_new_tokens(dg_config):
    from dllm_jax.cli.generate import build_parser, generation_bucket

    def bucket(*flags, mode="auto", prompt_len=20):
        args = build_parser().parse_args(["--prompt", "x", "--method", "diffusion_gemma", *flags])
        return generation_bucket(args, dg_config, [], [[1] * prompt_len], GenerationDefaults.of_folder(TINY_DG, mode))

    assert (bucket(), bucket(mode="none")) == (64, 32)  # two canvases hold its max_new_tokens 64
    assert bucket(prompt_len=100) == 32  # what the model's 128 positions leave room for
    assert (bucket("--gen-length", "32"), bucket("--max-new-tokens", "40", mode="none")) == (32, 64)
    assert bucket("--max-new-tokens", "16") == 32  # the run's own cut wins over the model's
