import sys

from dllm_jax.serve.cli import main

sys.exit(main())
