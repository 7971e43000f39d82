"""DiffusionGemma: config.json parsing, the Hugging Face layout, parity with transformers'
DiffusionGemmaForBlockDiffusion (random weights, torch on the CPU, float32), the experts'
grouped GEMM, and generation token-identical to transformers' ``generate``.

One tiny model keeps every feature: sliding and full layers interleaved (the full ones with wider
heads, fewer kv heads and k = v), a window shorter than the prompt, 4 experts with top-2 routing,
self-conditioning, layer scalars that differ between encoder and decoder, a vision tower in the
checkpoint (skipped), a left-padded prompt, and three canvases. transformers' ``generate`` draws
its canvases and samples with torch.randint / torch.multinomial; the generation test replays
dllm_jax's own draws (the same keys) through those two calls, so both sides see the same noise
and must produce the same tokens.
"""

import dataclasses
import functools
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import DynamicCache
from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig
from transformers_parity import relative_error

from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint
from dllm_jax.models.config import ConfigError
from dllm_jax.models.diffusion_gemma_config import (
    AttentionKind,
    DiffusionGemmaConfig,
    RopeSettings,
    diffusion_gemma_26b_a4b_config,
)
from dllm_jax.models.experts import dense_expert_mlp, grouped_expert_mlp
from dllm_jax.policies.entropy_bound import (
    DenoiseSettings,
    canvas_key,
    entropy_bound_accept,
    initial_canvas,
    sample,
    step_noise,
)
from tests.diffusion_gemma_checkpoint import TEXT_CONFIG, save_tiny_diffusion_gemma
from tests.diffusion_gemma_reference import _finish_canvas, generate

pytestmark = pytest.mark.unit

CANVAS = 6
# a prompt as long as a canvas: the reference encodes prompt and canvases with one program
BATCH, PROMPT = 2, CANVAS
PADDING = 2  # row 1 of the prompt is left-padded by this many tokens
F32 = 1e-5  # relative L2 error allowed in float32 (tests/transformers_parity.py's TOLERANCE)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """transformers' model (tests/diffusion_gemma_checkpoint.py), saved by its own save_pretrained:
    (folder, model)."""
    folder = tmp_path_factory.mktemp("diffusion_gemma")
    return folder, save_tiny_diffusion_gemma(folder, CANVAS)


@pytest.fixture(scope="module")
def loaded(hf_model):
    """(info, params) read back by dllm_jax's reader, in float32."""
    info, params = read_checkpoint(hf_model[0], dtype="float32")
    return info, jax.tree.map(jnp.asarray, params)


@pytest.fixture(scope="module")
def prompt():
    """tokens int [B, P] (ids >= 3: no special token) and valid bool [B, P] (row 1 left-padded)."""
    tokens = np.random.default_rng(1).integers(3, TEXT_CONFIG["vocab_size"], (BATCH, PROMPT))
    valid = np.ones((BATCH, PROMPT), bool)
    valid[1, :PADDING] = False
    tokens[1, :PADDING] = 0
    return tokens, valid


# ----- config ----------------------------------------------------------------------------------


def test_the_published_26b_a4b_config_pins_its_parameter_counts():
    cfg = diffusion_gemma_26b_a4b_config()
    assert cfg.layer_types == ((AttentionKind.SLIDING,) * 5 + (AttentionKind.FULL,)) * 5
    assert (cfg.d_model, cfg.n_heads, cfg.sliding_head_dim, cfg.sliding_kv_heads) == (2816, 16, 256, 8)
    assert (cfg.full_head_dim, cfg.full_kv_heads, cfg.sliding_window) == (512, 2, 1024)
    assert (cfg.n_experts, cfg.top_k_experts, cfg.expert_hidden_size, cfg.mlp_hidden_size) == (128, 8, 704, 2112)
    assert cfg.full_rope == RopeSettings(1_000_000.0, rotated_fraction=0.25)
    assert (cfg.canvas_length, cfg.eos_token_ids, cfg.image_token_id) == (256, (1, 106, 50), 258880)
    shapes = dg.abstract_params(cfg)
    # the model card's 25.2B total / 3.8B active (the text model; the vision tower not counted)
    assert dg.count_params(shapes) == 25_250_986_812
    assert dg.active_params_per_token(cfg, shapes) == 3_840_375_612


