"""Checkpoint reading and writing below the model's loader: the Hugging Face tensor table,
the streaming safetensors reader and the converted (orbax) folder. ``convert/`` holds the
command-line tools on top of this."""
