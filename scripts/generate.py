"""Kept for existing commands: the CLI is dllm_jax/cli/generate.py, installed as `dllm-generate`."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dllm_jax.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
