"""dllm-generate: answers from a masked diffusion LM, for prompts given as flags or in a JSONL file.

  dllm-generate --prompt "sort: 3 9 1 4"                         # the embedded tiny model
  dllm-generate --model PATH --prompts-file q.jsonl --method flash_cache --verify --output a.jsonl
  dllm-generate --model GSAI-ML/LLaDA-8B-Instruct --prompt "Hi"  # a Hub id from the local cache
  dllm-generate --model PATH --prompt "Hi" --mesh data=2,tensor=4

--model: a Hugging Face LLaDA, Dream or DiffusionGemma folder, a converted one (dllm-convert) or a
Hub id in the Hugging Face cache. --prompts-file: JSONL, one object per line with a "prompt" string; the
output line of a request keeps all its fields (e.g. "id") and adds the answer and its counts.
Answers go to stdout, diagnostics to stderr. Everything given is checked before the model
loads; bad input prints one line and exits with status 2, Ctrl-C with 130. A request that
fails while decoding (non-finite logits) is named on stderr and in its output line, and the
run exits with status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dllm_jax.cli import arguments, running
from dllm_jax.cli.output import check_output_path, write_output
from dllm_jax.cli.prompts import PromptRecord, check_reserved, encode_all, from_flags, read_jsonl
from dllm_jax.common.memory_override import memory_override
from dllm_jax.models.checkpoint.dtypes import QUANTIZATIONS
from dllm_jax.models.checkpoint.metadata import is_converted, read_metadata
from dllm_jax.models.model_source import MODEL_HELP, load_tokenizer, read_model_config, resolve_model_path
from dllm_jax.runtime import compile_cache
from dllm_jax.runtime.decode_config import (
    ACCEPT_RULES,
    CACHES,
    DREAM_ALGORITHMS,
    METHODS,
    PIN_POLICIES,
    DecodeConfig,
    default_method,
)
from dllm_jax.sampling.generation_defaults import GENERATION_CONFIG_HELP, GENERATION_CONFIG_MODES, GenerationDefaults
from dllm_jax.sampling.params import SamplingParams

log = logging.getLogger("dllm_jax.cli.generate")

# Largest generation bucket chosen without --gen-length / --max-new-tokens; a model with fewer
# free positions after the longest prompt gets the largest power of two that fits.
DEFAULT_MAX_GEN_LENGTH = 256
# Result fields not written to --output (the prompt's and the answer's token ids).
_UNWRITTEN_RESULT_FIELDS = ("prompt_ids", "token_ids")


def _default(name: str, **decode: Any) -> Any:
    """What DecodeConfig resolves an unset option to (for the help text: one source of truth)."""
    return getattr(DecodeConfig(**decode), name)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dllm-generate", description=__doc__.split("\n\n", 1)[1].rstrip(), formatter_class=arguments.HelpFormatter
    )
    p.add_argument("--model", help=MODEL_HELP)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    source.add_argument("--prompts-file", type=Path, help='JSONL file, one {"prompt": ...} object per line')
    p.add_argument(
        "--output",
        help="write one JSON object per request to this file, at the end: a file is replaced atomically "
        "(keeping its mode; a new one takes the umask's), a device or /dev/stdout is written through; "
        "its folder must exist",
    )
    p.add_argument(
        "--chat",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="apply the tokenizer's chat template to each prompt; default: when the tokenizer has one. "
        "The embedded tiny model was trained on chat-formatted questions, so its default is --chat. "
        "Use --no-chat for prompts that are already templated (as the LLaDA reference code passes them)",
    )

    method = p.add_argument_group("decoding method (what the compiled program does)")
    method.add_argument(
        "--method",
        choices=METHODS,
        help=f"decoding method; default: diffusion_gemma for a DiffusionGemma model, else {_default('method')}",
    )
    method.add_argument(
        "--gen-length",
        type=arguments.int_in(1),
        help="generation bucket: the canvas each request decodes (a smaller one changes the answer; "
        "--max-new-tokens cuts it); default: the largest power of two up to "
        f"{DEFAULT_MAX_GEN_LENGTH} that fits in the model's max_sequence_length after the longest prompt, "
        "or --max-new-tokens rounded up to the block length when that is more",
    )
    method.add_argument(
        "--block-length",
        type=arguments.int_in(1),
        help="block (llada, fast_dllm) or window (flash_cache) length; default: "
        + ", ".join(f"{_default('window', method=m)} ({m})" for m in METHODS if m not in ("dream", "diffusion_gemma"))
        + " (dream: the whole generation is one block; diffusion_gemma: the model's canvas length)",
    )
    method.add_argument(
        "--steps",
        type=arguments.int_in(1),
        help="llada / fast_dllm fixed schedule, dream's timestep schedule: total denoising steps; "
        "default: one token per step",
    )
    method.add_argument(
        "--cache", choices=CACHES, help=f"fast_dllm cache; default: {_default('cache', method='fast_dllm')}"
    )
    method.add_argument(
        "--mask-num",
        type=arguments.int_in(1),
        help=f"flash_cache: masked blocks recomputed per step; default: {_default('mask_num')}",
    )
    method.add_argument(
        "--track-num",
        type=int,
        help=f"flash_cache: tracked blocks per step (<0: refresh all); default: {_default('track_num')}",
    )
    method.add_argument("--verify", action="store_true", help="flash_cache: add Flash-Verify")
    method.add_argument(
        "--accept", choices=ACCEPT_RULES, help=f"verify acceptance rule; default: {_default('accept', verify=True)}"
    )
    method.add_argument(
        "--pin",
        choices=PIN_POLICIES,
        help=f"verify: which commits are refreshed next step; default: {_default('pin', verify=True)}",
    )
    method.add_argument(
        "--alg",
        choices=DREAM_ALGORITHMS,
        help=f"dream: which masked positions a step unmasks; default: {_default('alg', method='dream')}",
    )
    method.add_argument(
        "--eps",
        type=arguments.float_in(0.0, 1.0, low_open=True),
        help=f"dream: end of the timestep schedule, in (0, 1); default: {_default('eps', method='dream')}",
    )
    method.add_argument(
        "--batch-size",
        type=arguments.int_in(1),
        default=_default("batch_size"),
        help="slots decoded together (at most the number of prompts)",
    )

    sampling = p.add_argument_group("sampling (run-time values: changing them never recompiles)")
    sampling.add_argument(
        "--max-new-tokens",
        type=arguments.int_in(1),
        help="the answer's most tokens: it is cut there (finish_reason length), a prefix of the uncut answer; "
        "default: the generation bucket, capped by the model's max_sequence_length minus the prompt",
    )
    sampling.add_argument(
        "--stop",
        action="append",
        type=arguments.non_empty,
        default=[],
        help="a string that ends the answer, cut before it (repeat for several)",
    )
    arguments.add_knob_flags(sampling)
    sampling.add_argument(
        "--generation-config", choices=GENERATION_CONFIG_MODES, default="auto", help=GENERATION_CONFIG_HELP
    )
    sampling.add_argument(
        "--seed",
        type=arguments.seed,
        default=0,
        help=f"random seed, in [0, {arguments.SEED_MAX}]; each request draws its own stream from it",
    )

    run = p.add_argument_group("devices")
    run.add_argument(
        "--backend",
        choices=("auto", "xla", "pallas"),
        default="auto",
        help="per-layer kernels: auto picks what measured fastest on the device",
    )
    run.add_argument(
        "--mesh",
        help='decode over several devices, e.g. "data=2,tensor=2": slots split over data, '
        "heads and MLP over tensor, a DiffusionGemma model's experts over expert and tensor; the sizes "
        "multiply to the number of devices",
    )
    run.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        help="params dtype; default: float32 on the CPU, bfloat16 on accelerators",
    )
    run.add_argument(
        "--quantization",
        choices=QUANTIZATIONS,
        help="8-bit block projections (and DiffusionGemma's experts) and an int8 untied embedding (fp8: W8A8, "
        "int8-weights: weight-only); default: as the checkpoint stores them (none for a Hugging Face folder)",
    )
    run.add_argument(
        "--batch-invariant",
        action="store_true",
        help="answers independent of the batch (and, with XLA's deterministic ops, of the run); slower",
    )
    run.add_argument(
        "--compile-cache",
        metavar="DIR",
        help="keep compiled decode loops in DIR for the next run; default: $DLLM_JAX_COMPILE_CACHE, else "
        f"{compile_cache.default_cache_dir()}",
    )
    run.add_argument(
        "--no-compile-cache",
        action="store_true",
        help="compile everything afresh and store nothing (also: DLLM_JAX_COMPILE_CACHE=off)",
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    running.add_logging_flags(p)
    return p


def decode_options(args: argparse.Namespace) -> dict[str, Any]:
    """The DecodeConfig keyword arguments the user gave (args.method resolved: default_method).
    Unset flags keep DecodeConfig's defaults, so an option of another method is an error only
    when it is given."""
    given = {
        "method": args.method,
        "gen_length": args.gen_length,
        "block_length": args.block_length,
        "steps": args.steps,
        "cache": args.cache,
        "mask_num": args.mask_num,
        "track_num": args.track_num,
        "batch_size": args.batch_size,
        "verify": args.verify or None,
        "accept": args.accept,
        "pin": args.pin,
        "alg": args.alg,
        "eps": args.eps,
        # the llada loop with the unconditional pass; other methods are told by slot_values
        "cfg": (args.cfg_scale > 0 and args.method == "llada") or None,
    }
    return {k: v for k, v in given.items() if v is not None}


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The per-request parameters, the same for every prompt of the run (--seed is the seed each
    request draws its own stream from: Engine.generate's seed)."""
    return SamplingParams(max_new_tokens=args.max_new_tokens, stop=tuple(args.stop), **arguments.knob_values(args))


