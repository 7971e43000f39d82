"""dllm_jax.engine.packing: a pytree of int32, bool and float32 arrays through two flat vectors,
packed and unpacked alike with numpy and inside jit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dllm_jax.engine.packing import Packing

pytestmark = pytest.mark.unit


def tree():
    return {
        "ids": np.arange(6, dtype=np.int32).reshape(2, 3),
        "flag": np.array([True, False, True]),
        "score": np.array([[0.5, -1.25]], np.float32),
        "empty": np.zeros((2, 0), np.float32),
        "count": np.int32(7),
    }


def test_a_tree_round_trips_through_two_vectors_with_numpy_and_in_jit():
    packing = Packing.of(tree())
    ints, floats = packing.pack(tree(), np)
    assert ints.dtype == np.int32 and ints.shape == (6 + 3 + 1,)
    assert floats.dtype == np.float32 and floats.shape == (2,)
    for back in (packing.unpack(ints, floats, np), jax.jit(lambda i, f: packing.unpack(i, f, jnp))(ints, floats)):
        for name, value in tree().items():
            assert np.asarray(back[name]).dtype == value.dtype, name
            np.testing.assert_array_equal(back[name], value)
    jitted = jax.jit(lambda t: packing.pack(t, jnp))(tree())
    np.testing.assert_array_equal(jitted[0], ints)
    np.testing.assert_array_equal(jitted[1], floats)


def test_a_part_left_out_unpacks_to_none_and_other_dtypes_are_refused():
    packing = Packing.of(tree())
    ints, _ = packing.pack(tree(), np)
    back = packing.unpack(ints, None, np)
    assert back["score"] is None and back["empty"] is None
    np.testing.assert_array_equal(back["flag"], tree()["flag"])
    with pytest.raises(ValueError, match="leaf 0 .*bfloat16"):
        Packing.of([jnp.zeros((2,), jnp.bfloat16)])
