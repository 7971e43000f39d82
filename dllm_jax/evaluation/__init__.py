"""Evaluation harness integrations: the ``dllm_jax`` model of lm-evaluation-harness.

``dllm_jax.evaluation.lm_eval_model`` registers the model (importing it needs lm-eval:
``pip install dllm-jax[eval]``); ``python -m dllm_jax.evaluation`` is lm-eval's command line
with it registered.
"""