def test_the_config_transformers_writes_reads_as_the_published_layout_does(hf_model, loaded):
    saved = json.loads((hf_model[0] / "config.json").read_text())
    assert "per_layer_config" in saved["text_config"]  # transformers' form of the full layers' shape
    cfg = loaded[0].config
    assert cfg.layer_types == (AttentionKind.SLIDING, AttentionKind.FULL) * 2
    assert (cfg.sliding_head_dim, cfg.sliding_kv_heads, cfg.full_head_dim, cfg.full_kv_heads) == (8, 2, 16, 1)
    assert (cfg.canvas_length, cfg.sliding_window, cfg.n_experts, cfg.top_k_experts) == (CANVAS, 4, 4, 2)
    published = {**saved, "text_config": {k: v for k, v in saved["text_config"].items() if k != "per_layer_config"}}
    published["text_config"].update(global_head_dim=16, num_global_key_value_heads=1)
    assert DiffusionGemmaConfig.from_hf_config(published, dtype="float32") == cfg


@pytest.mark.parametrize(
    "text_update, top_update, message",
    [
        ({"hidden_activation": "relu"}, {}, "hidden_activation"),
        ({"use_bidirectional_attention": "all"}, {}, "use_bidirectional_attention"),
        ({"attention_k_eq_v": False}, {}, "attention_k_eq_v"),
        ({"attention_bias": True}, {}, "attention_bias"),
        (
            {
                "rope_parameters": {
                    "sliding_attention": {"rope_type": "yarn", "rope_theta": 1e4},
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                }
            },
            {},
            "yarn",
        ),
        (
            {"layer_types": ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"]},
            {},
            "last layer",
        ),
        ({"per_layer_config": {"1": {"head_dim": 16}, "3": {"head_dim": 32}}}, {}, "per_layer_config"),
        ({"per_layer_config": {"1": {"sliding_window": 8}}}, {}, "per_layer_config"),
        ({"num_experts": None}, {}, "num_experts"),
        ({"top_k_experts": 8}, {}, "top_k_experts"),
        ({"final_logit_softcapping": None}, {}, "final_logit_softcapping"),
        ({}, {"tie_word_embeddings": False}, "tie_word_embeddings"),
        ({}, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ],
)
def test_an_unsupported_config_value_is_an_error_naming_its_key(hf_model, text_update, top_update, message):
    saved = json.loads((hf_model[0] / "config.json").read_text())
    hf = {**saved, **top_update, "text_config": {**saved["text_config"], **text_update}}
    with pytest.raises(ConfigError, match=message):
        DiffusionGemmaConfig.from_hf_config(hf)


# ----- checkpoint ------------------------------------------------------------------------------


def test_the_checkpoint_reads_into_the_tree_and_skips_the_vision_tower(hf_model, caplog):
    folder, model = hf_model
    with caplog.at_level(logging.WARNING):
        info, params = read_checkpoint(folder, dtype="float32")
    assert "vision tower not read" in caplog.text
    assert info.skipped and all(".vision_tower." in n or ".embed_vision." in n for n in info.skipped)
    shapes = dg.abstract_params(info.config)
    assert jax.tree.structure(params) == jax.tree.structure(shapes)
    assert jax.tree.leaves(jax.tree.map(lambda a, s: a.shape == s.shape, params, shapes)) == [True] * len(
        jax.tree.leaves(shapes)
    )
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    # layer 3 is the second full layer: index 1 of the full stack; layer 2 the second sliding one
    np.testing.assert_array_equal(
        params["full_layers"]["q_proj"]["kernel"][1], state["model.decoder.layers.3.self_attn.q_proj.weight"].T
    )
    np.testing.assert_array_equal(
        params["sliding_layers"]["experts"]["gate_up_proj"][1], state["model.decoder.layers.2.experts.gate_up_proj"]
    )
    np.testing.assert_array_equal(
        params["sliding_layers"]["encoder_layer_scalar"][1], state["model.encoder.language_model.layers.2.layer_scalar"]
    )
    assert "v_proj" not in params["full_layers"]


def test_a_checkpoint_missing_a_text_tensor_is_an_error(hf_model, tmp_path):
    from safetensors.numpy import load_file, save_file

    folder = hf_model[0]
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["model.decoder.layers.1.router.per_expert_scale"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(ConversionError, match="layers.1.router.per_expert_scale"):
        read_checkpoint(tmp_path, dtype="float32")


# ----- network ---------------------------------------------------------------------------------


def _torch_layer_outputs(model, prompt, canvas, logits):
    """transformers' encoder over the prompt, then its decoder over the canvas (self-conditioned
    on ``logits``, or not when None): the encoder's and decoder's per-layer outputs, the
    encoder's final rows and the decoder's logits, as float32 numpy."""
    tokens, valid = prompt
    outputs = {"encoder": [], "decoder": []}
    hooks = [
        layer.register_forward_hook(lambda m, i, o, side=side: outputs[side].append(o.float().numpy()))
        for side, layers in (
            ("encoder", model.model.encoder.language_model.layers),
            ("decoder", model.model.decoder.layers),
        )
        for layer in layers
    ]
    try:
        with torch.no_grad():
            mask = torch.from_numpy(valid).long()
            cache = DynamicCache(config=model.config.get_text_config(decoder=True))
            encoded = model.model.encoder(
                input_ids=torch.from_numpy(tokens), attention_mask=mask, past_key_values=cache
            )
            out = model(
                decoder_input_ids=torch.from_numpy(canvas),
                past_key_values=encoded.past_key_values,
                self_conditioning_logits=None if logits is None else torch.from_numpy(logits),
                decoder_attention_mask=torch.cat([mask, torch.ones(canvas.shape, dtype=torch.long)], 1),
            )
    finally:
        for hook in hooks:
            hook.remove()
    return outputs["encoder"], outputs["decoder"], encoded.last_hidden_state.numpy(), out.logits.numpy()


@functools.partial(jax.jit, static_argnums=0)
def _jax_layer_outputs(cfg, params, tokens, valid, canvas, logits, use_logits):
    cache = dg.init_cache(cfg, tokens.shape[0], tokens.shape[1])
    cache, encoded, enc_hidden = dg.encode(cfg, params, tokens, cache, valid, return_hidden=True)
    mask = jnp.broadcast_to(use_logits, (tokens.shape[0],))
    out, dec_hidden = dg.decode(cfg, params, canvas, cache, logits, mask, return_hidden=True)
    return enc_hidden[1:], dec_hidden[1:], encoded, out


@pytest.mark.parametrize("self_conditioned", [True, False])
def test_encoder_and_decoder_match_transformers_layer_by_layer(hf_model, loaded, prompt, self_conditioned):
    info, params = loaded
    rng = np.random.default_rng(2)
    canvas = rng.integers(0, info.config.vocab_size, (BATCH, CANVAS))
    logits = (3 * rng.normal(size=(BATCH, CANVAS, info.config.vocab_size))).astype(np.float32)
    expected = _torch_layer_outputs(hf_model[1], prompt, canvas, logits if self_conditioned else None)
    actual = _jax_layer_outputs(
        info.config,
        params,
        jnp.asarray(prompt[0]),
        jnp.asarray(prompt[1]),
        jnp.asarray(canvas),
        jnp.asarray(logits),
        jnp.asarray(self_conditioned),
    )
    valid = prompt[1]
    for layer, (ours, theirs) in enumerate(zip(actual[0], expected[0])):
        # padding rows attend to nothing: their (ignored) values are implementation-defined
        assert relative_error(np.asarray(ours)[valid], theirs[valid]) < F32, f"encoder layer {layer}"
    for layer, (ours, theirs) in enumerate(zip(actual[1], expected[1])):
        assert relative_error(np.asarray(ours), theirs) < F32, f"decoder layer {layer}"
    assert relative_error(np.asarray(actual[2])[valid], expected[2][valid]) < F32
    assert relative_error(np.asarray(actual[3]), expected[3]) < F32
    if self_conditioned:  # the self-conditioning signal is not negligible: without it the logits differ
        plain = _torch_layer_outputs(hf_model[1], prompt, canvas, None)[3]
        assert relative_error(plain, expected[3]) > 100 * F32


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grouped_experts_match_the_dense_reference(dtype):
    rng = np.random.default_rng(3)
    T, D, E, F = 37, 16, 5, 12
    x = jnp.asarray(rng.normal(size=(T, D)), dtype)
    # top-2 routing: 2 distinct experts of the first 4 per row; expert 4 gets no row at all
    experts = jnp.asarray(np.stack([rng.permutation(4)[:2] for _ in range(T)]), jnp.int32)
    weights = jnp.asarray(rng.uniform(size=(T, 2)), jnp.float32)
    gate_up = jnp.asarray(rng.normal(size=(E, 2 * F, D)) / D**0.5, dtype)
    down = jnp.asarray(rng.normal(size=(E, D, F)) / F**0.5, dtype)
    grouped = jax.jit(grouped_expert_mlp)(x, weights, experts, gate_up, down)
    dense = jax.jit(dense_expert_mlp)(x, weights, experts, gate_up, down)
    assert grouped.dtype == dtype
    assert relative_error(np.asarray(grouped, np.float32), np.asarray(dense, np.float32)) < (
        F32 if dtype == jnp.float32 else 1e-2
    )


# ----- sampler and generation --------------------------------------------------------------


def test_entropy_bound_accepts_the_lowest_entropy_prefix():
    entropy = jnp.array([[0.3, 0.01, 0.05, 0.2], [0.5, 0.6, 0.7, 0.8]])
    np.testing.assert_array_equal(
        entropy_bound_accept(entropy, 0.1), [[False, True, True, True], [True, False, False, False]]
    )


@pytest.mark.parametrize("vocab", [5, 300, 1024])
def test_the_sample_follows_the_distribution(vocab):
    """The inverse-CDF draw over one block (5: block 4, padded), blocks with padding (300:
    10 blocks of 32) and exact blocks (1024: 32 of 32), with zero-probability tokens at the
    start, inside and at the end of the vocabulary, and whole blocks of them."""
    rng = np.random.default_rng(vocab)
    probs = rng.dirichlet(np.full(vocab, 0.3))
    probs[[0, vocab // 2, vocab - 1]] = 0.0
    if vocab >= 300:
        probs[32:96] = 0.0
    probs = np.float32(probs / probs.sum())
    n = 60_000
    uniform = jax.random.uniform(jax.random.key(4), (n,), jnp.float32)
    logits = jnp.broadcast_to(jnp.log(jnp.asarray(probs)), (n, vocab))
    counts = np.bincount(np.asarray(_sample(logits, uniform)), minlength=vocab)
    # within 5 standard deviations of the binomial count; no zero-probability token drawn
    assert np.all(np.abs(counts - n * probs) <= 5 * np.sqrt(n * probs * (1 - probs)) + 1), counts
    assert counts[probs == 0].sum() == 0


def test_the_sample_inverts_the_cumulative_probability():
    # cumulative 0.5, 0.5 (a zero), 0.75, 1.0 (then padding): each uniform picks the first
    # token whose cumulative probability exceeds it; the largest uniform picks the last token
    # with mass (rounding can put the target past the sum), never the zero or the padding
    logits = jnp.log(jnp.asarray([0.5, 0.0, 0.25, 0.25, 0.0], jnp.float32))
    uniform = jnp.asarray([0.0, 0.49, 0.5, 0.74, 0.75, np.nextafter(np.float32(1), np.float32(0))], jnp.float32)
    drawn = _sample(jnp.broadcast_to(logits, (uniform.size, 5)), uniform)
    np.testing.assert_array_equal(drawn, [0, 0, 2, 2, 3, 3])


def test_finishing_a_canvas_pads_after_the_first_eos():
    sequences = np.array([[1, 5, 9, 7, 9], [1, 2, 3, 4, 5], [1, 9, 9, 9, 9]])
    out, finished = _finish_canvas(sequences, np.array([False, False, True]), 4, np.array([9]), 0)
    np.testing.assert_array_equal(out, [[1, 5, 9, 0, 0], [1, 2, 3, 4, 5], [1, 0, 0, 0, 0]])
    np.testing.assert_array_equal(finished, [True, False, True])


_step_noise = jax.jit(step_noise, static_argnums=(2, 3, 4))
_sample = jax.jit(sample)
_initial_canvas = jax.jit(initial_canvas, static_argnums=(1, 2, 3))


class _ReplayedNoise:
    """torch.randint / torch.multinomial for transformers' generate, returning dllm_jax's draws:
    a canvas's first randint is its initial canvas, each step's multinomial an inverse-CDF sample
    at that step's uniforms, the randint after it that step's renoising tokens."""

    def __init__(self, rng, vocab_size):
        self.rng, self.vocab = rng, vocab_size
        self.canvas, self.step, self.sampled = -1, 0, False

    def randint(self, low, high, size, device=None, **kwargs):
        assert (low, high) == (0, self.vocab)
        batch, length = size
        if self.sampled:
            tokens = _step_noise(canvas_key(self.rng, self.canvas), self.step, batch, length, self.vocab)[1]
            self.step, self.sampled = self.step + 1, False
        else:
            self.canvas, self.step = self.canvas + 1, 0
            tokens = _initial_canvas(canvas_key(self.rng, self.canvas), batch, length, self.vocab)
        return torch.from_numpy(np.array(tokens)).long()

    def multinomial(self, probs, num_samples):
        rows = probs.shape[0] // CANVAS
        uniform = _step_noise(canvas_key(self.rng, self.canvas), self.step, rows, CANVAS, self.vocab)[0]
        self.sampled = True
        drawn = _sample(jnp.log(jnp.asarray(probs.numpy())), uniform.reshape(-1))
        return torch.from_numpy(np.array(drawn)).long()[:, None]


def _transformers_generate(model, prompt, rng, settings, eos, monkeypatch):
    noise = _ReplayedNoise(rng, model.config.text_config.vocab_size)
    with monkeypatch.context() as patch:
        patch.setattr(torch, "randint", noise.randint)
        patch.setattr(torch, "multinomial", noise.multinomial)
        out = model.generate(
            torch.from_numpy(prompt[0]),
            attention_mask=torch.from_numpy(prompt[1]).long(),
            max_new_tokens=3 * CANVAS,
            max_denoising_steps=settings.max_denoising_steps,
            t_min=settings.t_min,
            t_max=settings.t_max,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound),
            stability_threshold=settings.stability_threshold,
            confidence_threshold=settings.confidence_threshold,
            eos_token_id=list(eos),
            pad_token_id=0,
        )
    return out.sequences.numpy(), out.tokens_per_forward.numpy()


def test_generation_is_token_identical_to_transformers_under_the_same_noise(hf_model, loaded, prompt, monkeypatch):
    info, params = loaded
    cfg, model = info.config, hf_model[1]
    settings = DenoiseSettings(
        max_denoising_steps=6, t_min=0.05, t_max=0.3, entropy_bound=0.5, stability_threshold=1, confidence_threshold=0.5
    )
    rng = jax.random.key(5, impl="rbg")  # XLA's RNG: compiles faster than threefry on the CPU
    run = dict(max_new_tokens=3 * CANVAS, settings=settings, pad_token_id=0, prompt_valid=prompt[1])
    free = generate(cfg, params, prompt[0], rng, eos_token_ids=(), **run)
    # an EOS that row 0 writes inside its second canvas (and nothing else before): row 0
    # finishes there, row 1 runs on
    at, eos = next(
        (at, int(free.sequences[0, at]))
        for at in range(PROMPT + CANVAS + 1, PROMPT + 2 * CANVAS - 1)
        if free.sequences[0, at] not in free.sequences[0, PROMPT:at]
        and free.sequences[0, at] not in free.sequences[1, PROMPT:]
    )
    ours = generate(cfg, params, prompt[0], rng, eos_token_ids=(eos,), **run)
    theirs, tokens_per_forward = _transformers_generate(model, prompt, rng, settings, (eos,), monkeypatch)
    np.testing.assert_array_equal(ours.sequences, theirs)
    assert ours.sequences.shape == (BATCH, PROMPT + 3 * CANVAS)
    np.testing.assert_array_equal(ours.sequences[0, at + 1 :], 0)
    np.testing.assert_array_equal(ours.sequences[:, : at + 1], free.sequences[:, : at + 1])
    generated = (ours.sequences[:, PROMPT:] != 0).sum(axis=1)
    np.testing.assert_allclose(generated / ours.decoder_passes, tokens_per_forward, rtol=1e-6)
    # some canvas stopped denoising early (stable and confident)
    assert ours.decoder_passes.min() < 3 * settings.max_denoising_steps


def test_an_image_token_in_the_prompt_is_an_error(loaded):
    cfg, params = loaded[0].config, loaded[1]
    image_cfg = dataclasses.replace(cfg, image_token_id=90)
    with pytest.raises(ValueError, match="image inputs are not supported"):
        generate(image_cfg, params, np.array([[5, 90, 7]]), jax.random.key(0), max_new_tokens=CANVAS)


def test_dots_that_share_an_input_read_it_apart_past_the_merge_limit(monkeypatch):
    """Past MERGED_DOTS_MAX_ROWS, q/k/v and both gate/up pairs (the dense MLP's and
    self-conditioning's) read their rows through an optimization barrier (XLA:GPU's DotMerger then
    cannot concatenate their weights on every call); the values are the merged path's."""
    from tests.diffusion_gemma_small import small_config

    config = small_config()
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.standard_normal((2, 8, config.d_model)), jnp.float32)
    positions = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)

    def run(kind, params):
        layer = dg.DiffusionGemmaLayer(config, kind)
        q, k, v = layer.apply(params, h, positions, method=dg.DiffusionGemmaLayer.project_qkv)
        out = layer.apply(params, h, q.reshape(2, 8, -1), True, method=dg.DiffusionGemmaLayer.output_and_mlp)
        conditioning = dg.SelfConditioning(config)
        signal = conditioning.apply(conditioning.init(jax.random.key(3), h, h), h, 2 * h)
        return q, k, v, out, signal

    for kind in (AttentionKind.SLIDING, AttentionKind.FULL):
        params = dg.DiffusionGemmaLayer(config, kind).init(jax.random.key(1), h, positions)
        results, barriers = {}, {}
        for limit in (None, 16, 15):  # 16 rows: merged
            monkeypatch.setattr(dg, "MERGED_DOTS_MAX_ROWS", limit)
            barriers[limit] = (
                jax.jit(functools.partial(run, kind)).lower(params).as_text().count("optimization_barrier")
            )
            results[limit] = run(kind, params)
        assert barriers[None] == barriers[16] == 0
        # q/k(/v) once, the dense MLP's gate/up once, self-conditioning's gate/up once
        assert barriers[15] == 3
        for a, b in zip(results[None], results[15]):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(kind))
