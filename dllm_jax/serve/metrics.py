"""The server's Prometheus metrics, in a registry of their own (one per server, no globals)."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
log = logging.getLogger("dllm_jax.serve")
_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"  # jax._src.dispatch.BACKEND_COMPILE_EVENT
_GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1)
_TOKENS_PER_STEP_BUCKETS = (1, 1.5, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64)


class ServerMetrics:
    """Counters, gauges and histograms of one server; `render()` is the /metrics text."""

    def __init__(self):
        self.registry = r = CollectorRegistry()
        self.requests_running = Gauge("dllm_requests_running", "Requests accepted and not yet answered", registry=r)
        self.requests_waiting = Gauge("dllm_requests_waiting", "Requests waiting for a slot", registry=r)
        self.slots_busy = Gauge("dllm_slots_busy", "Decode slots holding a request", registry=r)
        self.slots_total = Gauge("dllm_slots_total", "Decode slots of the engine", registry=r)
        self.requests = Counter("dllm_requests", "Requests answered, by finish reason", ["finish_reason"], registry=r)
        self.cancelled = Counter(
            "dllm_requests_cancelled",
            "Requests abandoned before their end (client gone, stop string or max_tokens reached early, deadline)",
            registry=r,
        )
        self.errors = Counter("dllm_errors", "Requests failed, by kind", ["kind"], registry=r)
        self.tokens_generated = Counter("dllm_tokens_generated", "Completion tokens returned", registry=r)
        self.prompt_tokens = Counter("dllm_prompt_tokens", "Prompt tokens of answered requests", registry=r)
        self.steps = Counter("dllm_steps", "Denoising steps of answered requests", registry=r)
        self.loop_iterations = Counter("dllm_loop_iterations", "Decode loop iterations run", registry=r)
        self.tokens_per_step = Histogram(
            "dllm_tokens_per_step",
            "Tokens per denoising step of each answered request",
            buckets=_TOKENS_PER_STEP_BUCKETS,
            registry=r,
        )
        self.step_seconds = Histogram(
            "dllm_step_seconds",
            "Wall time of one decode loop iteration (device call / iterations)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_wait_seconds = Histogram(
            "dllm_queue_wait_seconds", "Time from arrival to the first step", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.first_text_seconds = Histogram(
            "dllm_time_to_first_text_seconds",
            "Time from arrival to the first stable text",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.answer_seconds = Histogram(
            "dllm_time_to_answer_seconds",
            "Time from arrival to the complete answer",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.commit_to_chunk_seconds = Histogram(
            "dllm_commit_to_chunk_seconds",
            "Time from the loop call that returned a commit to its chunk being sent",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.gc_pause_seconds = Histogram(
            "dllm_gc_pause_seconds",
            "Pause of each garbage collection while serving (the interpreter lock held), by generation",
            ["generation"],
            buckets=_GC_PAUSE_BUCKETS,
            registry=r,
        )
        self.warmup_seconds = Gauge("dllm_warmup_seconds", "Compile time of the warm-up at start", registry=r)
        self.compilations_after_warmup = Gauge(
            "dllm_compilations_after_warmup",
            "XLA compilations since the warm-up ended (0 when every loop was warmed up)",
            registry=r,
        )

    def watch_compilations(self) -> None:
        """Counts every XLA compilation from now on (call once the warm-up is done)."""
        import jax

        def on_event(event: str, duration: float, **kwargs) -> None:
            if event == _BACKEND_COMPILE_EVENT:
                self.compilations_after_warmup.inc()
                log.warning("compiled %s (%.2f s) after the warm-up", kwargs.get("fun_name", "?"), duration)

        jax.monitoring.register_event_duration_secs_listener(on_event)

    def render(self) -> bytes:
        return generate_latest(self.registry)
