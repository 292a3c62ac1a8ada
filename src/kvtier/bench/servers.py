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


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    import random

    for _ in range(1000):
        port = random.randint(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


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
    """``redis-server`` (or ``valkey-server``) without persistence, bound to 127.0.0.1.
    With ``tls``, it serves TLS only, with a self-signed certificate made by ``openssl``
    (``ca_file`` is what clients must trust)."""

    def __init__(self, port: int | None = None, tls: bool = False) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if binary is None:
            raise ServerUnavailable("redis-server")
        if tls and shutil.which("openssl") is None:
            raise ServerUnavailable("openssl")
        self.binary, self.port, self.tls = binary, port or free_port(), tls
        self.ca_file: str | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        argv = [self.binary, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        if self.tls:
            import tempfile

            d = tempfile.mkdtemp(prefix="kvtier-tls-")
            key, cert = f"{d}/key.pem", f"{d}/cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                            "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
            self.ca_file = cert
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert, "--tls-key-file", key,
                     "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"]
        else:
            argv += ["--port", str(self.port)]
        self._spawn(argv, self.port)
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


class RedisCluster(_Process):
    """Three ``redis-server`` masters in cluster mode, joined with ``redis-cli --cluster create``."""

    def __init__(self, nodes: int = 3) -> None:
        self.nodes = [RedisServer(free_cluster_port()) for _ in range(nodes)]
        self.cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if self.cli is None:
            raise ServerUnavailable("redis-cli")
        self._dir: str | None = None

    @property
    def url(self) -> str:
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}"

    def start(self) -> "RedisCluster":
        try:
            return self._start()
        except BaseException:
            self.stop()  # no node outlives a failed start
            raise

    def _start(self) -> "RedisCluster":
        import tempfile

        self._dir = tempfile.mkdtemp(prefix="kvtier-cluster-")
        for node in self.nodes:
            node._spawn([node.binary, "--port", str(node.port), "--bind", "127.0.0.1", "--save", "",
                         "--appendonly", "no", "--cluster-enabled", "yes",
                         "--cluster-config-file", f"{self._dir}/nodes-{node.port}.conf", "--dir", self._dir],
                        node.port)
        subprocess.run([self.cli, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:  # wait until every node serves every slot
            infos = [subprocess.run([self.cli, "-p", str(n.port), "cluster", "info"], capture_output=True,
                                    text=True).stdout for n in self.nodes]
            if all("cluster_state:ok" in i and "cluster_slots_ok:16384" in i for i in infos):
                return self
            time.sleep(0.2)
        raise RuntimeError("redis cluster did not reach cluster_state:ok")

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
