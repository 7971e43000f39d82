"""Train an embedded tiny model (tiny-llada, or with --family dream tiny-dream) on the
synthetic tasks of dllm_jax.evaluation.tiny_tasks.

The objective is LLaDA's supervised fine-tuning loss (Dream trains with the same loss, its
predictions read from the output row before each position). Every training sequence is
SEQ_LEN tokens: the chat-formatted prompt, the answer, the turn end (``<|eot_id|>``; Dream:
``<|im_end|>``), then ``<|endoftext|>`` up to the end. Per sequence a mask ratio t ~ U(0, 1) is drawn; every position after the prompt
(answer and EOS padding alike) is replaced by ``<|mdm_mask|>`` with probability t; the loss is
the cross-entropy on the masked positions weighted by 1/t, divided by the sequence's answer
length, averaged over the batch. The prompt is never masked.

Example (CPU, about 1.5 hours on two cores):

  PYTHONPATH=. nice -n 19 python scripts/train_tiny.py --steps 3000 --out out/tiny \\
      --export dllm_jax/assets/tiny-llada
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from collections.abc import Sequence
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
from dllm_jax.engine.engine import Engine
from dllm_jax.evaluation import tiny_tasks
from dllm_jax.models.config import ConfigError, ModelConfig
from dllm_jax.models.transformer import Weights, count_params, forward, init_params, predictions
from dllm_jax.runtime.decode_config import DecodeConfig
from dllm_jax.text.tiny_tokenizer import END_OF_TURN, TINY_VOCAB_SIZE, build_tiny_tokenizer, save_tiny_tokenizer
from dllm_jax.text.tokenizer import Tokenizer

# The engine lets every request attend to keys up to the next multiple of 128 (an EOS tail after
# the canvas), so every position below 128 must be one the model was trained on.
SEQ_LEN = 128
MASK_EPS = 1e-3
# Settings that must be the same when a run is resumed (the others may change).
_RUN_KEYS = (
    "seed",
    "batch_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "mlp_hidden",
    "lr",
    "warmup",
    "weight_decay",
    "mix",
    "family",
)


# ----------------------------------------------------------------------------- data


def prompt_ids(tokenizer: PreTrainedTokenizerBase, question: str) -> list[int]:
    """The chat-formatted single user turn, ending with the open assistant header."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def encode_training_batch(
    tokenizer: PreTrainedTokenizerBase, problems: Sequence[tiny_tasks.Problem], seq_len: int = SEQ_LEN
) -> tuple[np.ndarray, np.ndarray]:
    """Problems -> (tokens int32 [B, seq_len], prompt_len int32 [B]).

    Row b is prompt, answer, the turn end, then EOS up to seq_len (the LLaDA SFT layout).
    """
    eot = _end_of_turn(tokenizer)
    tokens = np.full((len(problems), seq_len), tokenizer.eos_token_id, dtype=np.int32)
    prompt_len = np.zeros(len(problems), dtype=np.int32)
    for b, problem in enumerate(problems):
        ids = prompt_ids(tokenizer, problem.prompt)
        full = ids + tokenizer(problem.answer, add_special_tokens=False)["input_ids"] + [eot]
        if len(full) > seq_len:
            raise ValueError(f"{problem.prompt!r}: {len(full)} tokens do not fit in seq_len={seq_len}")
        tokens[b, : len(full)] = full
        prompt_len[b] = len(ids)
    return tokens, prompt_len


def _end_of_turn(tokenizer: PreTrainedTokenizerBase) -> int:
    """Id of the family's turn end (<|eot_id|> or <|im_end|>), whichever the tokenizer has."""
    for token in END_OF_TURN.values():
        if token in tokenizer.get_vocab():
            return tokenizer.convert_tokens_to_ids(token)
    raise ValueError(f"the tokenizer has none of the turn ends {sorted(END_OF_TURN.values())}")


# ----------------------------------------------------------------------------- model and loss


