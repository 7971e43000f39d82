"""dllm-convert: a Hugging Face LLaDA, Dream or DiffusionGemma checkpoint into a dllm_jax checkpoint, once.

  dllm-convert --hf-dir PATH --out PATH [--dtype bfloat16]     # or: python -m convert.hf_to_jax

Reads config.json and the safetensors shards (streamed, see dllm_jax/checkpoint/hf_reader.py), writes the
params as an orbax checkpoint with a metadata file, the tokenizer files and generation_config.json (layout in
dllm_jax/checkpoint/converted.py). ``--out`` is checked before anything is read; the output is built in a
temporary sibling folder, renamed at the end, and removed on any error and on SIGINT, SIGTERM
or SIGHUP at any point: the conversion runs in a child process (convert/conversion.py says
why) that is killed before the folder is removed.

On success it prints one line: what it wrote (tensors, dtype, quantization, size on disk, the
time it took). Exit status: 0 done; 2 bad input or a write error (one line naming the file, tensor or
``--out``); 1 the conversion process died (e.g. out of memory); 128 + N on signal N
(130 for Ctrl-C), after one line.

This module imports no jax, so the command reacts to signals from its first moment.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import convert
from convert.output_folder import check_output_folder, make_temporary, publish, remove
from dllm_jax.models.checkpoint.dtypes import DTYPES, QUANTIZATIONS
from dllm_jax.models.checkpoint.errors import ConversionError
from dllm_jax.models.checkpoint.metadata import METADATA_FILE
from dllm_jax.text.tokenizer import has_tokenizer_files

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP arrived; ``signum`` says which."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class ConversionProcessError(RuntimeError):
    """The child process ended without a result (killed, or a crash with a traceback)."""


@contextlib.contextmanager
def _signals_raise() -> Iterator[None]:
    """Within the block SIGINT, SIGTERM and SIGHUP raise Interrupted (signals that were ignored,
    e.g. SIGHUP under nohup, stay ignored); the previous handlers come back afterwards."""

    def handler(signum, frame):
        raise Interrupted(signum)

    previous = {}
    try:
        for sig in _SIGNALS:
            if signal.getsignal(sig) is not signal.SIG_IGN:
                previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: signals are the caller's business
        pass
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT, SIGTERM and SIGHUP wait until the block is done (then raise as usual), so a step
    and the bookkeeping of its result (a folder created and remembered, a child started and
    watched, a rename and its flag) happen together or not at all."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _run_conversion_process(hf_dir: str, into: Path, *, dtype: str, quantization: str, label: str) -> None:
    """Runs ``python -m convert.conversion`` writing into ``into`` and waits for it.

    The child is in its own session, so the terminal's Ctrl-C and hang-up reach only this
    process, which kills the child (SIGKILL: nothing of it survives to write) on any exception.
    Raises ConversionError with the child's message (exit status 2), ConversionProcessError
    for any other end.
    """
    env = dict(os.environ)
    package_root = str(Path(convert.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    command = [
        sys.executable,
        "-m",
        "convert.conversion",
        "--hf-dir",
        hf_dir,
        "--into",
        str(into),
        "--label",
        label,
        "--dtype",
        dtype,
        "--quantization",
        quantization,
    ]
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        # the child inherits the blocked signals; convert.conversion unblocks them
        child = subprocess.Popen(
            command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True, env=env, start_new_session=True
        )
    except BaseException:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        raise
    try:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)  # a signal pending since Popen raises here
        report, _ = child.communicate()
    except BaseException:
        with _signals_deferred():  # a second Ctrl-C must not skip the wait for the child's end
            child.kill()
            child.wait()
        raise
    message = " ".join(line.strip() for line in report.strip().splitlines())
    if child.returncode == 2 and message:
        raise ConversionError(message)
    if child.returncode != 0:
        ended = (
            f"was killed by {signal.Signals(-child.returncode).name}"
            if child.returncode < 0
            else f"failed with exit status {child.returncode}"
        )
        raise ConversionProcessError(
            f"the conversion process {ended}{' (out of memory?)' if child.returncode == -9 else ''}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (see the module docstring)."""
    parser = argparse.ArgumentParser(
        prog="dllm-convert",
        description="Convert a Hugging Face LLaDA or Dream checkpoint (safetensors) into a dllm_jax checkpoint (orbax).",
    )
    parser.add_argument("--hf-dir", required=True, help="Hugging Face checkpoint folder")
    parser.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the stored params")
    parser.add_argument(
        "--quantization",
        default="none",
        choices=QUANTIZATIONS,
        help="store the block projections (and DiffusionGemma's experts) as 8-bit weights with per-channel "
        "scales and an untied embedding as int8 with per-row scales (about half the size)",
    )
    args = parser.parse_args(argv)
    started = time.monotonic()
    tmp, published = None, False
    with _signals_raise():
        try:
            out = check_output_folder(args.out)
            try:
                with _signals_deferred():
                    tmp = make_temporary(out, args.out)
                _run_conversion_process(
                    args.hf_dir, tmp, dtype=args.dtype, quantization=args.quantization, label=args.out
                )
                with _signals_deferred():
                    publish(tmp, out, args.out)
                    published = True
            except BaseException:
                if tmp is not None and not published:
                    with _signals_deferred():  # nor the removal
                        remove(tmp)
                raise
        except ConversionError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        except ConversionProcessError as e:
            print(f"error: {e}; nothing was written to {args.out}", file=sys.stderr)
            return 1
        except KeyboardInterrupt as e:
            signum = e.signum if isinstance(e, Interrupted) else signal.SIGINT
            done = f"{args.out} was written" if published else f"nothing was written to {args.out}"
            print(f"interrupted by {signal.Signals(signum).name}: {done}", file=sys.stderr)
            return 128 + signum
    print(f"wrote {args.out}: {_summary(out)} in {time.monotonic() - started:.1f} s")
    return 0


def _summary(folder: Path) -> str:
    """What a converted folder holds, e.g. "291 tensors, bfloat16, 16.03 GB, with the tokenizer"
    (its metadata file says the first two; the size is of every file in it)."""
    metadata = json.loads((folder / METADATA_FILE).read_text())
    size = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
    quantized = "" if metadata.get("quantization", "none") == "none" else f" ({metadata['quantization']} weights)"
    tokenizer = "with the tokenizer" if has_tokenizer_files(folder) else "no tokenizer files (token ids only)"
    return f"{metadata['tensor_count']} tensors, {metadata['dtype']}{quantized}, {_bytes(size)}, {tokenizer}"


def _bytes(size: int) -> str:
    return f"{size / 1e9:.2f} GB" if size >= 1e9 else f"{size / 1e6:.1f} MB"


if __name__ == "__main__":
    sys.exit(main())
