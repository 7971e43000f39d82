"""Digests of the decode loop as lowered for CUDA, to show that a refactor leaves the GPU program alone.

Lowers the engine's jitted loop (GPU auto kernels, or --backend xla: the portable path; abstract
weights, of --quantization: nothing is allocated) on this CPU for each model shape, slot count
and method, with source locations dropped, and prints
two SHA-256 digests per program: of the whole text, and of the text without the arguments' and
results' pytree names (jax.arg_info / jax.result_info, which change when a field is renamed and
nothing else does). Equal digests before and after a change mean the same program runs.

    python scripts/lowering_digest.py > before.txt   # on the old tree
    python scripts/lowering_digest.py > after.txt    # on the new one; then diff them
    python scripts/lowering_digest.py --quantization fp8 --backend xla --methods flash_cache
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import sys

import jax
from jax._src import source_info_util

try:  # run as a file (scripts/ is sys.path[0]), or imported in process as scripts.NAME
    from gpu.repo_root import put_checkout_on_path
except ImportError:
    from scripts.gpu.repo_root import put_checkout_on_path
put_checkout_on_path()

import jax.numpy as jnp  # noqa: E402

from dllm_jax.engine.engine import Engine  # noqa: E402
from dllm_jax.models.config import dream_7b_config, llada_8b_config  # noqa: E402
from dllm_jax.models.quantization import QUANTIZATIONS  # noqa: E402
from dllm_jax.models.transformer import abstract_params, unstack_layers  # noqa: E402
from dllm_jax.runtime.decode_config import DecodeConfig  # noqa: E402
from dllm_jax.runtime.kernel_routing import Kernels  # noqa: E402
from dllm_jax.runtime.slots import zero_sampling  # noqa: E402
from tests.cuda_lowering import GPU_AUTO, lower_for_cuda  # noqa: E402

MODELS = {"llada-8b": llada_8b_config, "dream-7b": dream_7b_config}
METHODS = {
    "flash_cache": dict(method="flash_cache"),
    "flash_verify": dict(method="flash_cache", verify=True),
    "fast_dllm": dict(method="fast_dllm"),
    "llada": dict(method="llada"),
}
BACKENDS = {"gpu-auto": GPU_AUTO, "xla": Kernels()}
_NAMES = re.compile(r'jax\.(?:arg|result)_info = "[^"]*"')


def without_locations() -> None:
    """Lowerings carry no source locations from here on (file paths and line numbers change
    when code moves; the program does not)."""
    jax.config.update("jax_include_full_tracebacks_in_locations", False)
    source_info_util.user_frame = lambda traceback: None


def lowered(
    model: str,
    slots: int,
    method: str,
    gen_length: int = 256,
    prompt_len: int = 256,
    quantization: str = "none",
    backend: str = "gpu-auto",
) -> str:
    config = dataclasses.replace(MODELS[model](), quantization=quantization)
    engine = Engine(config, jax.eval_shape(unstack_layers, abstract_params(config)), backend=BACKENDS[backend])
    loop = engine.decode_loop(DecodeConfig(gen_length=gen_length, batch_size=slots, **METHODS[method]), prompt_len)
    capacity = max(16, 4 * slots)
    i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    sampling = jax.eval_shape(lambda: zero_sampling((capacity,)))
    state = jax.eval_shape(loop.init_state, i32(capacity, prompt_len), i32(capacity), sampling, i32())
    run = jax.jit(loop.run, donate_argnums=1)
    return lower_for_cuda(run, engine.weights, state, i32(), jax.ShapeDtypeStruct((), jnp.bool_))


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    p.add_argument("--slots", nargs="+", type=int, default=[1, 32])
    p.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="none", help="the weights' (default: none)")
    p.add_argument("--backend", choices=BACKENDS, default="gpu-auto", help="the kernels (default: gpu-auto)")
    args = p.parse_args(argv)
    without_locations()
    print("model slots method digest digest_without_pytree_names bytes")
    for model in args.models:
        for slots in args.slots:
            for method in args.methods:
                text = lowered(model, slots, method, quantization=args.quantization, backend=args.backend)
                print(model, slots, method, digest(text), digest(_NAMES.sub("", text)), len(text), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
