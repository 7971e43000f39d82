"""How every dllm_jax command line ends: one line on stderr and an exit status, never a traceback.

  0    done
  1    an operating-system error (full disk, permission denied while writing)
  2    bad input: options, files, prompts, the model folder (every dllm_jax input error is a
       ValueError whose message names the problem)
  130  interrupted (Ctrl-C, SIGINT)
  143  terminated (SIGTERM, SIGHUP: kill, schedulers, docker stop)

Signals are turned into exceptions so that ``finally`` blocks run: a file being written
atomically (dllm_jax.common.atomic_write) loses its temporary copy and keeps its old contents.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger("dllm_jax.cli")

EXIT_OK, EXIT_OS_ERROR, EXIT_BAD_INPUT, EXIT_INTERRUPTED, EXIT_TERMINATED = 0, 1, 2, 130, 143


class Terminated(BaseException):
    """SIGTERM or SIGHUP arrived (a BaseException, like KeyboardInterrupt: nothing catches it by accident)."""


def _raise_terminated(signum: int, frame) -> None:
    raise Terminated(signal.Signals(signum).name)


def run(main: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Runs ``main(argv)`` and maps what it raises to one line on stderr and an exit status.

    argparse's own errors (exit 2, its usage line) pass through unchanged.
    """
    previous = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, _raise_terminated)
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Terminated as e:
        print(f"terminated ({e})", file=sys.stderr)
        return EXIT_TERMINATED
    except ValueError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except OSError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return EXIT_OS_ERROR
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def one_line(error: BaseException) -> str:
    """The error's message on one line (a library's message may hold several)."""
    return " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """-v/--verbose (repeatable) and -q/--quiet."""
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "-v",
        "--verbose",
        action="count",
        default=0,
        help="log more: -v dllm_jax's debug messages, -vv also the libraries'",
    )
    group.add_argument("-q", "--quiet", action="store_true", help="log errors only, no progress bar")


def setup_logging(args: argparse.Namespace) -> None:
    """Diagnostics go to stderr through `logging` (answers go to stdout): dllm_jax's progress
    messages and the libraries' warnings by default."""
    level = logging.ERROR if args.quiet else (logging.DEBUG if args.verbose else logging.INFO)
    third_party = logging.ERROR if args.quiet else (logging.DEBUG if args.verbose >= 2 else logging.WARNING)
    logging.basicConfig(level=third_party, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr, force=True)
    logging.getLogger("dllm_jax").setLevel(level)
