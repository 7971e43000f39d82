"""Train the embedded tiny DiffusionGemma (tiny-diffusiongemma) on the synthetic tasks of
dllm_jax.evaluation.tiny_tasks, with the block-diffusion objective of its family.

The response (the answer, ``<end_of_turn>``, then ``<eos>`` to the canvas end) is generated in
canvases of CANVAS_LENGTH tokens, at most MAX_CANVASES. A training example is one of the
canvases generation produces for a problem (those up to and including the one holding the end
of turn, drawn uniformly), after its prefix: the chat-formatted prompt and the clean canvases
before it, left-padded to PREFIX_LEN (positions only enter attention relative to each other).
The objective is uniform-state diffusion (DiffusionGemma's SFT as NVIDIA NeMo's DiffusionGemma
recipes describe it, after the UDLM papers):

* the encoder (causal) reads the clean prefix and fills the K/V cache;
* each example draws a corruption level t ~ U(eps, 1); each canvas token is replaced by a
  uniformly random vocabulary id with probability t (there is no mask token);
* the decoder denoises the canvas over that cache and itself: dllm_jax.models.diffusion_gemma's
  encode and decode, as generation runs them;
* self-conditioning (Analog Bits' two passes): a first decoder pass without self-conditioning
  gives logits that are, without gradient, the self-conditioning input of the scored second
  pass, for each example with probability ``self_conditioning_p``;
* the loss is the mean cross-entropy against the clean token at every canvas position, plus
  ``encoder_loss_weight`` times the encoder's mean next-token cross-entropy on the response
  tokens it predicts (those of the prefix, and the canvas's first).

The training examples are encoded once, before training (POOL_CHUNK problems per seeded
chunk, chunks spread over --workers processes), into a pool that lives on the device; each step
draws its batch from the pool inside the compiled step, so the host does no per-step work. The
routed experts are computed by their dense reference during training (see dense_experts).

The embedded model's run (one H200, about 30 steps of 512 examples a second: the time limit
stopped it at step 2210 of the 8000 its learning-rate schedule spans; see its README):

  PYTHONPATH=. python scripts/train_tiny_diffusion_gemma.py --steps 8000 --batch-size 512 --lr 3e-3 \\
      --warmup 200 --pool-size 131072 --workers 14 --eval-every 100000 --ckpt-every 100000 \\
      --final-eval-problems 256 --time-limit 75 --out /tmp/tdg --export out/tiny-diffusiongemma
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import multiprocessing
import os
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from tqdm import tqdm
from transformers import PreTrainedTokenizerBase

from convert.jax_to_hf import save_hf_checkpoint
from dllm_jax.common.atomic_write import write_text_atomically
from dllm_jax.evaluation import tiny_tasks
from dllm_jax.models import diffusion_gemma as dg
from dllm_jax.models import experts
from dllm_jax.models.config import ConfigError
from dllm_jax.models.diffusion_gemma_config import (
    SMALLEST_VISION_CONFIG,
    AttentionKind,
    DiffusionGemmaConfig,
    RopeSettings,
)
from dllm_jax.policies.entropy_bound import DenoiseSettings
from dllm_jax.text.tiny_tokenizer import END_OF_TURN, TINY_VOCAB_SIZE, build_tiny_tokenizer, save_tiny_tokenizer
from scripts.train_tiny import _parse_mix, _positive_float, _positive_int, check_run_folder, make_optimizer, prompt_ids

FAMILY = "diffusion_gemma"
CANVAS_LENGTH = 32
# The tasks' longest response (answer and end of turn) is 40 tokens, their longest
# chat-formatted prompt 41: two canvases, and a prefix of at most 41 + 32 tokens.
MAX_CANVASES = 2
PREFIX_LEN = 73
MAX_POSITIONS = 128
NOISE_EPS = 1e-3
POOL_CHUNK = 1024
# Settings that must be the same when a run is resumed (the others may change).
_RUN_KEYS = (
    "seed",
    "batch_size",
    "d_model",
    "n_layers",
    "n_heads",
    "head_dim",
    "mlp_hidden",
    "n_experts",
    "top_k",
    "expert_hidden",
    "sliding_window",
    "lr",
    "warmup",
    "weight_decay",
    "mix",
    "self_conditioning_p",
    "encoder_loss_weight",
    "pool_size",
)

# Held-out decoding of the trainer and the settings written to generation_config.json.
GENERATION = DenoiseSettings(
    max_denoising_steps=16, t_min=0.1, t_max=0.5, entropy_bound=1.0, stability_threshold=1, confidence_threshold=0.01
)


# ----------------------------------------------------------------------------- data


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    return tokenizer.convert_tokens_to_ids(END_OF_TURN[FAMILY])


def response_canvases(tokenizer: PreTrainedTokenizerBase, answer: str) -> np.ndarray:
    """int32 [C, CANVAS_LENGTH]: the canvases generation produces for ``answer``: the answer,
    <end_of_turn>, then <eos> to the end of the canvas holding the end of turn."""
    response = tokenizer(answer, add_special_tokens=False)["input_ids"] + [end_of_turn_id(tokenizer)]
    count = -(-len(response) // CANVAS_LENGTH)
    if count > MAX_CANVASES:
        raise ValueError(f"{answer!r}: {len(response)} tokens need more than {MAX_CANVASES} canvases")
    canvases = np.full(count * CANVAS_LENGTH, tokenizer.eos_token_id, np.int32)
    canvases[: len(response)] = response
    return canvases.reshape(count, CANVAS_LENGTH)


def encode_training_batch(
    tokenizer: PreTrainedTokenizerBase, problems: Sequence[tiny_tasks.Problem], rng: random.Random
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Problems -> one training example each (a canvas drawn with rng among the problem's).

    Returns:
      tokens: int32 [B, PREFIX_LEN + CANVAS_LENGTH], the prefix (prompt and the canvases before
        the drawn one) left-padded with pad ids to PREFIX_LEN, then the clean canvas.
      valid: bool [B, PREFIX_LEN], False on the padding.
      response: bool [B, PREFIX_LEN + CANVAS_LENGTH], True on response tokens (canvas tokens).
    """
    B, T = len(problems), PREFIX_LEN + CANVAS_LENGTH
    tokens = np.full((B, T), tokenizer.pad_token_id, np.int32)
    valid = np.ones((B, PREFIX_LEN), bool)
    response = np.zeros((B, T), bool)
    for b, problem in enumerate(problems):
        prompt = prompt_ids(tokenizer, problem.prompt)
        canvases = response_canvases(tokenizer, problem.answer)
        c = rng.randrange(len(canvases))
        row = np.concatenate([prompt, canvases[: c + 1].ravel()])
        if len(row) > T:
            raise ValueError(f"{problem.prompt!r}: a prefix of {len(row) - CANVAS_LENGTH} tokens exceeds {PREFIX_LEN}")
        pad = T - len(row)
        tokens[b, pad:] = row
        valid[b, :pad] = False
        response[b, pad + len(prompt) :] = True
    return tokens, valid, response


