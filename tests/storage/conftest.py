import os
import uuid

import pytest

import kvtier.storage
from kvtier.storage import pageio

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every fault at INFO/WARNING

from tests.support.services import MooncakeMaster, RedisServer, require_client, unavailable

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


BACKENDS = ["file", "redis", "mooncake"]
ZERO_COPY = {"mooncake"}  # raw objects in the writer's page format: readers use the same layout


@pytest.fixture(params=BACKENDS)
def open_store(request, tmp_path):
    """``open_store(**options)`` opens the backend under test, isolated per test.
    ``open_store.zero_copy`` tells whether readers must share the writer's layout."""
    opened, prefix = [], f"t{uuid.uuid4().hex[:8]}:"

    def _open(**options):
        if request.param == "file":
            store = kvtier.storage.open(f"file://{tmp_path}/store", **options)
        elif request.param == "redis":
            server = request.getfixturevalue("redis_server")
            store = kvtier.storage.open(server.url, prefix=prefix, **options)
        else:
            master = request.getfixturevalue("mooncake_master")
            store = kvtier.storage.open(master.url, prefix=prefix, **options)
        opened.append(store)
        return store

    _open.zero_copy = request.param in ZERO_COPY
    yield _open
    for store in opened:
        store.clear()
        store.close()


@pytest.fixture(params=["compiled", "pure"])
def pageio_path(request, monkeypatch):
    """The compiled part loop of ``kvtier.storage.pageio``, or its Python twin."""
    if request.param == "compiled":
        if not pageio.compiled():
            unavailable("kvtier.storage._pageio is not built or bound (no C compiler at install time?) "
                        "or KVTIER_NATIVE=0")
    else:
        monkeypatch.setenv("KVTIER_NATIVE", "0")
    return request.param
