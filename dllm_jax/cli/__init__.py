"""The command lines of dllm_jax (installed as console scripts by pyproject.toml).

  dllm-generate   dllm_jax.cli.generate   answers for prompts, from the command line or a JSONL file
  dllm-convert    convert.hf_to_jax       a Hugging Face LLaDA checkpoint into a dllm_jax one

Shared pieces: arguments (argparse types whose errors name the flag, the help formatter),
prompts (--prompt / JSONL input), output (the --output check), running (one-line
errors with exit status 2, Ctrl-C and SIGTERM as one line and 130 / 143, logging flags).
"""
