"""dllm_jax: fast, portable inference for masked diffusion LMs (LLaDA, Dream) in JAX and Pallas.

Glossary:
  canvas      a request's positions: prompt [0, P), generation [P, P + G) (starts as [MASK]),
              EOS padding after it.
  step        one denoising iteration: a model pass, then commits.
  commit      fixing a predicted token at a [MASK] position (never undone).
  window      flash_cache's W decoding candidates: the W leftmost undecoded positions.
  full pass   every position of a slot is recomputed (a request's first step, block starts).
  sparse pass only the policy's query rows are recomputed over the flat K/V cache.
  slot        one row of the batch; continuous batching refills a finished slot.
  logits      the output row of position i - logit_shift predicts token i: the same row for
              LLaDA (shift 0), the row before for Dream (shift 1); dllm_jax.models.logit_alignment.

Library use:
  from dllm_jax import DecodeConfig, Engine, SamplingParams
  engine = Engine.from_pretrained(path)             # a folder or a Hub id in the local cache
  out = engine.generate(["What is 2+2?"], SamplingParams(max_new_tokens=32, stop=["\n"]),
                        decode_config=DecodeConfig(method="flash_cache", verify=True, gen_length=64), chat=True)
  out = engine.chat([[{"role": "user", "content": "What is 2+2?"}]])
"""

import importlib
from typing import TYPE_CHECKING

# Exports are imported on first use, so that importing a light submodule (the converter's
# command line reads dllm_jax.models.checkpoint.dtypes and .errors) does not import jax.
_EXPORTS = {
    "ConfigError": "dllm_jax.models.config",
    "ModelConfig": "dllm_jax.models.config",
    "dream_7b_config": "dllm_jax.models.config",
    "llada_8b_config": "dllm_jax.models.config",
    "ConversionError": "dllm_jax.models.checkpoint.errors",
    "deterministic_xla_flags": "dllm_jax.runtime.batch_invariance",
    "DecodeConfig": "dllm_jax.runtime.decode_config",
    "DecodeConfigError": "dllm_jax.runtime.decode_config",
    "Engine": "dllm_jax.engine.engine",
    "GenerationOutput": "dllm_jax.engine.results",
    "GenerationResult": "dllm_jax.engine.results",
    "GenerationStats": "dllm_jax.engine.results",
    "Request": "dllm_jax.engine.request",
    "RequestStatus": "dllm_jax.engine.request",
    "GenerationError": "dllm_jax.common.errors",
    "SamplingParamsError": "dllm_jax.common.errors",
    "LoadedModel": "dllm_jax.models.loading",
    "ModelNotFoundError": "dllm_jax.models.loading",
    "InsufficientMemoryError": "dllm_jax.runtime.memory_estimate",
    "default_dtype": "dllm_jax.models.loading",
    "load_model": "dllm_jax.models.loading",
    "SamplingParams": "dllm_jax.sampling.params",
    "GenerationSession": "dllm_jax.engine.session",
    "RequestUpdate": "dllm_jax.engine.session",
    "StepCommits": "dllm_jax.engine.session",
    "Tokenizer": "dllm_jax.text.tokenizer",
    "TokenizerError": "dllm_jax.text.tokenizer",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'dllm_jax' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:
    from dllm_jax.common.errors import GenerationError, SamplingParamsError
    from dllm_jax.engine.engine import Engine
    from dllm_jax.engine.request import Request, RequestStatus
    from dllm_jax.engine.results import GenerationOutput, GenerationResult, GenerationStats
    from dllm_jax.engine.session import GenerationSession, RequestUpdate, StepCommits
    from dllm_jax.models.checkpoint.errors import ConversionError
    from dllm_jax.models.config import ConfigError, ModelConfig, dream_7b_config, llada_8b_config
    from dllm_jax.models.loading import LoadedModel, ModelNotFoundError, default_dtype, load_model
    from dllm_jax.runtime.batch_invariance import deterministic_xla_flags
    from dllm_jax.runtime.decode_config import DecodeConfig, DecodeConfigError
    from dllm_jax.runtime.memory_estimate import InsufficientMemoryError
    from dllm_jax.sampling.params import SamplingParams
    from dllm_jax.text.tokenizer import Tokenizer, TokenizerError
