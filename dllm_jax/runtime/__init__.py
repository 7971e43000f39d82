"""The device floor: the one jitted decode loop and what it carries.

decode_config.py (DecodeConfig: what is compiled), slots.py (per-slot state and the operations
every policy shares), flat_cache.py, cached_forward.py (one pass over the flat cache),
chunked_attention.py (the portable attention), kernel_routing.py (which op runs as which kernel),
sharding.py, batch_invariance.py, policy.py (the protocol a policy implements), decode_loop.py
and memory_estimate.py.
"""
