"""The zero-iteration run a GPU decode loop gets at compile time (dllm_jax.engine.engine._first_execution):
it runs the compiled loop over an empty queue and leaves the loop's answers unchanged."""

import jax
import jax.numpy as jnp
import pytest

import dllm_jax.engine.engine
import dllm_jax.runtime.slots
from tests.engine_checks import FLASH

pytestmark = pytest.mark.engine


def test_a_zero_iteration_run_steps_nothing_and_changes_no_answer(lively_engine):
    engine = lively_engine
    decode = FLASH  # the session's loop: runs with other inputs leave the engine as it was
    prompts = [[3, 4, 5], [6, 7]]
    expected = [r.token_ids for r in engine.generate(prompts, decode_config=decode).results]
    compiled = engine.compile(decode, 3)
    empty = compiled.init(
        jnp.zeros((compiled.queue_capacity, compiled.prompt_width), jnp.int32),
        jnp.zeros((compiled.queue_capacity,), jnp.int32),
        jax.tree.map(jnp.asarray, dllm_jax.runtime.slots.zero_sampling((compiled.queue_capacity,))),
        jnp.int32(0),
    )
    after = compiled.run(engine.weights, empty, 0)
    assert int(after.iteration) == 0 and not bool(jnp.any(after.slots.active))
    dllm_jax.engine.engine._first_execution(engine.weights, compiled)
    assert [r.token_ids for r in engine.generate(prompts, decode_config=decode).results] == expected
