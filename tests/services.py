"""Real servers for the tests, started on free loopback ports and stopped afterwards.

Without the server binary the tests that need it skip with the reason, unless
``KVTIER_REQUIRE_SERVICES=1`` (set by ``.ci/run``), which turns that into a failure.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

REQUIRED = os.environ.get("KVTIER_REQUIRE_SERVICES") == "1"


def missing(what: str) -> None:
    if REQUIRED:
        pytest.fail(f"{what} is required (KVTIER_REQUIRE_SERVICES=1) but not available")
    pytest.skip(f"{what} not available; install it or run .ci/run")


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


class RedisServer:
    def __init__(self, port: int | None = None) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            missing("redis-server")
        self.binary, self.port = binary, port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None


class MooncakeMaster:
    """``mooncake_master`` with its built-in HTTP metadata server."""

    def __init__(self) -> None:
        try:
            import mooncake
        except ImportError:
            missing("mooncake-transfer-engine-non-cuda")
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        if not binary.exists():
            missing("mooncake_master")
        self.binary = str(binary)
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return (f"mooncake://127.0.0.1:{self.rpc_port}?metadata=http://127.0.0.1:{self.http_port}/metadata"
                f"&protocol=tcp")

    def start(self) -> "MooncakeMaster":
        self.proc = subprocess.Popen(
            [self.binary, f"-rpc_port={self.rpc_port}", "-rpc_address=127.0.0.1",
             "-enable_http_metadata_server=true", "-http_metadata_server_host=127.0.0.1",
             f"-http_metadata_server_port={self.http_port}", f"-metrics_port={self.metrics_port}",
             "-default_kv_lease_ttl=100"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_port(self.rpc_port)
        wait_port(self.http_port)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
