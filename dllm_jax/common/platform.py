"""Which accelerator JAX runs on (read when asked, so tests can stand in for a GPU or TPU), and
the start of JAX's backend, where an impossible JAX_PLATFORMS becomes one line."""

from __future__ import annotations

import os

import jax

from dllm_jax.common.quiet_logs import quiet_logs

PLATFORMS_ENV = "JAX_PLATFORMS"
# The platform names JAX_PLATFORMS takes, in the order they are listed.
_KNOWN_PLATFORMS = ("cuda", "rocm", "tpu", "cpu")


class PlatformError(ValueError):
    """JAX cannot start the backend it was asked for; the message names JAX_PLATFORMS."""


def on_nvidia_gpu() -> bool:
    try:
        device = jax.devices()[0]
    except RuntimeError:
        return False
    return device.platform == "gpu" and "nvidia" in device.device_kind.lower()


def on_tpu() -> bool:
    try:
        return jax.devices()[0].platform == "tpu"
    except RuntimeError:
        return False


def start_backend() -> None:
    """Starts JAX's backend (a command line calls it once its input is checked).

    Raises:
      PlatformError, one line naming JAX_PLATFORMS, what failed and the platforms this machine
      has, for a JAX_PLATFORMS that names an unknown platform or one without its hardware or
      plugin (``tpu`` without a TPU, ``cuda`` without a GPU or without jax's CUDA plugin).
    """
    try:
        with quiet_logs(("jax",)):
            jax.devices()
        return
    except Exception as e:  # RuntimeError, or a bare AssertionError for a platform without its plugin
        reason = _first_sentence(e)
    requested = os.environ.get(PLATFORMS_ENV) or jax.config.jax_platforms
    if not requested:
        raise PlatformError(f"JAX cannot start a backend: {reason}")
    raise PlatformError(
        f"{PLATFORMS_ENV}={requested!r}: {reason}; this machine has {', '.join(_available()) or 'no platform'} "
        f"(unset {PLATFORMS_ENV} to use the best of them)"
    )


def _first_sentence(error: Exception) -> str:
    """The reason of a backend failure without JAX's advice (which names another variable setting)."""
    text = " ".join(str(error).split()).split(" (set JAX_PLATFORMS", 1)[0].rstrip(".")
    return text or f"JAX could not start it ({type(error).__name__}: its plugin is not installed?)"


def _available() -> list[str]:
    """The platforms JAX starts when left to choose (after a failed start: JAX keeps no backend)."""
    jax.config.update("jax_platforms", "")
    found = []
    with quiet_logs(("jax",)):
        for name in _KNOWN_PLATFORMS:
            try:
                if jax.devices(name):
                    found.append(name)
            except Exception:  # not installed, or no device of it
                continue
    return found
