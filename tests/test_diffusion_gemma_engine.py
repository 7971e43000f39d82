"""DiffusionGemma on the engine: the canvas loop's answers token-identical to the reference
generation, continuous batching, per-request values in one compiled loop, the memory check and
the front ends, on a tiny checkpoint written by transformers' save_pretrained.

The reference is tests/diffusion_gemma_reference.generate (token-identical to transformers'
generate, tests/test_diffusion_gemma_model.py) run for one request at a time with the
request's key, fold_in(key(seed), 0): the engine draws each request's noise from its own key,
so at batch 1 both see the same draws. The requests differ in prompt length (one to three
prefill chunks), seed, max_new_tokens and every sampling value; one of them meets the model's
EOS inside its second canvas, and some canvases stop before max_denoising_steps. Every test
shares one engine and its one compiled loop (two slots, three canvases, prompts up to 32
tokens); dllm-generate and the server reach the same program (the compilation cache, or the
engine's own loop).
"""

import dataclasses
import json

import jax
import numpy as np
import pytest

from dllm_jax.common.errors import GenerationError
from dllm_jax.engine.engine import Engine
from dllm_jax.engine.request import HostRing, Request, slot_values
from dllm_jax.models.loading import load_model
from dllm_jax.policies.entropy_bound import DenoiseSettings
from dllm_jax.runtime.canvas_cache import canvas_cache_bytes
from dllm_jax.runtime.canvas_memory import check_canvas_loop
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.runtime.kernel_routing import (
    Kernels,
    cache_write,
    canvas_attention,
    grouped_gemm,
    head_norm,
    moe_output,
)
from dllm_jax.runtime.memory_estimate import DeviceMemory, InsufficientMemoryError
from dllm_jax.sampling.params import SamplingParams
from dllm_jax.text.tiny_tokenizer import save_tiny_tokenizer
from tests.diffusion_gemma_checkpoint import save_tiny_diffusion_gemma
from tests.diffusion_gemma_reference import generate

pytestmark = pytest.mark.engine

CANVAS = 6
GEN = 3 * CANVAS
VOCAB = 128  # the tiny tokenizer's ids fit
DECODE = DecodeConfig(method="diffusion_gemma", gen_length=GEN, batch_size=2)
BASE = DenoiseSettings(
    max_denoising_steps=6, t_min=0.05, t_max=0.3, entropy_bound=0.5, stability_threshold=1, confidence_threshold=0.5
)
# (prompt length, seed, max_new_tokens, settings); request 0 meets the EOS in its second canvas
REQUESTS = (
    (6, 3, GEN, BASE),
    # two prefill chunks; confident at once, but on these random weights no canvas's argmax
    # repeats over 3 steps, so every canvas runs its 6 steps (the stop rule: the next test but one)
    (9, 5, GEN, dataclasses.replace(BASE, stability_threshold=2, confidence_threshold=5.0)),
    # two canvases, the answer cut at 7 tokens; each canvas stops after its first step
    (4, 7, 7, dataclasses.replace(BASE, stability_threshold=0, confidence_threshold=5.0)),
    # three prefill chunks (and the prompt bucket of 32 every test here shares)
    (17, 11, GEN, DenoiseSettings(4, t_min=0.4, t_max=0.9, entropy_bound=0.1, stability_threshold=1)),
)
WIDTH = 32  # the prompt bucket of the one compiled loop


def _sampling(seed: int, max_new_tokens: int, settings: DenoiseSettings) -> SamplingParams:
    return SamplingParams(max_new_tokens=max_new_tokens, seed=seed, **dataclasses.asdict(settings))


