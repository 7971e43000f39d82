"""One row of a family's tensor-name table (llada_names.py, dream_names.py)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from dllm_jax.models.config import ModelConfig


@dataclasses.dataclass(frozen=True)
class TensorRule:
    """How one Hugging Face tensor maps to one parameter leaf.

    hf_name: the tensor's name; ``{layer}`` stands for the block index.
    path: the leaf's path in the params tree.
    hf_shape: the tensor's shape in the Hugging Face file, from the config.
    transpose: the HF tensor is the transpose of the dllm_jax kernel.
    per_layer: one HF tensor per block, stacked along axis 0 of the leaf.
    """

    hf_name: str
    path: tuple[str, ...]
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    transpose: bool = False
    per_layer: bool = False
