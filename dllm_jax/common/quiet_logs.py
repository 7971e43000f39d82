"""Silence third-party loggers around an operation whose failure we report ourselves.

When orbax cannot restore a damaged checkpoint, asyncio logs every failed TensorStore read
with its traceback ("unhandled exception during asyncio.run() shutdown": ~1,900 lines for a
small model) before the exception reaches us; the user should see our one line instead.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

# The loggers that print around orbax / TensorStore failures.
CHECKPOINT_LOGGERS = ("asyncio", "absl", "orbax", "tensorstore", "jax")


@contextlib.contextmanager
def quiet_logs(names: tuple[str, ...] = CHECKPOINT_LOGGERS, *, level: int = logging.CRITICAL) -> Iterator[None]:
    """Within the block, the named loggers (and their children) drop records below ``level``.

    On leaving, pending asyncio tasks whose exceptions were never retrieved are collected
    first, so their "Task exception was never retrieved" records fall inside the block too.
    The previous levels are restored afterwards.
    """
    loggers = [logging.getLogger(name) for name in names]
    previous = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(level)
    try:
        yield
    finally:
        gc.collect()
        for logger, old in zip(loggers, previous):
            logger.setLevel(old)
