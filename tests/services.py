"""Real servers for the tests (see ``kvtier.bench.servers``).

Without the server binary the tests that need it skip with the reason, unless
``KVTIER_REQUIRE_SERVICES=1`` (set by ``.ci/run``), which turns that into a failure.
"""

from __future__ import annotations

import os

import pytest

from kvtier.bench import servers
from kvtier.bench.servers import free_port  # noqa: F401 - re-exported for tests

REQUIRED = os.environ.get("KVTIER_REQUIRE_SERVICES") == "1"


def _available(cls):
    def make(*args, **kwargs):
        try:
            return cls(*args, **kwargs)
        except servers.ServerUnavailable as e:
            if REQUIRED:
                pytest.fail(f"{e} is required (KVTIER_REQUIRE_SERVICES=1) but not installed")
            pytest.skip(f"{e} not installed; install it or run .ci/run")
    return make


RedisServer = _available(servers.RedisServer)
MooncakeMaster = _available(servers.MooncakeMaster)
RedisCluster = _available(servers.RedisCluster)
