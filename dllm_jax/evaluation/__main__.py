"""lm-eval's command line with the ``dllm_jax`` model registered.

    python -m dllm_jax.evaluation --model dllm_jax --model_args pretrained=PATH,method=flash_cache \\
        --tasks gsm8k --num_fewshot 5

Arguments are lm-eval's own (``lm_eval --help``). lm-eval 0.4.13 registers only its own models
from the command line, so this module imports the dllm_jax model first. A bad model_args key,
generation kwarg or rolling-loglikelihood task ends with one line and exit status 2.
"""

from __future__ import annotations

import sys


def main() -> int:
    from lm_eval.__main__ import cli_evaluate

    from dllm_jax.evaluation.lm_eval_model import GenerationKwargsError, LoglikelihoodRollingError
    from dllm_jax.evaluation.model_args import ModelArgsError

    try:
        cli_evaluate()
    except (ModelArgsError, GenerationKwargsError, LoglikelihoodRollingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
