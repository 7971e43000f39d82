"""Kept for existing commands: the CLI is dllm_jax/cli/generate.py, installed as `dllm-generate`."""

import sys

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

from dllm_jax.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
