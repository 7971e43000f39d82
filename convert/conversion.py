"""Convert a Hugging Face LLaDA, Dream or DiffusionGemma checkpoint into a dllm_jax checkpoint folder (layout in
dllm_jax/checkpoint/converted.py), in this process.

``convert_checkpoint`` is the library entry point. The command line (convert/hf_to_jax.py)
runs ``write_converted`` in a child process instead (``python -m convert.conversion``, not a
user command) because a signal that interrupts an orbax save here leaves orbax's and
TensorStore's writer threads running: they recreate files in the temporary folder after it
was removed. A child can be killed outright, and once it is gone nothing writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from convert.output_folder import check_output_folder, make_temporary, publish, remove
from dllm_jax.common.platform import PlatformError, start_backend
from dllm_jax.models.checkpoint.converted import PARAMS_DIR, move_to_jax, root_cause, save_params, write_metadata
from dllm_jax.models.checkpoint.dtypes import DTYPES, QUANTIZATIONS
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.generation_config import GENERATION_CONFIG_FILE
from dllm_jax.models.checkpoint.hf_reader import read_checkpoint, read_config
from dllm_jax.models.config import ModelConfig
from dllm_jax.models.model_source import load_tokenizer
from dllm_jax.models.quantization import quantize_params
from dllm_jax.runtime.memory_estimate import host_memory
from dllm_jax.runtime.weights_memory import available_host_memory, host_bytes_to_read, weight_bytes
from dllm_jax.sampling.generation_defaults import GenerationDefaults
from dllm_jax.text.tokenizer import TOKENIZER_FILES, TokenizerError

# Room for the metadata and tokenizer files beside the params.
_SLACK_BYTES = 64 * 2**20


def convert_checkpoint(
    hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16", quantization: str = "none"
) -> Path:
    """Converts ``hf_dir`` into the new folder ``out_dir`` and returns its absolute path.

    Args:
      hf_dir: Hugging Face LLaDA, Dream or DiffusionGemma folder (config.json, model.safetensors or shards + index,
        optional tokenizer files and generation_config.json, copied as they are).
      out_dir: folder to create (relative paths are fine); it must not exist or be an empty
        folder, in an existing writable folder. Checked before anything is read.
      dtype: dtype of the stored params; every tensor (F16, BF16 or F32) is cast to it.
      quantization: "none", or store the block projections (and DiffusionGemma's experts) as
        8-bit weights with per-channel scales and an untied embedding as int8 with per-row
        scales ("fp8", "int8-weights"; dllm_jax.models.quantization): about half the size.
    Raises:
      ConversionError naming the file / tensor for any bad input, or ``out_dir`` for a write
      failure; nothing is left on disk (on KeyboardInterrupt too, as far as orbax's writer
      threads allow: see the module docstring).
    """
    out = check_output_folder(out_dir)
    tmp = make_temporary(out, out_dir)
    try:
        write_converted(hf_dir, tmp, dtype=dtype, quantization=quantization, label=out_dir)
        publish(tmp, out, out_dir)
    except BaseException:
        remove(tmp)
        raise
    return out


def write_converted(
    hf_dir: str | Path, folder: Path, *, dtype: str, label: str | Path, quantization: str = "none"
) -> None:
    """Reads ``hf_dir`` and writes the converted checkpoint into the existing empty ``folder``.

    label: the output path as the user gave it; write errors name it instead of ``folder``.
    """
    hf_dir = Path(hf_dir)
    if quantization not in QUANTIZATIONS:
        raise ConversionError(f"quantization={quantization!r}: expected one of {', '.join(QUANTIZATIONS)}")
    if not hf_dir.is_dir():
        raise ConversionError(f"{hf_dir}: checkpoint folder not found")
    config, _ = read_config(hf_dir, dtype=dtype)
    config = dataclasses.replace(config, quantization=quantization)
    params_bytes = weight_bytes(config)
    _check_free_space(folder, params_bytes, label)
    _check_host_memory(hf_dir, config)
    check_tokenizer(hf_dir, config)
    GenerationDefaults.of_folder(hf_dir)  # what loading the converted folder will read: checked now
    info, params = read_checkpoint(hf_dir, dtype=dtype)
    params = move_to_jax(quantize_params(params, quantization))
    try:
        save_params(folder / PARAMS_DIR, params)
        for name in (*TOKENIZER_FILES, GENERATION_CONFIG_FILE):
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, folder / name)
        write_metadata(
            folder,
            hf_config=info.hf_config,
            dtype=dtype,
            tensor_count=info.tensor_count,
            source=info.source,
            quantization=quantization,
        )
    except Exception as e:  # OSError, and orbax / TensorStore errors of many types
        reason = root_cause(e).replace(str(folder.absolute()), str(label)).replace(str(folder), str(label))
        raise ConversionError(f"{label}: cannot write the checkpoint ({reason})") from None


def check_tokenizer(hf_dir: Path, config: ModelConfig) -> None:
    """The tokenizer files the converted folder will hold load as loading will load them: a
    tokenizer.json that parses, its special tokens, a chat template that compiles, and its end
    and mask tokens within the model's vocabulary. A folder without tokenizer files converts
    (the result takes token ids only; the command lines need text and refuse it).

    Raises:
      ConversionError naming the file and the problem.
    """
    try:
        tokenizer = load_tokenizer(hf_dir)
    except TokenizerError as e:
        raise ConversionError(str(e)) from None
    if tokenizer is None:
        return
    for name, token_id in (("end", tokenizer.eos_id), ("mask", tokenizer.mask_id)):
        if token_id is not None and not 0 <= token_id < config.vocab_size:
            raise ConversionError(
                f"{hf_dir}: the tokenizer's {name} token has id {token_id}, outside the model's "
                f"vocab_size={config.vocab_size} (config.json)"
            )


def _check_free_space(folder: Path, params_bytes: int, label: str | Path) -> None:
    free = shutil.disk_usage(folder).free
    if free < params_bytes + _SLACK_BYTES:
        raise ConversionError(
            f"{label}: the converted params need {params_bytes / 1e9:.2f} GB, "
            f"its file system has {free / 1e9:.2f} GB free"
        )


def _check_host_memory(hf_dir: Path, config: ModelConfig) -> None:
    """The reader builds the whole params tree in host memory, and moving it to jax arrays
    needs one more leaf at a time (BENCHMARKS.md: peak = params + about the largest leaf).
    $DLLM_MEMORY_AVAILABLE, when set, is the memory assumed available."""
    needed = host_bytes_to_read(config)
    memory = available_host_memory(host_memory)
    if needed > memory.available:
        raise ConversionError(
            f"{hf_dir}: converting to {config.dtype} needs about {needed / 1e9:.2f} GB of memory, "
            f"{memory.name} has {memory.available / 1e9:.2f} GB available"
        )


def worker_main(argv: Sequence[str] | None = None) -> int:
    """The child process of the command line: write_converted into ``--into``.

    Exit status 0 when done; 2 with the ConversionError's message as the last line of stdout.
    """
    parser = argparse.ArgumentParser(prog="python -m convert.conversion")
    parser.add_argument("--hf-dir", required=True)
    parser.add_argument("--into", required=True, type=Path, help="existing empty folder to write into")
    parser.add_argument("--label", required=True, help="the output path to name in errors")
    parser.add_argument("--dtype", required=True, choices=DTYPES)
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS)
    # blocked by the parent while it started this process (convert/hf_to_jax.py)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    args = parser.parse_args(argv)
    try:
        start_backend()
        write_converted(args.hf_dir, args.into, dtype=args.dtype, quantization=args.quantization, label=args.label)
    except (ConversionError, PlatformError) as e:
        print(e, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(worker_main())