def _reference(config, weights, prompt, seed, max_new_tokens, settings, eos_token_ids=None):
    key = jax.random.fold_in(jax.random.key(seed), 0)
    run = dict(max_new_tokens=max_new_tokens, settings=settings, pad_token_id=config.pad_token_id)
    return generate(config, weights, np.array([prompt]), key, eos_token_ids=eos_token_ids, **run)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(1)
    return [[int(t) for t in rng.integers(3, 90, n)] for n, *_ in REQUESTS]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, prompts):
    """The folder (transformers' save_pretrained plus the tiny tokenizer), its config.json's EOS
    set to a token request 0 first writes inside its second canvas (found by the reference
    without an EOS), so that request ends there."""
    folder = tmp_path_factory.mktemp("diffusion_gemma_engine")
    save_tiny_diffusion_gemma(folder, CANVAS, vocab_size=VOCAB)
    save_tiny_tokenizer(folder)
    model = load_model(folder, dtype="float32")
    length, seed, max_new, settings = REQUESTS[0]
    answer = _reference(model.config, model.weights, prompts[0], seed, max_new, settings, ()).sequences[0, length:]
    eos = next(int(t) for t in answer[CANVAS + 1 : 2 * CANVAS - 1] if t not in answer[: list(answer).index(t)])
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [eos]
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def engine(checkpoint):
    return Engine.from_pretrained(str(checkpoint), dtype="float32")


@pytest.fixture(scope="module")
def expected(engine, prompts):
    """Per request: (answer ids up to its first EOS and at most max_new_tokens, decoder passes)."""
    out = []
    for prompt, (length, seed, max_new, settings) in zip(prompts, REQUESTS):
        ref = _reference(engine.config, engine.weights, prompt, seed, max_new, settings)
        answer = [int(t) for t in ref.sequences[0, length : length + max_new]]
        end = next((i for i, t in enumerate(answer) if t in engine.config.eos_token_ids), len(answer))
        out.append((answer[:end], int(ref.decoder_passes[0])))
    return out


def _generate(engine, prompts, decode_config=DECODE):
    """The engine's answers to REQUESTS."""
    sampling = [_sampling(seed, max_new, settings) for _, seed, max_new, settings in REQUESTS]
    return engine.generate(prompts, sampling, decode_config=decode_config)


def _assert_reference_answers(out, expected) -> None:
    """Every request's tokens and denoising steps are the reference's."""
    for i, (result, (tokens, passes)) in enumerate(zip(out.results, expected)):
        assert result.token_ids == tokens, f"request {i}"
        assert result.steps == passes, f"request {i}: denoising steps"


@pytest.fixture(scope="module")
def answers(engine, prompts):
    return _generate(engine, prompts)


def test_answers_are_token_identical_to_the_reference(answers, expected):
    _assert_reference_answers(answers, expected)
    reasons = [r.finish_reason for r in answers.results]
    assert reasons[0] == "stop" and len(answers.results[0].token_ids) < 2 * CANVAS  # the EOS in canvas 2
    assert reasons[2] == "length" and len(answers.results[2].token_ids) == 7
    assert answers.results[1].steps == 3 * BASE.max_denoising_steps
    assert answers.results[2].steps == 2  # two canvases of one step each


def test_four_requests_in_two_slots_share_one_compiled_loop(engine, answers, prompts):
    assert answers.stats.num_requests == 4
    # other values, one request: the same compiled loop (a loop for fewer slots is not compiled)
    settings = DenoiseSettings(5, t_min=0.1, t_max=0.6, entropy_bound=0.3, stability_threshold=3)
    again = engine.generate(prompts[3:], _sampling(21, 2 * CANVAS, settings), decode_config=DECODE)
    reference = _reference(engine.config, engine.weights, prompts[3], 21, 2 * CANVAS, settings)
    answer = [int(t) for t in reference.sequences[0, len(prompts[3]) :]]
    end = next((i for i, t in enumerate(answer) if t in engine.config.eos_token_ids), len(answer))
    assert again.results[0].token_ids == answer[:end]
    assert engine.num_compilations == 1


