"""The host floor: requests in, results out, over compiled decode loops.

request.py (Request and its status, the host side of the request ring), results.py
(GenerationResult and cutting answers at EOS, stop ids and stop strings), compiled_loop.py
(CompiledLoop: one loop compiled for a configuration and shape bucket), loop_call.py (one call
of it: the host's changes in, a packed report out; packing.py packs them), device_calls.py (the
calls in order on a thread of their own), session.py (GenerationSession: one compiled loop fed
online) and engine.py (Engine: model, weights, tokenizer, compiled loops; generate and chat).
"""
