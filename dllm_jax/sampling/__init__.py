"""What one request chooses and how a token is drawn: SamplingParams and its per-slot arrays
(params.py), token sampling, top-p/top-k filtering and guidance (samplers.py).
"""
