"""Run a script with the full pass's MLP in one piece (MLP_CHUNK_ROWS huge), to compare: python3 scripts/gpu/mlp_in_one_piece.py SCRIPT ARGS..."""

import runpy
import sys

try:  # run as a file (scripts/gpu is sys.path[0]), or imported in process as scripts.gpu.NAME
    from repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import dllm_jax.runtime.cached_forward as c  # noqa: E402

c.MLP_CHUNK_ROWS = 10**9
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