def test_a_request_finishing_early_frees_its_slot_for_the_next(engine, prompts, answers):
    compiled = engine.compile(DECODE, WIDTH, num_slots=2)
    assert engine.num_compilations == 1
    ring = HostRing(compiled.queue_capacity, compiled.prompt_width)
    short = dataclasses.replace(BASE, stability_threshold=0, confidence_threshold=5.0)  # one step per canvas
    requests = [_sampling(1, CANVAS, short), _sampling(2, GEN, BASE), _sampling(3, GEN, BASE)]
    for g, (prompt, sampling) in enumerate(zip(prompts, requests)):
        values = slot_values(
            sampling, len(prompt), compiled.decode_config, cfg=False, max_sequence_length=64, order=g, where=""
        )
        ring.put(Request(g, g, prompt, sampling, values, ring_index=g))
    state = compiled.init(*ring.arrays(), jax.numpy.int32(3))
    state = compiled.run(engine.weights, state, 1000)
    results = jax.device_get(state.results)
    assert results.done[:3].all()
    # request 0: one prefill pass and one denoising step; request 2 takes its slot at once
    assert results.end_iter[0] == 2 and results.start_iter[2] == 2
    assert results.end_iter[1] > results.start_iter[2]


@pytest.mark.parametrize(
    "sampling, decode_config, match",
    [
        (SamplingParams(temperature=0.5), DECODE, "temperature=0.5 does not apply to method='diffusion_gemma'"),
        (SamplingParams(stability_threshold=5), DECODE, "stability_threshold=5 is more than the loop holds"),
        (SamplingParams(), DecodeConfig(gen_length=GEN), "method='flash_cache' does not run a diffusion_gemma model"),
        (SamplingParams(), dataclasses.replace(DECODE, block_length=4), "block_length=4"),
        (SamplingParams(max_new_tokens=GEN + 1), DECODE, "generation bucket"),
        # the canvases are the model's (max_new_tokens cuts the answer); the loop records no logprobs
        (SamplingParams(gen_length=CANVAS), DECODE, "gen_length=6 does not apply to method='diffusion_gemma'"),
        (SamplingParams(logprobs=0), DECODE, "logprobs=0 does not apply to method='diffusion_gemma'"),
    ],
)
def test_a_request_the_loop_cannot_take_is_refused_before_compiling(engine, sampling, decode_config, match):
    with pytest.raises(GenerationError, match=match):
        engine.generate([[5, 6, 7]], sampling, decode_config=decode_config)


def test_a_loop_recording_logprobs_is_refused():
    with pytest.raises(ValueError, match="max_logprobs=0 does not apply to method='diffusion_gemma'"):
        dataclasses.replace(DECODE, max_logprobs=0)


def test_the_cut_answer_is_a_prefix_of_the_uncut_one(engine, prompts, answers):
    # request 2 is cut at 7 tokens (two canvases decoded); uncut, it decodes all three
    length, seed, max_new, settings = REQUESTS[2]
    other = _sampling(*REQUESTS[3][1:])  # its 17-token prompt keeps the loop's prompt bucket of 32
    run = engine.generate([prompts[2], prompts[3]], [_sampling(seed, GEN, settings), other], decode_config=DECODE)
    uncut = run.results[0]
    cut = answers.results[2]
    assert max_new < GEN and cut.finish_reason == "length" and len(cut.token_ids) == max_new
    assert uncut.token_ids[:max_new] == cut.token_ids and len(uncut.token_ids) > max_new


def test_an_image_token_in_a_prompt_is_refused(engine):
    image = dataclasses.replace(engine.config, image_token_id=40)
    with pytest.raises(GenerationError, match="image"):
        Engine(image, engine.weights).generate([[5, 40, 7]], decode_config=DECODE)


def test_the_memory_estimate_counts_the_cache_and_refuses_what_does_not_fit(engine):
    compiled = engine.compile(DECODE, WIDTH, num_slots=2)
    loop = compiled.loop
    assert compiled.memory.cache == canvas_cache_bytes(engine.config, 2, loop.max_len)
    assert compiled.memory.weights == sum(w.size * 4 for w in jax.tree.leaves(engine.weights))
    shape = dict(queue_capacity=compiled.queue_capacity, prompt_width=compiled.prompt_width)
    enough = DeviceMemory(available=2 * compiled.memory.total, name="test")
    assert check_canvas_loop(loop, memory=enough, **shape) == compiled.memory
    with pytest.raises(InsufficientMemoryError, match="batch size 2 .* test has .* even one slot does not fit"):
        check_canvas_loop(loop, memory=DeviceMemory(available=1, name="test"), **shape)


