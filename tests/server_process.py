"""Starts `python -m dllm_jax.serve` in a subprocess on 127.0.0.1 and a free port, for tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


class ServerProcess:
    """A running server: `url`, `pid`, `log()`; stop() ends it by its PID (SIGTERM, then SIGKILL)."""

    def __init__(self, args: list[str], *, start_timeout: float = 300.0):
        self._dir = tempfile.TemporaryDirectory(prefix="dllm-serve-")
        port_file = Path(self._dir.name) / "port"
        self._log_path = Path(self._dir.name) / "server.log"
        self._log = open(self._log_path, "wb")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dllm_jax.serve", "--port", "0", "--port-file", str(port_file), *args],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.pid = self.proc.pid
        deadline = time.monotonic() + start_timeout
        while not port_file.is_file():
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode} before listening:\n{self.log()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server did not listen within {start_timeout} s:\n{self.log()}")
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{int(port_file.read_text())}"

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self._log_path.read_text(errors="replace")

    def metrics(self, api_key: str | None = None) -> dict[str, float]:
        """The /metrics samples as {name{labels}: value}."""
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        text = httpx.get(f"{self.url}/metrics", headers=headers, timeout=10).text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                samples[name] = float(value)
        return samples

    def terminate(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def stop(self, timeout: float = 60.0) -> int:
        self.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode
