"""dllm_jax.serve: an OpenAI-compatible HTTP server over the engine.

One engine thread owns the device and steps the decode loop in short calls (worker.py);
requests join the on-device ring between calls and stream their stable text per step
(stable_text.py, responses.py); the FastAPI app (app.py) speaks OpenAI's API with the
"dllm" extension; cli.py is `dllm-serve`.
"""
