"""lm-eval's command line with the ``dllm_jax`` model registered.

    python -m dllm_jax.evaluation --model dllm_jax --model_args pretrained=PATH,method=flash_cache \\
        --tasks gsm8k --num_fewshot 5

Arguments are lm-eval's own (``lm_eval --help``). lm-eval 0.4.13 registers only its own models
from the command line, so this module imports the dllm_jax model first. The dllm_jax
model_args are checked before lm-eval indexes its tasks; a bad model_args key, generation
kwarg or rolling-loglikelihood task ends with one line and exit status 2.
"""

from __future__ import annotations

import sys


def main() -> int:
    """Runs lm-eval's command line on sys.argv (as lm_eval.__main__.cli_evaluate does)."""
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    from dllm_jax.evaluation.lm_eval_model import GenerationKwargsError, LoglikelihoodRollingError
    from dllm_jax.evaluation.model_args import ModelArgsError, parse_model_args

    setup_logging()
    parser = HarnessCLI()
    args = parser.parse_args()
    try:
        if getattr(args, "model", None) == "dllm_jax" and getattr(args, "model_args", None):
            parse_model_args(dict(args.model_args))
        parser.execute(args)
    except (ModelArgsError, GenerationKwargsError, LoglikelihoodRollingError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
