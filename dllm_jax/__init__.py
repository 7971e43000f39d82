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
              LLaDA (shift 0), the row before for Dream (shift 1); dllm_jax.logit_alignment.

Library use:
  from dllm_jax import DecodeConfig, Engine
  engine = Engine.from_pretrained(path)
  out = engine.generate(["What is 2+2?"], DecodeConfig(method="flash_cache", verify=True))
"""

from dllm_jax.config import ConfigError, ModelConfig, dream_7b_config, llada_8b_config
from dllm_jax.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.engine import Engine, GenerationError, GenerationOutput, GenerationResult, GenerationStats
from dllm_jax.loading import LoadedModel, load_model
from dllm_jax.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ConfigError",
    "DecodeConfig",
    "DecodeConfigError",
    "Engine",
    "GenerationError",
    "GenerationOutput",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelConfig",
    "Tokenizer",
    "TokenizerError",
    "dream_7b_config",
    "llada_8b_config",
    "load_model",
]