def tiny_model_config(
    tokenizer: PreTrainedTokenizerBase,
    d_model: int,
    n_layers: int,
    n_heads: int,
    mlp_hidden: int,
    family: str = "llada",
    n_kv_heads: int | None = None,
) -> ModelConfig:
    """The tiny model's architecture (float32 for training): LLaDA's, or Dream's (q/k/v biases,
    grouped-query attention, shifted logits)."""
    dream = family == "dream"
    return ModelConfig(
        family=family,
        qkv_bias=dream,
        rms_norm_eps=1e-6 if dream else 1e-5,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads or n_heads,
        mlp_hidden_size=mlp_hidden,
        vocab_size=TINY_VOCAB_SIZE,
        rope_theta=10000.0,
        mask_token_id=tokenizer.mask_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        max_sequence_length=SEQ_LEN,
        dtype="float32",
    )


def corrupt(tokens: jax.Array, prompt_len: jax.Array, mask_id: int, rng: jax.Array):
    """The forward (masking) process of one batch.

    Args:
      tokens: int32 [B, T] clean sequences; prompt_len: int32 [B].
      rng: key for the mask ratios and the masks.
    Returns:
      noisy: int32 [B, T], each answer position (answer, <|eot_id|>, EOS padding) replaced by
        mask_id with probability p_mask, the prompt untouched;
      masked: bool [B, T], where noisy holds a mask that the loss scores;
      p_mask: float32 [B, 1], (1 - eps) t + eps with t ~ U(0, 1).
    """
    B, T = tokens.shape
    ratio_key, mask_key = jax.random.split(rng)
    p_mask = (1.0 - MASK_EPS) * jax.random.uniform(ratio_key, (B, 1)) + MASK_EPS
    answer = jnp.arange(T)[None, :] >= prompt_len[:, None]
    masked = answer & (jax.random.uniform(mask_key, (B, T)) < p_mask)
    return jnp.where(masked, mask_id, tokens), masked, p_mask


def masked_diffusion_loss(
    config: ModelConfig, params: Weights, tokens: jax.Array, prompt_len: jax.Array, rng: jax.Array
) -> jax.Array:
    """LLaDA SFT loss of one batch (shapes as in corrupt).

    Returns:
      float32 scalar: sum over masked positions of CE / p_mask / answer_len, divided by B.
    """
    noisy, masked, p_mask = corrupt(tokens, prompt_len, config.mask_token_id, rng)
    logits = predictions(config, forward(config, params, noisy)).astype(jnp.float32)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits, tokens)
    answer_len = (tokens.shape[1] - prompt_len)[:, None]
    return jnp.sum(jnp.where(masked, ce / (p_mask * answer_len), 0.0)) / tokens.shape[0]


