"""What dllm-serve's --method accepts, in a module that imports nothing (--help stays fast)."""

# a DecodeConfig method, "+verify" for Flash-Verify, "+cfg" for LLaDA's classifier-free guidance
# (a second, unconditional pass per step: dllm.cfg_scale)
METHOD_SPECS = ("flash_cache", "flash_cache+verify", "fast_dllm", "llada", "llada+cfg", "dream", "diffusion_gemma")
