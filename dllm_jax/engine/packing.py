"""A pytree of small arrays as two flat vectors, so that it crosses between host and device in
two transfers instead of one per leaf.

Each transfer has a fixed host cost (tens of microseconds: a Python call, a buffer, an event),
which a decode loop called once per step pays for every leaf it sends or reads. Packing the
integer and bool leaves into one int32 vector and the float32 leaves into one float32 vector, in
leaf order, makes that two transfers whatever the tree. The same Packing packs and unpacks with
numpy on the host and with jax.numpy inside a jitted function.

    packing = Packing.of(tree)                 # arrays or jax.ShapeDtypeStruct leaves
    ints, floats = packing.pack(tree, np)      # int32 [n_int], float32 [n_float]
    same = packing.unpack(ints, floats, jnp)   # the tree again (each leaf its own dtype)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import numpy as np

_INTEGERS = (np.dtype(np.int32), np.dtype(np.bool_))
_FLOATS = (np.dtype(np.float32),)


@dataclasses.dataclass(frozen=True)
class Packing:
    """Where each leaf of a pytree lies in the packed int32 and float32 vectors.

    treedef: the tree's structure; leaves: each leaf's (shape, dtype, is_float, offset) in
    leaf order; num_ints, num_floats: the vectors' lengths.
    """

    treedef: Any
    leaves: tuple[tuple[tuple[int, ...], np.dtype, bool, int], ...]
    num_ints: int
    num_floats: int

    @classmethod
    def of(cls, tree: Any) -> Packing:
        """The packing of trees shaped like `tree` (arrays or ShapeDtypeStructs of int32, bool
        or float32; raises ValueError naming another dtype)."""
        flat, treedef = jax.tree.flatten(tree)
        leaves, sizes = [], {False: 0, True: 0}
        for i, leaf in enumerate(flat):
            dtype, shape = np.dtype(leaf.dtype), tuple(leaf.shape)
            if dtype not in _INTEGERS + _FLOATS:
                raise ValueError(f"leaf {i} of {treedef}: dtype {dtype} (expected int32, bool or float32)")
            is_float = dtype in _FLOATS
            leaves.append((shape, dtype, is_float, sizes[is_float]))
            sizes[is_float] += math.prod(shape)
        return cls(treedef, tuple(leaves), sizes[False], sizes[True])

    def pack(self, tree: Any, xp: Any = np) -> tuple[Any, Any]:
        """(int32 [num_ints], float32 [num_floats]) of a tree of this packing, built with `xp`
        (numpy on the host, jax.numpy in a jitted function)."""
        flat = self.treedef.flatten_up_to(tree)
        parts: dict[bool, list] = {False: [], True: []}
        for value, (_, _, is_float, _) in zip(flat, self.leaves, strict=True):
            parts[is_float].append(xp.ravel(value).astype(np.float32 if is_float else np.int32))
        return tuple(
            xp.concatenate(parts[f]) if parts[f] else xp.zeros((0,), np.float32 if f else np.int32)
            for f in (False, True)
        )

    def unpack(self, ints: Any, floats: Any, xp: Any = np) -> Any:
        """The tree from its packed vectors (each leaf reshaped and cast back to its dtype).
        A part left out (None) unpacks to None leaves: read only the vector you need."""
        flat = []
        for shape, dtype, is_float, offset in self.leaves:
            vector = floats if is_float else ints
            if vector is None:
                flat.append(None)
                continue
            flat.append(xp.reshape(vector[offset : offset + math.prod(shape)], shape).astype(dtype))
        return self.treedef.unflatten(flat)
