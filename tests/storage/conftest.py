import pytest

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
