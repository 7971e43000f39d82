"""The block-diffusion policy protocol: what a canvas method decides; the canvas loop does the rest.

A policy is a frozen dataclass (hashable: static to jit). Its methods get ONE slot
(dllm_jax.runtime.canvas_slots.CanvasSlots without the batch axis) and are vmapped by the loop
(dllm_jax.runtime.canvas_loop). Each iteration every active slot runs one pass of
canvas_length rows: the policy says which (``rows``: a prompt chunk or a finished canvas to
encode, or the canvas to denoise), then moves the slot on: after an encoder pass
(``after_encoding``) or with the decoder's logits of its canvas (``denoise``). A loop whose
kernel computes the step's statistics of the logits itself (Kernels.canvas_sampler) asks the
policy for the step's temperature and uniforms (``step_inputs``) and moves the slot on with
those statistics (``denoise_with``): ``denoise`` is ``denoise_with`` of the statistics it
computes in jnp.
"""

from __future__ import annotations

from typing import Protocol

import jax
from flax import struct

from dllm_jax.runtime.canvas_forward import CanvasRows
from dllm_jax.runtime.canvas_slots import CanvasSlots


@struct.dataclass
class StepStatistics:
    """A denoising step's statistics of one canvas's processed logits (its logits over the
    step's temperature), per canvas row [L]: argmax int32 (the lowest index of the largest),
    entropy float32 (of their softmax), drawn int32 (the inverse-CDF sample at the step's
    uniform). With a batch axis under vmap."""

    argmax: jax.Array
    entropy: jax.Array
    drawn: jax.Array


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

    def step_inputs(self, slot: CanvasSlots) -> tuple[jax.Array, jax.Array]:
        """The slot's denoising step's temperature float32 [] and its sample's uniforms float32
        [L], what a kernel needs to compute the step's StepStatistics from the logits."""

    def denoise_with(self, slot: CanvasSlots, statistics: StepStatistics) -> CanvasSlots:
        """``denoise``'s step from the statistics of the processed logits (computed elsewhere,
        from ``step_inputs``): the slot."""

    def finished(self, slot: CanvasSlots) -> jax.Array:
        """bool: the request in this slot is complete."""

    def num_tokens(self, slot: CanvasSlots) -> jax.Array:
        """Generated tokens credited to the finished request (the throughput numerator)."""
