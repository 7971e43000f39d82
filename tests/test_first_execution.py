"""The zero-iteration run a GPU decode loop gets at compile time (dllm_jax.engine.engine._first_execution):
it runs the compiled loop over an empty queue and leaves the loop's answers unchanged."""

import jax
import jax.numpy as jnp
from conftest import tiny_config

import dllm_jax.engine.engine
import dllm_jax.runtime.slots
from dllm_jax import DecodeConfig, Engine
from dllm_jax.models.transformer import init_params


def test_a_zero_iteration_run_steps_nothing_and_changes_no_answer():
    config = tiny_config()
    engine = Engine(config, init_params(config, jax.random.key(0)))
    decode = DecodeConfig(gen_length=8, batch_size=2)
    prompts = [[3, 4, 5], [6, 7]]
    expected = [r.token_ids for r in engine.generate(prompts, decode_config=decode).results]
    compiled = engine.compile(decode, 3)
    empty = compiled.init(
        jnp.zeros((compiled.queue_capacity, compiled.prompt_width), jnp.int32),
        jnp.zeros((compiled.queue_capacity,), jnp.int32),
        jax.tree.map(jnp.asarray, dllm_jax.runtime.slots.zero_sampling((compiled.queue_capacity,))),
        jnp.int32(0),
    )
    after = compiled.run(engine.weights, empty, jnp.int32(0), jnp.bool_(False))
    assert int(after.iteration) == 0 and not bool(jnp.any(after.slots.active))
    dllm_jax.engine.engine._first_execution(
        engine.weights, compiled.init, compiled.run, compiled.queue_capacity, compiled.prompt_width
    )
    assert [r.token_ids for r in engine.generate(prompts, decode_config=decode).results] == expected
