import pytest
import os

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every fault at INFO/WARNING

from services import MooncakeMaster, RedisServer, require_client

# Every test of a backend's own module needs that backend's Python client, server fixture or not.
CLIENTS = {"test_redis.py": "redis", "test_mooncake.py": "mooncake.store"}


def pytest_runtest_setup(item):
    if item.path.name in CLIENTS:
        require_client(CLIENTS[item.path.name])


@pytest.fixture(scope="session")
def redis_server():
    server = RedisServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mooncake_master():
    master = MooncakeMaster().start()
    yield master
    master.stop()
