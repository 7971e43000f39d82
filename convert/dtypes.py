"""The dtypes a converted checkpoint may store (importable without jax, for the command line)."""

DTYPES = ("bfloat16", "float16", "float32")
