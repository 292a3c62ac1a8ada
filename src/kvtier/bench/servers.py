"""Local Redis and Mooncake master processes on free loopback ports (benchmarks, tests)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path


class ServerUnavailable(RuntimeError):
    """The server binary is not installed here."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class _Process:
    proc: subprocess.Popen | None = None

    def _spawn(self, argv: list[str], *ports: int) -> None:
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for port in ports:
                wait_port(port)
        except RuntimeError:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class RedisServer(_Process):
    """``redis-server`` (or ``valkey-server``) without persistence, bound to 127.0.0.1."""

    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise ServerUnavailable("redis-server")
        self.binary, self.port = binary, port or free_port()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self._spawn([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no"], self.port)
        return self


class MooncakeMaster(_Process):
    """``mooncake_master`` (from the Mooncake wheel) with its built-in HTTP metadata server."""

    def __init__(self) -> None:
        try:
            import mooncake
        except ImportError:
            raise ServerUnavailable("mooncake-transfer-engine-non-cuda") from None
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        if not binary.exists():
            raise ServerUnavailable("mooncake_master")
        self.binary = str(binary)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()

    @property
    def url(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}/metadata"
                f"&protocol=tcp")

    def start(self) -> "MooncakeMaster":
        self._spawn([self.binary, f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
                     "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
                     f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
                     "-default_kv_lease_ttl=100"], self.rpc_port, self.http_port)
        return self