def _encode_pool_chunk(seed: int, chunk: int, mix: dict[str, float] | None) -> tuple[np.ndarray, ...]:
    """encode_training_batch's arrays for POOL_CHUNK problems of chunk ``chunk``'s seeded stream."""
    tokenizer = build_tiny_tokenizer(MAX_POSITIONS, FAMILY)
    stream = tiny_tasks.problems("train", seed=seed * 1_000_000 + chunk, mix=mix)
    problems = [next(stream) for _ in range(POOL_CHUNK)]
    return encode_training_batch(tokenizer, problems, random.Random(f"canvas:{seed}:{chunk}"))


def encode_pool(size: int, seed: int, mix: dict[str, float] | None, workers: int = 1) -> tuple[np.ndarray, ...]:
    """The training pool: encode_training_batch's (tokens, valid, response) for ``size``
    examples (a multiple of POOL_CHUNK), chunk c from the stream of seed * 1e6 + c; the same
    arguments give the same pool for any number of workers."""
    if size % POOL_CHUNK:
        raise ValueError(f"pool size {size}: expected a multiple of {POOL_CHUNK}")
    chunks = range(size // POOL_CHUNK)
    if workers == 1:
        parts = [_encode_pool_chunk(seed, c, mix) for c in chunks]
    else:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            parts = list(pool.map(_encode_pool_chunk, [seed] * len(chunks), chunks, [mix] * len(chunks)))
    return tuple(np.concatenate(arrays) for arrays in zip(*parts))


# ----------------------------------------------------------------------------- model and loss


def tiny_model_config(
    tokenizer: PreTrainedTokenizerBase,
    *,
    d_model: int,
    n_layers: int,
    n_heads: int,
    head_dim: int,
    mlp_hidden: int,
    n_experts: int,
    top_k: int,
    expert_hidden: int,
    sliding_window: int,
) -> DiffusionGemmaConfig:
    """The tiny model's architecture (float32 for training): Gemma's pattern of sliding layers
    with one full layer after each pair (the last one full), full layers with heads twice as
    wide, one kv head and a quarter of their RoPE pairs rotated, as the 26B-A4B model's."""
    kinds = [AttentionKind.FULL if (i + 1) % 3 == 0 else AttentionKind.SLIDING for i in range(n_layers)]
    kinds[-1] = AttentionKind.FULL
    return DiffusionGemmaConfig(
        d_model=d_model,
        n_heads=n_heads,
        layer_types=tuple(kinds),
        sliding_head_dim=head_dim,
        sliding_kv_heads=max(1, n_heads // 2),
        full_head_dim=2 * head_dim,
        full_kv_heads=1,
        mlp_hidden_size=mlp_hidden,
        n_experts=n_experts,
        top_k_experts=top_k,
        expert_hidden_size=expert_hidden,
        vocab_size=TINY_VOCAB_SIZE,
        sliding_window=sliding_window,
        sliding_rope=RopeSettings(10_000.0),
        full_rope=RopeSettings(1_000_000.0, rotated_fraction=0.25),
        canvas_length=CANVAS_LENGTH,
        max_sequence_length=MAX_POSITIONS,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_ids=(tokenizer.eos_token_id, end_of_turn_id(tokenizer)),
        dtype="float32",
    )


def corrupt_canvas(canvas: jax.Array, vocab_size: int, rng: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The forward (uniform noise) process.

    Args:
      canvas: int32 [B, L] clean canvases.
    Returns:
      noisy: int32 [B, L], each token replaced with probability t by a uniform id of [0, V);
      t: float32 [B, 1], (1 - eps) u + eps with u ~ U(0, 1), one level per canvas.
    """
    level_key, where_key, token_key = jax.random.split(rng, 3)
    t = (1.0 - NOISE_EPS) * jax.random.uniform(level_key, (canvas.shape[0], 1)) + NOISE_EPS
    replace = jax.random.uniform(where_key, canvas.shape) < t
    noise = jax.random.randint(token_key, canvas.shape, 0, vocab_size, jnp.int32)
    return jnp.where(replace, noise, canvas), t


def block_diffusion_loss(
    config: DiffusionGemmaConfig,
    params: dg.Weights,
    batch: tuple[jax.Array, ...],
    rng: jax.Array,
    self_conditioning_p: float,
    encoder_loss_weight: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The loss of one batch (encode_training_batch's arrays) and its parts.

    Returns:
      float32 scalar: the mean canvas cross-entropy plus encoder_loss_weight times the
      encoder's mean next-token cross-entropy over the response tokens it predicts; and
      {"diffusion", "encoder"}: the two parts.
    """
    tokens, valid, response = batch
    B = tokens.shape[0]
    noise_key, sc_key = jax.random.split(rng)
    cache = dg.init_cache(config, B, PREFIX_LEN)
    cache, _, hidden = dg.encode(config, params, tokens[:, :PREFIX_LEN], cache, valid, return_hidden=True)

    clean = tokens[:, PREFIX_LEN:]
    noisy, _ = corrupt_canvas(clean, config.vocab_size, noise_key)
    first = jax.lax.stop_gradient(dg.decode(config, params, noisy, cache))
    use_sc = jax.random.uniform(sc_key, (B,)) < self_conditioning_p
    logits = dg.decode(config, params, noisy, cache, first, use_sc)
    diffusion = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits, clean))

    # the encoder's output row i predicts token i + 1
    ar_logits = dg.final_logits(config, params, hidden[-1])
    ar_ce = optax.softmax_cross_entropy_with_integer_labels(ar_logits, tokens[:, 1 : PREFIX_LEN + 1])
    scored = response[:, 1 : PREFIX_LEN + 1]
    encoder = jnp.sum(jnp.where(scored, ar_ce, 0.0)) / jnp.maximum(jnp.sum(scored), 1)
    return diffusion + encoder_loss_weight * encoder, {"diffusion": diffusion, "encoder": encoder}


@contextlib.contextmanager
def dense_experts() -> Iterator[None]:
    """Within it, the model's routed experts are computed by experts.dense_expert_mlp, the
    grouped GEMM's reference of the same signature and result (tests/test_diffusion_gemma_model
    checks them equal): at a few experts it is as fast (on the CPU, XLA lowers
    jax.lax.ragged_dot to a product with every expert for each of the T K routing slots, K times
    the dense reference's work) and its gradient is plain matmuls on every backend. Programs
    traced inside keep it."""
    grouped = experts.grouped_expert_mlp
    experts.grouped_expert_mlp = experts.dense_expert_mlp
    try:
        yield
    finally:
        experts.grouped_expert_mlp = grouped


def make_train_step(
    config: DiffusionGemmaConfig,
    optimizer: optax.GradientTransformation,
    self_conditioning_p: float,
    encoder_loss_weight: float,
    batch_size: int,
):
    """A jitted (state, pool, rng) -> (state, loss parts); state = {params, opt_state, step}.
    Each step scores batch_size examples drawn uniformly from the pool (encode_pool's arrays)
    with rng."""

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict[str, Any], pool: tuple[jax.Array, ...], rng: jax.Array):
        draw_key, rng = jax.random.split(rng)
        rows = jax.random.randint(draw_key, (batch_size,), 0, pool[0].shape[0])
        batch = tuple(array[rows] for array in pool)
        loss = functools.partial(
            block_diffusion_loss,
            config,
            batch=batch,
            rng=rng,
            self_conditioning_p=self_conditioning_p,
            encoder_loss_weight=encoder_loss_weight,
        )
        (_, parts), grads = jax.value_and_grad(loss, has_aux=True)(state["params"])
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, parts

    return train_step


