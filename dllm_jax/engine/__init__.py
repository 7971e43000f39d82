"""The host floor: requests in, results out, over compiled decode loops.

request.py (Request and its status, the host side of the request ring), results.py
(GenerationResult and cutting answers at EOS, stop ids and stop strings), compiled_loop.py
(CompiledLoop: one loop compiled for a configuration and shape bucket), session.py
(GenerationSession: one compiled loop fed online) and engine.py (Engine: model, weights,
tokenizer, compiled loops; generate and chat).
"""