@pytest.mark.parametrize("kernel_sampler, group, per_logit", [(False, 1, 6 * 4), (True, 8, 2 * 2)])
def test_the_denoising_stage_takes_as_many_slots_at_a_time_as_its_temporaries_allow(kernel_sampler, group, per_logit):
    """At the 26B-A4B shape (256 x 262144 logits per slot) with 32 slots: XLA's stage (six
    float32 copies, 1.5 GiB per slot) one slot at a time, the canvas sampler kernel's (the LM
    head's bfloat16 output and the probabilities, 256 MiB per slot) 8; the memory estimate
    counts one group. Shapes only."""
    from dllm_jax.models.diffusion_gemma_config import diffusion_gemma_26b_a4b_config
    from dllm_jax.policies.factory import make_canvas_policy
    from dllm_jax.runtime.canvas_loop import CanvasLoop, sampler_group
    from dllm_jax.runtime.canvas_memory import estimate_canvas_loop

    config = diffusion_gemma_26b_a4b_config()
    decode = DecodeConfig(method="diffusion_gemma", gen_length=256, batch_size=32).for_model(config)
    loop = CanvasLoop(
        model=config,
        policy=make_canvas_policy(decode, config),
        num_slots=32,
        max_len=512,
        gen_length=256,
        kernels=Kernels(canvas_sampler=kernel_sampler),
    )
    assert loop.kernel_sampler == kernel_sampler
    assert (loop.sampler_slots, loop.sampler_bytes_per_logit) == (group, per_logit)
    estimate = estimate_canvas_loop(loop, queue_capacity=32, prompt_width=256)
    assert estimate.logits == group * 256 * 262144 * per_logit + 32 * 256 * 2816 * 2
    # the largest divisor of the slots that fits: 12 slots go 6 at a time, 9 slots 3
    assert sampler_group(12, 256, 262144, per_logit) == min(6, group)
    assert sampler_group(9, 256, 262144, per_logit) == min(3, group)


@pytest.mark.integration  # full tier: a front end on another family than the default LLaDA (its own loop)
def test_dllm_generate_runs_a_diffusion_gemma_folder_by_its_family(checkpoint, engine, capsys):
    from dllm_jax.cli.generate import main

    prompts = ["a" * 20, "b" * 18]  # character ids: the loop's prompt bucket of 32
    argv = ["--model", str(checkpoint), "--no-chat", "--batch-size", "2", "--gen-length", str(GEN), "--seed", "4"]
    argv += ["--max-denoising-steps", "3", "--t-max", "0.5", "--no-progress", "-q"]
    assert main(argv + [a for p in prompts for a in ("--prompt", p)]) == 0
    printed = capsys.readouterr().out
    sampling = SamplingParams(max_denoising_steps=3, t_max=0.5)
    for i, result in enumerate(engine.generate(prompts, sampling, decode_config=DECODE, seed=4).results):
        assert f"### [{i}] {prompts[i]}\n{result.text}\n" in printed
    # a value of another method is refused before the weights load
    assert main(argv + ["--prompt", "x", "--temperature", "0.5"]) == 2
    assert "temperature=0.5 does not apply to method='diffusion_gemma'" in capsys.readouterr().err


