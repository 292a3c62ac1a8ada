import pytest
import os

os.environ.setdefault("GLOG_minloglevel", "2")  # Mooncake logs every fault at INFO/WARNING

from services import MooncakeMaster, RedisServer


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
