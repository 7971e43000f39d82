"""The persistent compilation cache of the command lines: a decode loop compiled once is read back
by the next run (about 1 s instead of 5-15 s on the CPU) instead of compiled again.

Where: ``$XDG_CACHE_HOME/dllm_jax/compiled`` (``~/.cache/dllm_jax/compiled``), or the folder
``$DLLM_JAX_COMPILE_CACHE`` names, or a command line's ``--compile-cache DIR``; off with
``DLLM_JAX_COMPILE_CACHE=off`` or ``--no-compile-cache``. A JAX cache configured by the user
(``JAX_COMPILATION_CACHE_DIR``) is left as it is. The cache is JAX's own: entries are keyed by
the program, the devices, the compiler options and the JAX version, so a stale entry is never
used, and the folder is bounded (least recently used entries go first).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger("dllm_jax.runtime.compile_cache")

CACHE_ENV = "DLLM_JAX_COMPILE_CACHE"
_OFF = ("off", "0", "false", "no", "none")
# Most bytes the cache folder holds (JAX evicts the least recently used entries beyond it).
MAX_CACHE_BYTES = 4 * 2**30
# Programs that compile faster than this are not stored (JAX's default is 1 s; the small jitted
# helpers around a decode loop each take a fraction of that, and together a second or more).
MIN_COMPILE_SECONDS = 0.2


def default_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/dllm_jax/compiled``, XDG_CACHE_HOME defaulting to ``~/.cache``."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(root) / "dllm_jax" / "compiled"


def cache_dir_setting(flag: str | None, disabled: bool) -> Path | None:
    """The folder a command line's flags and $DLLM_JAX_COMPILE_CACHE choose (None: no cache):
    --no-compile-cache, else --compile-cache DIR, else the variable, else default_cache_dir()."""
    if disabled:
        return None
    if flag is not None:
        return Path(flag).expanduser()
    setting = os.environ.get(CACHE_ENV)
    if setting is not None:
        return None if setting.strip().lower() in _OFF or not setting.strip() else Path(setting).expanduser()
    return default_cache_dir()


def enable_compile_cache(folder: Path | None) -> Path | None:
    """Points JAX's persistent cache at ``folder`` (call before the first compilation) and
    returns the folder in use: JAX's own setting when the user made one, None when off.

    A folder that cannot be created costs only the speed-up: a warning, and no cache.
    """
    import jax  # here: a command line reads its settings (cache_dir_setting) before JAX starts

    configured = jax.config.jax_compilation_cache_dir
    if configured:
        return Path(configured)
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        log.warning("compilation cache %s: %s; running without it", folder, e.strerror or e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(folder))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", MIN_COMPILE_SECONDS)
    jax.config.update("jax_compilation_cache_max_size", MAX_CACHE_BYTES)
    return folder
