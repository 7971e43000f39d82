"""Text in and out: the tokenizer wrapper with its chat template (tokenizer.py) and the
embedded models' tiny tokenizer (tiny_tokenizer.py).
"""
