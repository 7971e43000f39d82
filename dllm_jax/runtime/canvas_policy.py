"""The block-diffusion policy protocol: what a canvas method decides; the canvas loop does the rest.

A policy is a frozen dataclass (hashable: static to jit). Its methods get ONE slot
(dllm_jax.runtime.canvas_slots.CanvasSlots without the batch axis) and are vmapped by the loop
(dllm_jax.runtime.canvas_loop). Each iteration every active slot runs one pass of
canvas_length rows: the policy says which (``rows``: a prompt chunk or a finished canvas to
encode, or the canvas to denoise), then moves the slot on: after an encoder pass
(``after_encoding``) or with the decoder's logits of its canvas (``denoise``).
"""

from __future__ import annotations

from typing import Protocol

import jax

from dllm_jax.runtime.canvas_forward import CanvasRows
from dllm_jax.runtime.canvas_slots import CanvasSlots


class CanvasDecodePolicy(Protocol):
    canvas_length: int
    """L: the rows of every pass, the tokens of a canvas."""

    max_stability: int
    """The previous steps' argmax canvases a slot keeps (CanvasSlots.history)."""

    def rows(self, slot: CanvasSlots) -> CanvasRows:
        """The slot's rows of this iteration (CanvasRows without the batch axis)."""

    def after_encoding(self, slot: CanvasSlots) -> CanvasSlots:
        """The slot after its encoder pass (a PREFILL or COMMIT phase)."""

    def denoise(self, slot: CanvasSlots, logits: jax.Array) -> tuple[CanvasSlots, jax.Array]:
        """One denoising step of a DENOISE slot from the decoder's logits float32 [L, V] of its
        canvas, with the slot's own sampling values: the slot, and the processed logits
        float32 [L, V] whose softmax is the next step's self-conditioning input."""

    def finished(self, slot: CanvasSlots) -> jax.Array:
        """bool: the request in this slot is complete."""

    def num_tokens(self, slot: CanvasSlots) -> jax.Array:
        """Generated tokens credited to the finished request (the throughput numerator)."""
