"""Small helpers shared by the Pallas kernels: argument checks, launch parameters, tile arithmetic."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.pallas import triton as plgpu

# Streaming multiprocessors of the target GPU (H200 / H100 SXM). Only the default block-size
# heuristics read it, to decide when a grid is too small to fill the chip.
NUM_SMS = 132


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n > 0 and n & (n - 1) == 0


def next_power_of_two(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def check_power_of_two(name: str, value: Any, minimum: int) -> None:
    """Raises ValueError unless value is a power of two >= minimum."""
    if not is_power_of_two(value) or value < minimum:
        raise ValueError(f"{name}={value!r}: expected a power of two >= {minimum}")


def dividing_block(name: str, size: int, most: int, kernel: str) -> int:
    """The largest power of two <= most that divides size (at least 16); ValueError naming
    `kernel` when there is none."""
    block = most
    while block >= 16 and size % block:
        block //= 2
    if block < 16:
        raise ValueError(f"{name}={size}: {kernel} needs a multiple of 16")
    return block


@dataclasses.dataclass(frozen=True)
class RowBlockSizes:
    """Tiling of a kernel that gives each program a block of whole rows: block_rows rows per
    program (a power of two; a call takes rows_for(n) of them), num_warps and num_stages Triton's."""

    block_rows: int = 1
    num_warps: int = 8
    num_stages: int = 1

    def __post_init__(self):
        check_power_of_two("block_rows", self.block_rows, 1)
        check_launch(self.num_warps, self.num_stages)

    def rows_for(self, n: int) -> int:
        """The largest power of two <= block_rows that divides n rows."""
        rows = self.block_rows
        while n % rows:
            rows //= 2
        return rows


def rows_within(elements_per_row: int, most_elements: int) -> int:
    """The most rows, a power of two, whose elements stay within most_elements; one at least."""
    rows = 1
    while 2 * rows * elements_per_row <= most_elements:
        rows *= 2
    return rows


def dot_t(a: jax.Array, b: jax.Array) -> jax.Array:
    """a [M, K] . b [N, K]^T -> float32 [M, N] (q . k^T of a tile, without a transpose)."""
    return lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def gelu_tanh(x: jax.Array, dtype: Any) -> jax.Array:
    """jax.nn.gelu(x, approximate=True) on `dtype` values, as XLA computes it, in float32 registers.

        gelu(x) = x * 0.5 * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))

    x: float32 values of `dtype` (bf16 / f16 / f32). As jnp does on `dtype` arrays, the constants
    are `dtype` values (bf16: sqrt(2 / pi) = 0.796875, 0.044715 -> 0.0446777) and every operation's
    result is rounded to `dtype` (XLA's CPU backend upcasts each bf16 op and rounds it back;
    XLA:GPU on Hopper multiplies and adds bf16 natively and upcasts tanh alone: the same values);
    x^3 is x * (x * x), as lax.integer_pow. Returns float32 values of `dtype` (for float32 x this
    is jax.nn.gelu itself; tests/test_grouped_matmul.py holds it equal to the model's gelu_tanh).
    """
    dtype = jnp.dtype(dtype)

    def rounded(v):
        return v if dtype == jnp.float32 else v.astype(dtype).astype(jnp.float32)

    def constant(value: float) -> float:
        return float(np.asarray(value, np.float64).astype(dtype))

    cube = rounded(x * rounded(x * x))
    inner = rounded(constant(np.sqrt(2 / np.pi)) * rounded(x + rounded(constant(0.044715) * cube)))
    cdf = rounded(0.5 * rounded(1.0 + rounded(jnp.tanh(inner))))
    return rounded(x * cdf)


def pad_rows(x: jax.Array, multiple: int) -> jax.Array:
    """x [M, N] with zero rows appended up to a multiple of `multiple` rows (x itself when none)."""
    pad = cdiv(x.shape[0], multiple) * multiple - x.shape[0]
    return jnp.pad(x, ((0, pad), (0, 0))) if pad else x


def check_launch(num_warps: Any, num_stages: Any) -> None:
    """Raises ValueError for Triton launch parameters the compiler would reject."""
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps={num_warps!r}: expected one of 1, 2, 4, 8, 16")
    if not isinstance(num_stages, int) or not 1 <= num_stages <= 8:
        raise ValueError(f"num_stages={num_stages!r}: expected an int in [1, 8]")


def compiler_params(num_warps: int, num_stages: int) -> plgpu.CompilerParams:
    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def check_shape(name: str, x: jax.Array, expected: tuple[int, ...]) -> None:
    if tuple(x.shape) != tuple(expected):
        raise ValueError(f"{name}.shape={tuple(x.shape)}: expected {tuple(expected)}")


def check_float(name: str, x: jax.Array) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"{name}.dtype={x.dtype}: expected a floating dtype (bfloat16, float16 or float32)")


def as_int32(name: str, x: jax.Array | int, shape: tuple[int, ...]) -> jax.Array:
    """x as an int32 array of the given shape; ValueError for a wrong shape or a non-integer dtype."""
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name}.dtype={x.dtype}: expected an integer dtype (int32)")
    check_shape(name, x, shape)
    return x.astype(jnp.int32)


def as_bool(name: str, x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    x = jnp.asarray(x)
    if x.dtype != jnp.bool_:
        raise ValueError(f"{name}.dtype={x.dtype}: expected bool")
    check_shape(name, x, shape)
    return x
