"""dllm_jax: fast, portable inference for masked diffusion LMs (LLaDA) in JAX and Pallas.

Glossary:
  canvas      a request's positions: prompt [0, P), generation [P, P + G) (starts as [MASK]),
              EOS padding after it.
  step        one denoising iteration: a model pass, then commits.
  commit      fixing a predicted token at a [MASK] position (never undone).
  window      flash_cache's W decoding candidates: the W leftmost undecoded positions.
  full pass   every position of a slot is recomputed (a request's first step, block starts).
  sparse pass only the policy's query rows are recomputed over the flat K/V cache.
  slot        one row of the batch; continuous batching refills a finished slot.
  logits      same-position alignment: the logit row of position i predicts token i (LLaDA).

Library use:
  from dllm_jax import DecodeConfig, Engine, SamplingParams
  engine = Engine.from_pretrained(path)
  out = engine.generate(["What is 2+2?"], SamplingParams(max_new_tokens=32, stop=["\n"]),
                        decode=DecodeConfig(method="flash_cache", verify=True, gen_length=64), chat=True)
  out = engine.chat([[{"role": "user", "content": "What is 2+2?"}]])
"""

from dllm_jax.config import ConfigError, ModelConfig, llada_8b_config
from dllm_jax.decode_config import DecodeConfig, DecodeConfigError
from dllm_jax.engine import Engine, GenerationOutput, GenerationResult, GenerationStats
from dllm_jax.errors import GenerationError, SamplingParamsError
from dllm_jax.sampling_params import SamplingParams
from dllm_jax.session import GenerationSession, RequestUpdate, StepCommits
from dllm_jax.loading import LoadedModel, load_model
from dllm_jax.tokenizer import Tokenizer, TokenizerError

__all__ = [
    "ConfigError",
    "DecodeConfig",
    "DecodeConfigError",
    "Engine",
    "GenerationError",
    "GenerationOutput",
    "GenerationSession",
    "GenerationResult",
    "GenerationStats",
    "LoadedModel",
    "ModelConfig",
    "RequestUpdate",
    "SamplingParams",
    "SamplingParamsError",
    "StepCommits",
    "Tokenizer",
    "TokenizerError",
    "llada_8b_config",
    "load_model",
]