def default_gen_length(max_sequence_length: int, records: Sequence[PromptRecord], encoded: Sequence[list[int]]) -> int:
    """The largest power of two up to DEFAULT_MAX_GEN_LENGTH that fits after the longest prompt."""
    longest = max(range(len(encoded)), key=lambda i: len(encoded[i]))
    room = min(DEFAULT_MAX_GEN_LENGTH, max_sequence_length - len(encoded[longest]))
    if room < 1:
        raise ValueError(
            f"{records[longest].where}: the prompt has {len(encoded[longest])} tokens, which leaves no room to "
            f"generate within the model's max_sequence_length={max_sequence_length}"
        )
    return 1 << (room.bit_length() - 1)


def generation_bucket(
    args: argparse.Namespace,
    config: Any,
    records: Sequence[PromptRecord],
    encoded: Sequence[list[int]],
    defaults: GenerationDefaults,
) -> int:
    """--gen-length, else default_gen_length, or --max-new-tokens rounded up to the block length
    when that is more: --max-new-tokens cuts the answer, the canvas stays the bucket.
    diffusion_gemma: the whole canvases that hold --max-new-tokens, else the model's
    max_new_tokens (within the positions after the longest prompt), else one."""
    if args.gen_length is not None:
        return args.gen_length
    canvas = getattr(config, "canvas_length", None) if args.method == "diffusion_gemma" else None
    if canvas is not None and args.max_new_tokens is not None:
        return -(-args.max_new_tokens // canvas) * canvas
    if canvas is not None:
        return defaults.canvas_bucket(canvas, config.max_sequence_length - max(len(ids) for ids in encoded))
    default = default_gen_length(config.max_sequence_length, records, encoded)
    if args.max_new_tokens is None or args.max_new_tokens <= default:
        return default
    if args.method == "dream":  # one block of exactly the generation
        return args.max_new_tokens
    block = args.block_length or _default("window", method=args.method)
    return -(-args.max_new_tokens // block) * block


def output_record(record: PromptRecord, result: Any) -> dict[str, Any]:
    """The input line's fields followed by the result's (without the token id lists)."""
    fields = {k: v for k, v in dataclasses.asdict(result).items() if k not in _UNWRITTEN_RESULT_FIELDS}
    return {**record.fields, **fields}


def _output_keys() -> set[str]:
    from dllm_jax.engine.results import GenerationResult

    return {f.name for f in dataclasses.fields(GenerationResult)} - set(_UNWRITTEN_RESULT_FIELDS)


def _main(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    running.setup_logging(args)
    # Everything given is checked first, without JAX (a bad input is reported in well under a second).
    records = from_flags(args.prompt) if args.prompt else read_jsonl(args.prompts_file)
    output_path = check_output_path(args.output) if args.output is not None else None
    sampling = sampling_params(args)
    memory_override()  # a bad $DLLM_MEMORY_AVAILABLE is an input error before the model loads
    cache_dir = compile_cache.cache_dir_setting(args.compile_cache, args.no_compile_cache)
    path = resolve_model_path(args.model)
    # the dtype changes no limit checked here; the weights' own is chosen once JAX runs
    config = read_model_config(path, dtype=args.dtype or "float32")
    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path}: no tokenizer files, so text prompts cannot be encoded")
    if args.chat and not tokenizer.has_chat_template:
        raise ValueError(f"--chat: the tokenizer of {path} has no chat template")
    chat = tokenizer.has_chat_template if args.chat is None else args.chat
    encoded = encode_all(records, lambda text: tokenizer.encode(text, chat=chat))
    defaults = GenerationDefaults.of_folder(path, args.generation_config)
    args.method = args.method or default_method(config)
    options = decode_options(args)
    options["gen_length"] = generation_bucket(args, config, records, encoded, defaults)
    decode_config = DecodeConfig(**options).for_model(config)

    if args.batch_invariant:
        from dllm_jax.runtime.batch_invariance import deterministic_xla_flags

        os.environ["XLA_FLAGS"] = deterministic_xla_flags()  # before JAX starts its backend
    from dllm_jax.common.platform import start_backend

    start_backend()  # an impossible JAX_PLATFORMS is one line here
    compile_cache.enable_compile_cache(cache_dir)
    from dllm_jax.engine.engine import Engine
    from dllm_jax.engine.request import slot_values
    from dllm_jax.models.loading import default_dtype, load_model
    from dllm_jax.runtime import sharding
    from dllm_jax.runtime.weights_memory import check_weights_fit

    check_reserved(records, _output_keys())
    mesh = sharding.parse_mesh(args.mesh) if args.mesh else None
    if mesh is not None:
        sharding.check_model(mesh, config)
        sharding.check_batch(mesh, decode_config.batch_size)  # the engine may use fewer slots, always a multiple
    for i, (record, ids) in enumerate(zip(records, encoded)):  # the engine's per-request checks, before loading
        slot_values(
            sampling,
            len(ids),
            decode_config,
            cfg=decode_config.cfg,
            max_sequence_length=config.max_sequence_length,
            order=i,
            where=record.where,
            defaults=defaults,
        )
    dtype = args.dtype or default_dtype()
    config = dataclasses.replace(config, dtype=dtype)
    converted = is_converted(path)
    # the weights as they will load: quantized as asked, else as a converted folder stores them
    quantization = args.quantization or (read_metadata(path)["quantization"] if converted else None)
    if quantization is not None and hasattr(config, "quantization"):
        config = dataclasses.replace(config, quantization=quantization)
    check_weights_fit(
        config,
        source=str(path),
        read_on_host=not converted,
        tensor=sharding.axis_size(mesh, sharding.TENSOR),
        expert=sharding.axis_size(mesh, sharding.EXPERT),
    )

    log.info("loading %s (%s)", path, dtype)
    loaded = load_model(path, dtype=dtype, quantization=args.quantization)
    engine = Engine(
        loaded.config,
        loaded.weights,
        tokenizer,
        backend=args.backend,
        mesh=mesh,
        batch_invariant=args.batch_invariant,
        generation_defaults=defaults,
    )
    log.info(
        "generating %d request(s): %s, gen_length=%d, chat=%s; defaults of unset values: %s",
        len(encoded),
        decode_config.method,
        decode_config.gen_length,
        chat,
        defaults.describe(),
    )
    output = engine.generate(
        encoded, sampling, decode_config=decode_config, seed=args.seed, progress=not (args.no_progress or args.quiet)
    )
    failed = 0
    for record, result in zip(records, output.results):
        print(f"### [{result.index}] {record.prompt}\n{result.text}\n")
        if result.error is not None:
            failed += 1
            log.error("%s: %s", record.where, result.error)
    s = output.stats
    log.info(
        "%d requests, %d completion tokens (%d as the reference code counts) in %.2f s (%.1f tokens/s; compile %.1f s) "
        "| %.2f tokens/step | %d steps, %d forward passes, %d loop iterations | method=%s backend=%s%s",
        s.num_requests,
        s.completion_tokens,
        s.reference_num_tokens,
        s.wall_seconds,
        s.tokens_per_second,
        s.compile_seconds,
        s.tokens_per_step,
        s.steps,
        s.forward_passes,
        s.iterations,
        decode_config.method,
        engine.backend,
        f" mesh={args.mesh}" if args.mesh else "",
    )
    if output_path is not None:
        lines = [json.dumps(output_record(r, res)) + "\n" for r, res in zip(records, output.results)]
        write_output(output_path, "".join(lines))
        log.info("wrote %s", output_path)
    return running.EXIT_OS_ERROR if failed else running.EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """The console script ``dllm-generate``; returns the exit status (see dllm_jax.cli.running)."""
    return running.run(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
