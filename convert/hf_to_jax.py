"""Convert a Hugging Face LLaDA or Dream checkpoint into a dllm_jax checkpoint, once.

  python -m convert.hf_to_jax --hf-dir PATH --out PATH [--dtype bfloat16]

Reads config.json and the safetensors shards (streamed, see convert/hf_reader.py), writes the
params as an orbax checkpoint with a metadata file and the tokenizer files (layout in
convert/checkpoint.py). The output folder appears complete or not at all: everything is
written into a temporary sibling folder that is renamed at the end and removed on any error.
Bad input exits with status 2 and a one-line message naming the file and tensor.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path

from convert.checkpoint import DTYPES, PARAMS_DIR, move_to_jax, save_params, write_metadata
from convert.errors import ConversionError
from convert.hf_reader import read_checkpoint
from dllm_jax.tokenizer import TOKENIZER_FILES


def convert_checkpoint(hf_dir: str | Path, out_dir: str | Path, *, dtype: str = "bfloat16") -> Path:
    """Converts ``hf_dir`` into the new folder ``out_dir`` and returns it.

    Args:
      hf_dir: Hugging Face LLaDA or Dream folder (config.json, model.safetensors or shards + index,
        optional tokenizer files).
      out_dir: folder to create; it must not exist.
      dtype: dtype of the stored params; every tensor (F16, BF16 or F32) is cast to it.
    Raises:
      ConversionError naming the file / tensor for any bad input; nothing is left on disk.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if out_dir.exists():
        raise ConversionError(f"{out_dir}: output folder already exists")
    info, params = read_checkpoint(hf_dir, dtype=dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    # mkdir (not tempfile.mkdtemp, which makes it private to the user) so the folder gets the umask's mode
    tmp = out_dir.with_name(f".{out_dir.name}.tmp-{secrets.token_hex(4)}")
    tmp.mkdir()
    try:
        save_params(tmp / PARAMS_DIR, move_to_jax(params))
        for name in TOKENIZER_FILES:
            if (hf_dir / name).is_file():
                shutil.copy2(hf_dir / name, tmp / name)
        write_metadata(
            tmp, hf_config=info.hf_config, dtype=dtype, tensor_count=info.tensor_count, source=info.source
        )
        # Checked again: an empty folder created meanwhile would silently be replaced by the rename.
        if out_dir.exists():
            raise ConversionError(f"{out_dir}: output folder appeared during the conversion")
        os.rename(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    """The command line; returns the exit status (0 done, 2 bad input, 1 an OS error such as a full disk)."""
    parser = argparse.ArgumentParser(
        prog="python -m convert.hf_to_jax",
        description="Convert a Hugging Face LLaDA or Dream checkpoint (safetensors) into a dllm_jax checkpoint (orbax).",
    )
    parser.add_argument("--hf-dir", required=True, type=Path, help="Hugging Face checkpoint folder")
    parser.add_argument("--out", required=True, type=Path, help="output folder (must not exist)")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="dtype of the stored params")
    args = parser.parse_args(argv)
    try:
        out = convert_checkpoint(args.hf_dir, args.out, dtype=args.dtype)
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
