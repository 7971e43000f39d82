"""dllm_jax.serve.heap: the startup heap frozen while serving, every collection's pause timed."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, Histogram

from dllm_jax.serve.heap import frozen_startup_heap

pytestmark = pytest.mark.unit


def collections(registry: CollectorRegistry, generation: int) -> float:
    return registry.get_sample_value("pauses_count", {"generation": str(generation)}) or 0.0


def test_the_heap_is_frozen_inside_and_each_collection_observed_by_generation():
    registry = CollectorRegistry()
    pauses = Histogram("pauses", "", ["generation"], registry=registry)
    frozen_before, callbacks_before = gc.get_freeze_count(), list(gc.callbacks)
    kept = [[i] for i in range(1000)]  # alive at entry: frozen with the rest
    with frozen_startup_heap(pauses):
        assert gc.get_freeze_count() > frozen_before + len(kept)
        assert gc.is_tracked(kept[0])
        first = [collections(registry, g) for g in range(3)]
        gc.collect(0)
        gc.collect()
        assert [collections(registry, g) - first[g] for g in range(3)] == [1, 0, 1]
        assert registry.get_sample_value("pauses_sum", {"generation": "2"}) > 0
    assert gc.get_freeze_count() == frozen_before
    assert gc.callbacks == callbacks_before
    gc.collect()
    assert collections(registry, 2) == first[2] + 1  # nothing observed once out


def test_a_failure_inside_still_unfreezes_and_removes_the_callback():
    pauses = Histogram("pauses", "", ["generation"], registry=CollectorRegistry())
    frozen_before, callbacks_before = gc.get_freeze_count(), list(gc.callbacks)
    with pytest.raises(RuntimeError), frozen_startup_heap(pauses):
        raise RuntimeError("the server failed")
    assert gc.get_freeze_count() == frozen_before
    assert gc.callbacks == callbacks_before