@pytest.mark.integration  # full tier: a front end on another family than the default LLaDA (its own loop)
def test_the_server_answers_completions_and_chat_as_the_engine_does(engine):
    from fastapi.testclient import TestClient

    from dllm_jax.serve.assemble import ServeOptions, assemble

    options = ServeOptions(model_name="tiny-dg", methods=("diffusion_gemma",), batch_size=2, gen_length=GEN)
    server = assemble(engine, engine.tokenizer, dataclasses.replace(options, max_model_len=WIDTH + GEN))
    assert engine.num_compilations == 1  # the warm-up ran the engine's own loop
    dllm = {"max_denoising_steps": 4, "t_max": 0.5}
    messages = [{"role": "user", "content": "hi"}]
    with TestClient(server.app) as client:
        completion = client.post(
            "/v1/completions", json={"model": "tiny-dg", "prompt": "hello", "max_tokens": 12, "seed": 3, "dllm": dllm}
        )
        chat = client.post(
            "/v1/chat/completions",
            json={"model": "tiny-dg", "messages": messages, "max_tokens": 12, "seed": 4, "stream": True, "dllm": dllm},
        )
        refused = client.post(
            "/v1/completions", json={"model": "tiny-dg", "prompt": "hello", "temperature": 0.7, "max_tokens": 4}
        )
        no_logprobs = client.post(
            "/v1/completions", json={"model": "tiny-dg", "prompt": "hello", "logprobs": 0, "max_tokens": 4}
        )
    sampling = dict(max_new_tokens=12, max_denoising_steps=4, t_max=0.5)
    text = engine.generate(["hello"], SamplingParams(seed=3, **sampling), decode_config=DECODE).results[0].text
    assert completion.status_code == 200 and completion.json()["choices"][0]["text"] == text
    streamed = [json.loads(line[6:]) for line in chat.text.splitlines() if line.startswith("data: {")]
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in streamed if c["choices"])
    answer = engine.chat([messages], SamplingParams(seed=4, **sampling), decode_config=DECODE).results[0].text
    assert content == answer
    assert refused.status_code == 400 and "does not apply to method='diffusion_gemma'" in refused.text
    assert no_logprobs.status_code == 400 and "records no log-probabilities" in no_logprobs.text


def test_the_cached_canvas_path_recomputing_every_row_matches_the_reference(engine, prompts, expected):
    # Flash-Cache on the canvas with every row recomputed: the canvas rows' K/V go through the
    # cache (written, then read back) and the full pass runs in lanes, the answers as before
    cached = Engine(engine.config, engine.weights, engine.tokenizer, full_pass_lanes=())
    decode_config = dataclasses.replace(DECODE, canvas_rows=CANVAS)
    _assert_reference_answers(_generate(cached, prompts, decode_config), expected)


@pytest.mark.integration  # full tier: one more compiled loop (the denoising stage in groups)
def test_the_denoising_stage_one_slot_at_a_time_gives_the_same_answers(engine, prompts, expected, monkeypatch):
    # a full-size vocabulary's stage runs in groups of slots (lax.map); the tiny model's fits
    # whole, so the budget is cut to one slot's temporaries
    from dllm_jax.runtime import canvas_loop

    monkeypatch.setattr(canvas_loop, "SAMPLER_BUDGET_BYTES", 6 * 4 * CANVAS * engine.config.vocab_size)
    grouped = Engine(engine.config, engine.weights, engine.tokenizer)
    assert grouped.decode_loop(DECODE, WIDTH).sampler_slots == 1 < DECODE.batch_size
    _assert_reference_answers(_generate(grouped, prompts), expected)


@pytest.mark.integration  # full tier: the interpreted kernels inside the decode loop
def test_the_gpu_kernels_give_the_reference_tokens(checkpoint, prompts, expected):
    """The canvas loop as backend "auto" runs it on an NVIDIA GPU, in interpret mode: the
    attention by the Triton cache-attention kernel (encoder chunks: causal own rows and a
    sliding window per row; canvases: all own rows), the experts by the grouped GEMM kernels
    (gate/up with gelu(gate) * up in its epilogue), q/k/v's per-head norms and RoPE by the
    head-norm kernel, the experts' sum with the MoE block's post-norms and residual by the
    moe_residual kernel and the cache writes by the row-scatter kernel (both backend "pallas";
    "auto" does not run them yet) and the denoising stage by the canvas sampler kernel; the
    same answers and denoising steps as the reference. One more compiled loop than the shared
    engine's (the kernels change the loop's program); each kernel alone against its reference:
    tests/test_canvas_attention.py, tests/test_grouped_matmul.py, tests/test_head_norm_rope.py,
    tests/test_moe_residual.py, tests/test_scatter_rows.py, tests/test_canvas_sampler.py."""
    kernel = Engine.from_pretrained(
        str(checkpoint),
        dtype="float32",
        backend=Kernels(
            attention=True, experts=True, canvas_sampler=True, head_norm=True, moe_output=True, canvas_scatter=True
        ),
        interpret=True,
    )
    assert kernel.decode_loop(DECODE, WIDTH).kernel_sampler and canvas_attention(kernel.kernels) == "interpret"
    assert grouped_gemm(kernel.kernels) == "interpret" == head_norm(kernel.kernels) == moe_output(kernel.kernels)
    assert cache_write(kernel.kernels) == "interpret"
    _assert_reference_answers(_generate(kernel, prompts), expected)
    assert kernel.num_compilations == 1


