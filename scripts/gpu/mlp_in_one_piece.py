"""Run a script with the full pass's MLP in one piece (MLP_CHUNK_ROWS huge), to compare: python3 scripts/gpu/mlp_in_one_piece.py SCRIPT ARGS..."""

import runpy
import sys

import dllm_jax.runtime.cached_forward as c

c.MLP_CHUNK_ROWS = 10**9
sys.argv = sys.argv[1:]
sys.path.insert(0, "scripts")
runpy.run_path(sys.argv[0], run_name="__main__")