def make_optimizer(lr: float, warmup: int, total_steps: int, weight_decay: float) -> optax.GradientTransformation:
    """AdamW, linear warm-up then cosine decay to lr/10, gradients clipped at norm 1."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(total_steps, warmup + 1), lr / 10)
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(schedule, b2=0.99, weight_decay=weight_decay))


def make_train_step(config: ModelConfig, optimizer: optax.GradientTransformation):
    """A jitted (state, tokens, prompt_len, rng) -> (state, loss); state = {params, opt_state, step}."""

    @functools.partial(jax.jit, donate_argnums=0)
    def train_step(state: dict[str, Any], tokens: jax.Array, prompt_len: jax.Array, rng: jax.Array):
        loss, grads = jax.value_and_grad(masked_diffusion_loss, argnums=1)(
            config, state["params"], tokens, prompt_len, rng
        )
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        return {"params": params, "opt_state": opt_state, "step": state["step"] + 1}, loss

    return train_step


# ----------------------------------------------------------------------------- held-out metric


def held_out_accuracy(
    engine: Engine, problems: Sequence[tiny_tasks.Problem], gen_len: int, batch_size: int = 64
) -> dict[str, float]:
    """Exact-match accuracy of one-token-per-step decoding (LLaDA's sampler over one block of
    gen_len positions: each step commits the most confident masked position), overall and per
    task, decoded and scored as scripts/eval.py does (the engine holds the current weights:
    Engine.swap_weights)."""
    decode = DecodeConfig(
        method="llada", gen_length=gen_len, block_length=gen_len, steps=gen_len, batch_size=batch_size
    )
    out = engine.generate([p.prompt for p in problems], decode_config=decode, chat=True)
    correct: dict[str, list[bool]] = {}
    for problem, result in zip(problems, out.results):
        correct.setdefault(problem.task, []).append(tiny_tasks.is_correct(problem, result.text))
    result = {task: float(np.mean(oks)) for task, oks in sorted(correct.items())}
    result["all"] = float(np.mean([ok for oks in correct.values() for ok in oks]))
    return result


# ----------------------------------------------------------------------------- command line


def _parse_mix(text: str) -> dict[str, float]:
    mix = {}
    for item in text.split(","):
        name, sep, weight = item.partition("=")
        try:
            mix[name.strip()] = float(weight)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r}: expected task=weight") from None
        if not sep or name.strip() not in tiny_tasks.TASKS or mix[name.strip()] < 0:
            raise argparse.ArgumentTypeError(f"{item!r}: expected task=weight with a task of {tiny_tasks.TASKS}")
    if sum(mix.values()) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: weights are all zero")
    return mix


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--steps",
        type=_positive_int,
        required=True,
        help="total optimizer steps, where the cosine decay ends (--resume with more extends a run)",
    )
    parser.add_argument("--batch-size", type=_positive_int, default=64)
    parser.add_argument("--out", type=Path, required=True, help="run folder: checkpoints, tokenizer, run.json")
    parser.add_argument("--resume", action="store_true", help="continue from the latest checkpoint in --out")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--d-model", type=_positive_int, default=128)
    parser.add_argument("--n-layers", type=_positive_int, default=4)
    parser.add_argument("--n-heads", type=_positive_int, default=4)
    parser.add_argument(
        "--n-kv-heads",
        type=_positive_int,
        default=None,
        help="key/value heads (default: --n-heads; fewer = grouped-query attention)",
    )
    parser.add_argument(
        "--family",
        choices=("llada", "dream"),
        default="llada",
        help="architecture, tokenizer and chat template of the model",
    )
    parser.add_argument("--mlp-hidden", type=_positive_int, default=384)
    parser.add_argument("--lr", type=_positive_float, default=2e-3)
    parser.add_argument("--warmup", type=_positive_int, default=200)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--mix", type=_parse_mix, default=None, help="task weights, e.g. arith=2,sort=1")
    parser.add_argument("--gen-length", type=_positive_int, default=64, help="canvas of the held-out decoding")
    parser.add_argument("--eval-every", type=_positive_int, default=500)
    parser.add_argument("--eval-problems", type=_positive_int, default=64)
    parser.add_argument("--final-eval-problems", type=_positive_int, default=512)
    parser.add_argument("--ckpt-every", type=_positive_int, default=250)
    parser.add_argument(
        "--export",
        type=Path,
        default=None,
        help="after training, write the Hugging Face LLaDA (or Dream) folder here (must not exist)",
    )
    return parser


def _run_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {key: getattr(args, key) for key in _RUN_KEYS}


def _check_args(parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt_dir: Path) -> None:
    """Refuses contradictory input (exit 2) before any work is done."""
    check_run_folder(parser, args, ckpt_dir, _run_settings(args))


def check_run_folder(
    parser: argparse.ArgumentParser, args: argparse.Namespace, ckpt_dir: Path, settings: dict[str, Any]
) -> None:
    """A trainer's --out, --resume and --export (exit 2 through `parser`): a resumed run needs its
    run.json with the same `settings`, a new one an --out without checkpoints, and --export a new
    path. Shared by scripts/train_tiny_diffusion_gemma.py."""
    run_file = args.out / "run.json"
    if args.resume:
        if not run_file.is_file():
            parser.error(f"--resume: {run_file} not found (no run to resume in {args.out})")
        saved = json.loads(run_file.read_text())
        changed = {k: (saved.get(k), v) for k, v in settings.items() if saved.get(k) != v}
        if changed:
            parser.error(f"--resume: settings differ from the saved run (saved, given): {changed}")
    elif ckpt_dir.exists() and any(ckpt_dir.iterdir()):
        parser.error(f"{args.out} already holds checkpoints; pass --resume or choose another --out")
    if args.export is not None and args.export.exists():
        parser.error(f"--export {args.export} already exists")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    ckpt_dir = (args.out / "checkpoints").absolute()
    _check_args(parser, args, ckpt_dir)
    tokenizer = build_tiny_tokenizer(SEQ_LEN, args.family)
    try:
        config = tiny_model_config(
            tokenizer, args.d_model, args.n_layers, args.n_heads, args.mlp_hidden, args.family, args.n_kv_heads
        )
    except ConfigError as e:
        parser.error(str(e))

    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = save_tiny_tokenizer(args.out / "tokenizer", SEQ_LEN, args.family)
    write_text_atomically(args.out / "run.json", json.dumps(_run_settings(args), indent=2))

    optimizer = make_optimizer(args.lr, args.warmup, args.steps, args.weight_decay)
    params = init_params(config, jax.random.key(args.seed))
    state = {"params": params, "opt_state": optimizer.init(params), "step": jnp.zeros((), jnp.int32)}
    manager = ocp.CheckpointManager(ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=2, create=True))
    if args.resume and manager.latest_step() is not None:
        abstract = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
        state = manager.restore(manager.latest_step(), args=ocp.args.StandardRestore(abstract))
    start = int(state["step"])
    print(
        f"model: {count_params(state['params']):,} parameters ({config.family=}, {config.d_model=}, "
        f"{config.n_layers=}, {config.n_heads=}, {config.n_kv_heads=}, {config.mlp_hidden_size=}); "
        f"steps {start}..{args.steps}",
        flush=True,
    )

    train_step = make_train_step(config, optimizer)
    engine = Engine(config, state["params"], Tokenizer.from_transformers(tokenizer))
    base_key = jax.random.key(args.seed)
    held_out = tiny_tasks.held_out_problems(args.eval_problems, mix=args.mix)
    started = time.time()
    bar = tqdm(range(start, args.steps), initial=start, total=args.steps, mininterval=10.0, file=sys.stdout)
    for step in bar:
        # Each step's data and masks depend only on (seed, step), so a resumed run replays exactly.
        stream = tiny_tasks.problems("train", seed=args.seed * 1_000_000 + step, mix=args.mix)
        tokens, prompt_len = encode_training_batch(tokenizer, [next(stream) for _ in range(args.batch_size)])
        state, loss = train_step(state, tokens, prompt_len, jax.random.fold_in(base_key, step))
        done = step + 1
        if done % 10 == 0 or done == args.steps:
            bar.set_postfix(loss=f"{float(loss):.4f}", refresh=False)
        if done % args.ckpt_every == 0 or done == args.steps:
            manager.save(done, args=ocp.args.StandardSave(state))
        if done % args.eval_every == 0 or done == args.steps:
            engine.swap_weights(state["params"])
            acc = held_out_accuracy(engine, held_out, args.gen_length)
            bar.write(
                f"step {done}: loss {float(loss):.4f}, held-out exact match "
                + ", ".join(f"{k} {v:.3f}" for k, v in acc.items())
                + f" ({len(held_out)} problems), {time.time() - started:.0f} s"
            )
    bar.close()
    manager.wait_until_finished()

    final_problems = tiny_tasks.held_out_problems(args.final_eval_problems, mix=args.mix)
    engine.swap_weights(state["params"])
    acc = held_out_accuracy(engine, final_problems, args.gen_length)
    report = {
        "step": int(state["step"]),
        "held_out_problems": len(final_problems),
        "exact_match": acc,
        "gen_length": args.gen_length,
        "train_seconds_this_run": round(time.time() - started),
    }
    write_text_atomically(args.out / "final_eval.json", json.dumps(report, indent=2))
    print(f"final held-out exact match ({len(final_problems)} problems): {acc}", flush=True)
    if args.export is not None:
        save_hf_checkpoint(args.export, config, jax.device_get(state["params"]), tokenizer_dir=tokenizer_dir)
        print(f"exported {args.export}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