# ----------------------------------------------------------------------------- held-out metric


def answer_text(tokenizer: PreTrainedTokenizerBase, generated: np.ndarray, end_ids: Sequence[int]) -> str:
    """The text of one row's generated ids, cut before its first end id (EOS or end of turn)."""
    ends = np.flatnonzero(np.isin(generated, list(end_ids)))
    cut = generated[: ends[0]] if ends.size else generated
    return tokenizer.decode(cut.tolist(), skip_special_tokens=True)


def left_padded_prompts(tokenizer: PreTrainedTokenizerBase, questions: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """Chat-formatted prompts, left-padded to the longest: (ids int32 [B, P], valid bool [B, P])."""
    rows = [prompt_ids(tokenizer, q) for q in questions]
    width = max(map(len, rows))
    ids = np.full((len(rows), width), tokenizer.pad_token_id, np.int32)
    valid = np.zeros((len(rows), width), bool)
    for b, row in enumerate(rows):
        ids[b, width - len(row) :] = row
        valid[b, width - len(row) :] = True
    return ids, valid


def held_out_accuracy(
    config: DiffusionGemmaConfig,
    params: dg.Weights,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[tiny_tasks.Problem],
    settings: DenoiseSettings = GENERATION,
    *,
    seed: int = 0,
    batch_size: int = 128,
) -> dict[str, float]:
    """Exact-match accuracy, overall and per task, of the reference generation
    (tests/diffusion_gemma_reference.py, transformers' generate as a host loop) over left-padded
    batches of held-out prompts, MAX_CANVASES canvases at most."""
    # the reference generation lives with the tests until the engine runs this family
    from tests.diffusion_gemma_reference import generate

    correct: dict[str, list[bool]] = {}
    for start in range(0, len(problems), batch_size):
        chunk = problems[start : start + batch_size]
        ids, valid = left_padded_prompts(tokenizer, [p.prompt for p in chunk])
        out = generate(
            config,
            params,
            ids,
            jax.random.key(seed + start),
            max_new_tokens=MAX_CANVASES * CANVAS_LENGTH,
            settings=settings,
            pad_token_id=config.pad_token_id,
            prompt_valid=valid,
        )
        for problem, row in zip(chunk, out.sequences[:, ids.shape[1] :]):
            text = answer_text(tokenizer, row, config.eos_token_ids)
            correct.setdefault(problem.task, []).append(tiny_tasks.is_correct(problem, text))
    result = {task: float(np.mean(oks)) for task, oks in sorted(correct.items())}
    result["all"] = float(np.mean([ok for oks in correct.values() for ok in oks]))
    return result


# ----------------------------------------------------------------------------- export


def export(
    out_dir: Path, config: DiffusionGemmaConfig, params: dg.Weights, tokenizer_dir: Path, settings: DenoiseSettings
) -> Path:
    """Writes the Hugging Face folder (config.json, model.safetensors, generation_config.json,
    the tokenizer files); it appears complete or not at all."""
    from transformers import DiffusionGemmaGenerationConfig
    from transformers.models.diffusion_gemma.generation_diffusion_gemma import EntropyBoundSamplerConfig

    if out_dir.exists():
        raise FileExistsError(f"{out_dir}: output folder already exists")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        folder = save_hf_checkpoint(
            staging / "model",
            config,
            jax.device_get(params),
            tokenizer_dir=tokenizer_dir,
            extra_config={"vision_config": SMALLEST_VISION_CONFIG},
        )
        DiffusionGemmaGenerationConfig(
            max_new_tokens=MAX_CANVASES * CANVAS_LENGTH,
            max_denoising_steps=settings.max_denoising_steps,
            t_min=settings.t_min,
            t_max=settings.t_max,
            sampler_config=EntropyBoundSamplerConfig(entropy_bound=settings.entropy_bound),
            stability_threshold=settings.stability_threshold,
            confidence_threshold=settings.confidence_threshold,
            bos_token_id=config.bos_token_id,
            pad_token_id=config.pad_token_id,
            eos_token_id=list(config.eos_token_ids),
        ).save_pretrained(str(folder))
        os.rename(folder, out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


# ----------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=_positive_int, required=True, help="total optimizer steps")
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--out", type=Path, required=True, help="run folder: checkpoints, tokenizer, run.json")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-model", type=_positive_int, default=128)
    parser.add_argument("--n-layers", type=_positive_int, default=3, help="every third layer is full (and the last)")
    parser.add_argument("--n-heads", type=_positive_int, default=4)
    parser.add_argument("--head-dim", type=_positive_int, default=32, help="sliding layers' (full layers: twice)")
    parser.add_argument("--mlp-hidden", type=_positive_int, default=128, help="the dense MLP and self-conditioning")
    parser.add_argument("--n-experts", type=_positive_int, default=4)
    parser.add_argument("--top-k", type=_positive_int, default=2)
    parser.add_argument("--expert-hidden", type=_positive_int, default=64)
    parser.add_argument("--sliding-window", type=_positive_int, default=16)
    parser.add_argument("--lr", type=_positive_float, default=2e-3)
    parser.add_argument("--warmup", type=_positive_int, default=100)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--mix", type=_parse_mix, default=None, help="task weights, e.g. arith=2,sort=1")
    parser.add_argument("--self-conditioning-p", type=float, default=0.5)
    parser.add_argument("--encoder-loss-weight", type=float, default=1.0)
    parser.add_argument("--eval-every", type=_positive_int, default=500)
    parser.add_argument("--eval-problems", type=_positive_int, default=64)
    parser.add_argument("--final-eval-problems", type=_positive_int, default=256)
    parser.add_argument("--ckpt-every", type=_positive_int, default=250)
    parser.add_argument(
        "--pool-size",
        type=_positive_int,
        default=128 * POOL_CHUNK,
        help=f"training examples, a multiple of {POOL_CHUNK}",
    )
    parser.add_argument("--workers", type=_positive_int, default=1, help="processes that encode the pool")
    parser.add_argument(
        "--time-limit", type=_positive_float, default=None, help="seconds of training after which it stops early"
    )
    parser.add_argument("--export", type=Path, default=None, help="after training, write the HF folder here")
    return parser


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in _RUN_KEYS}


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt_dir: Path) -> None:
    """Refuses contradictory input (exit 2) before any work is done."""
    if not 0 <= args.self_conditioning_p <= 1:
        parser.error(f"--self-conditioning-p {args.self_conditioning_p}: expected a probability in [0, 1]")
    if args.pool_size % POOL_CHUNK:
        parser.error(f"--pool-size {args.pool_size}: expected a multiple of {POOL_CHUNK}")
    if args.encoder_loss_weight < 0:
        parser.error(f"--encoder-loss-weight {args.encoder_loss_weight}: expected >= 0")
    check_run_folder(parser, args, ckpt_dir, _run_settings(args))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ckpt_dir = (args.out / "checkpoints").absolute()
    _check_args(parser, args, ckpt_dir)
    with dense_experts():
        return train(parser, args, ckpt_dir)


def train(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt_dir: Path) -> int:
    """The training run of checked arguments: checkpoints, held-out checks, the final report
    (final_eval.json in --out) and the export."""
    tokenizer = build_tiny_tokenizer(MAX_POSITIONS, FAMILY)
    try:
        config = tiny_model_config(
            tokenizer,
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            head_dim=args.head_dim,
            mlp_hidden=args.mlp_hidden,
            n_experts=args.n_experts,
            top_k=args.top_k,
            expert_hidden=args.expert_hidden,
            sliding_window=args.sliding_window,
        )
    except ConfigError as e:
        parser.error(str(e))

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = save_tiny_tokenizer(args.out / "tokenizer", MAX_POSITIONS, FAMILY)
    write_text_atomically(args.out / "run.json", json.dumps(_run_settings(args), indent=2))

    optimizer = make_optimizer(args.lr, args.warmup, args.steps, args.weight_decay)
    params = dg.init_params(config, jax.random.key(args.seed))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    if args.resume and manager.latest_step() is not None:
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    start = int(state["step"])
    print(
        f"model: {dg.count_params(state['params']):,} parameters "
        f"({dg.active_params_per_token(config, state['params']):,} active per token; {config.layer_types=}, "
        f"{config.d_model=}, {config.n_experts=}, {config.top_k_experts=}); steps {start}..{args.steps}",
        flush=True,
    )

    encoding = time.time()
    pool = jax.device_put(encode_pool(args.pool_size, args.seed, args.mix, args.workers))
    print(f"pool: {args.pool_size:,} examples encoded in {time.time() - encoding:.1f} s", flush=True)
    train_step = make_train_step(config, optimizer, args.self_conditioning_p, args.encoder_loss_weight, args.batch_size)
    base_key = jax.random.key(args.seed)
    held_out = tiny_tasks.held_out_problems(args.eval_problems, mix=args.mix)
    started = time.time()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, mininterval=10.0, file=sys.stdout)
    for step in bar:
        # Each step's batch and noise depend only on (seed, step), so a resumed run replays exactly.
        state, parts = train_step(state, pool, jax.random.fold_in(base_key, step))
        done = step + 1
        out_of_time = args.time_limit is not None and time.time() - started > args.time_limit
        last = done == args.steps or out_of_time
        if done % 100 == 0 or last:
            bar.set_postfix({k: f"{float(v):.4f}" for k, v in parts.items()}, refresh=False)
        if done % args.ckpt_every == 0 or last:
            manager.save(done, args=ocp.args.StandardSave(state))
        if out_of_time:
            bar.write(f"step {done}: --time-limit {args.time_limit} s reached, training stops")
            break
        if done % args.eval_every == 0 or done == args.steps:
            acc = held_out_accuracy(config, state["params"], tokenizer, held_out)
            bar.write(
                f"step {done}: "
                + ", ".join(f"{k} {float(v):.4f}" for k, v in parts.items())
                + "; held-out exact match "
                + ", ".join(f"{k} {v:.3f}" for k, v in acc.items())
                + f" ({len(held_out)} problems), {time.time() - started:.0f} s"
            )
    bar.close()
    manager.wait_until_finished()
    trained_s = time.time() - started
    if args.export is not None:  # before the final check, which takes a while on a CPU
        export(args.export, config, state["params"], tokenizer_dir, GENERATION)
        print(f"exported {args.export}", flush=True)

    final_problems = tiny_tasks.held_out_problems(args.final_eval_problems, mix=args.mix)
    acc = held_out_accuracy(config, state["params"], tokenizer, final_problems)
    report = {
        "step": int(state["step"]),
        "held_out_problems": len(final_problems),
        "exact_match": acc,
        "generation": GENERATION.__dict__,
        "train_seconds_this_run": round(trained_s),
        "run": _run_settings(args),
    }
    write_text_atomically(args.out / "final_eval.json", json.dumps(report, indent=2))
    print(f"final held-out exact match ({len(final_problems)} problems): {acc}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
