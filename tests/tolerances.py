"""Error measure and thresholds of the kernel tests, declared once.

Kernels and references round at different points (blocked float32 accumulation, P rounded
before normalisation in the flash loop), so outputs are compared by relative L2 error
||actual - expected|| / ||expected||, with a threshold per dtype.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

REL_L2 = {
    jnp.dtype(jnp.bfloat16): 1e-2,
    jnp.dtype(jnp.float32): 1e-5,
    # a path that re-quantizes an intermediate to float8 e4m3 (3 mantissa bits): a last-bit
    # difference before it moves an element by a whole e4m3 step (6-12% of it), so two correct
    # paths that round the intermediate's producer differently differ by up to a few percent
    jnp.dtype(jnp.float8_e4m3fn): 6e-2,
}


def rel_l2(actual, expected) -> float:
    """Relative L2 error in float64; NaN if either side has a NaN."""
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    return float(np.linalg.norm(actual - expected) / max(np.linalg.norm(expected), 1e-30))


def assert_close(actual, expected, dtype, what: str) -> None:
    """Fails unless the relative L2 error is below the threshold of dtype (NaN fails)."""
    err = rel_l2(actual, expected)
    limit = REL_L2[jnp.dtype(dtype)]
    assert err < limit, f"{what}: relative L2 error {err:.3g} >= {limit:.0e}"
