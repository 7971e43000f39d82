"""The model floor: what a model is and how it is read.

config.py (ModelConfig from a Hugging Face config.json), layers.py and transformer.py (the shared
blocks and the forward pass), one file per family (llada.py, dream.py; families.py picks one),
quantization.py (8-bit weights), logit_alignment.py (which output row predicts which position),
checkpoint/ (the Hugging Face tensor tables, the streaming reader, converted folders), loading.py
(a folder, a converted checkpoint or a cached Hub id -> config, weights, tokenizer) and
embedded.py (the tiny models shipped in dllm_jax/assets). Nothing here imports the runtime.
"""