@pytest.mark.parametrize(
    "threshold, older_equal, confidence, ends",
    [
        (2, True, 5.0, True),  # equal to both kept argmax canvases, confident
        (2, False, 5.0, False),  # the older one differs
        (1, False, 5.0, True),  # only the last one counts
        (1, True, 1e-6, False),  # stable but not confident
        (0, False, 5.0, True),  # confident alone
    ],
)
def test_a_canvas_ends_when_its_argmax_repeats_the_last_steps_with_confidence(threshold, older_equal, confidence, ends):
    from dllm_jax.policies.canvas import CanvasPolicy
    from dllm_jax.runtime.canvas_slots import COMMIT, DENOISE, empty_canvas_slots

    policy = CanvasPolicy(canvas_length=6, vocab_size=VOCAB, max_stability=2, eos_ids=(1,), pad_id=0)
    argmax = np.arange(6, dtype=np.int32) + 40
    slot = jax.tree.map(lambda x: x[0], empty_canvas_slots(1, 64, 6, 2, 8, np.float32))
    slot = slot.replace(
        active=np.bool_(True),
        phase=np.int32(DENOISE),
        start=np.int32(10),
        gen_end=np.int32(40),
        denoise_step=np.int32(2),
        history=np.stack([argmax + (0 if older_equal else 1), argmax]),
        sampling=slot.sampling.replace(
            t_min=np.float32(0.1),
            t_span=np.float32(0.2),
            max_denoising_steps=np.int32(10),
            entropy_bound=np.float32(0.1),
            stability_threshold=np.int32(threshold),
            confidence_threshold=np.float32(confidence),
        ),
    )
    # logits peaked on argmax: entropy about 0.02 per row at this step's temperature 0.26
    logits = np.where(np.arange(VOCAB) == argmax[:, None], 3.0, 0.0).astype(np.float32)
    stepped, _ = policy.denoise(slot, logits)
    assert int(stepped.phase) == (COMMIT if ends else DENOISE)
    np.testing.assert_array_equal(stepped.history[-1], argmax)


def test_a_sparse_step_recomputes_new_samples_then_renoised_rows_then_the_most_attended():
    from dllm_jax.policies.canvas import CanvasPolicy
    from dllm_jax.runtime.canvas_slots import DENOISE, empty_canvas_slots

    policy = CanvasPolicy(canvas_length=6, vocab_size=VOCAB, max_stability=1, eos_ids=(1,), pad_id=0, cached_rows=4)
    slot = jax.tree.map(lambda x: x[0], empty_canvas_slots(1, 32, 6, 1, 8, np.float32))
    slot = slot.replace(
        active=np.bool_(True),
        phase=np.int32(DENOISE),
        start=np.int32(10),
        denoise_step=np.int32(3),
        noisy=np.arange(6, dtype=np.int32) + 50,
        changed=np.array([False, True, False, True, False, False]),
        sampled=np.array([False, False, False, True, True, False]),
        scores=np.array([0.5, 9.0, 3.0, -1.0, 2.0, 7.0], np.float32),
    )
    rows, offsets = policy.sparse_rows(slot)
    # row 3: a new sample; row 1: renoised; then the highest scores among the rest: 5 (7.0), 2 (3.0)
    np.testing.assert_array_equal(offsets, [3, 1, 5, 2])
    np.testing.assert_array_equal(rows.positions, [13, 11, 15, 12])
    np.testing.assert_array_equal(rows.tokens, [53, 51, 55, 52])
    assert bool(rows.decoder) and rows.valid.all() and bool(policy.needs_full(slot.replace(denoise_step=np.int32(0))))
