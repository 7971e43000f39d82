"""The XLA options the engine compiles its loops with unless told otherwise.

On NVIDIA GPUs XLA records a loop's kernels into CUDA graphs ("command buffers"). By default it
leaves the while loops and conditionals out, so every iteration's loop condition (and every
``lax.cond``/``lax.switch``) is read back to the host, and a loop call of one iteration (the
server's) returns only after the host has stepped it through. With WHILE and CONDITIONAL
commands the whole loop runs as one graph. Measured on the H200 at LLaDA-8B shape
(scripts/gpu/loop_call_profile.py, BENCHMARKS.md, 2026-12-03): the server's one-iteration call
took 6.65 ms instead of 10.10 at 1 slot and 25.70 instead of 28.61 at 8, and a long call's
iteration 6.37 / 26.14 ms instead of 6.67 / 26.26. So they are on by default there.
"""

from __future__ import annotations

from typing import Any

from dllm_jax.common import platform
from dllm_jax.models.quantization import compiler_options as quantization_compiler_options

# XLA:GPU's command types, the while loop and conditional included
COMMAND_BUFFERS = "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"


def default_compiler_options(quantization: str) -> dict[str, Any]:
    """Engine's options for a model stored with this quantization: the quantization's own
    (dllm_jax.models.quantization.compiler_options) and, on NVIDIA GPUs, whole-loop command
    buffers."""
    options = dict(quantization_compiler_options(quantization))
    if platform.on_nvidia_gpu():
        options["xla_gpu_enable_command_buffer"] = COMMAND_BUFFERS
    return options
