"""The server process's garbage collector while it serves: the startup heap frozen, and every
collection's pause timed.

What start-up leaves alive (the model's parameters, the compiled loops, JAX's and the
tokenizer's state) is never garbage, yet each full collection walks it with the interpreter
lock held: the event loop sending chunks and the engine thread preparing the next call both
stop. gc.freeze moves those objects to the permanent generation, so collections walk only what
requests allocate (as vLLM, SGLang and TensorRT-LLM do after their warm-up).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator

from prometheus_client import Histogram


@contextlib.contextmanager
def frozen_startup_heap(pause_seconds: Histogram) -> Iterator[None]:
    """Collects once, freezes what is left, and observes every collection's pause in
    `pause_seconds` (a histogram labelled by "generation") until exit, which unfreezes: a process
    that goes on without the server (tests, benchmarks) collects those objects as before. The
    freeze is the process's: of two servers in one process, the first to stop unfreezes both."""
    by_generation = [pause_seconds.labels(str(g)) for g in range(len(gc.get_count()))]
    started: list[float] = []

    # runs with the collector already collecting: it is not re-entered, and nothing else
    # observes these children, so their locks are free here
    def on_collection(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            by_generation[info["generation"]].observe(time.perf_counter() - started.pop())

    gc.collect()
    gc.freeze()
    gc.callbacks.append(on_collection)
    try:
        yield
    finally:
        gc.callbacks.remove(on_collection)
        gc.unfreeze()
