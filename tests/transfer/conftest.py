"""Fixtures of the transfer tests."""

import pytest

from kvtier import compiled as compiled_modules
from kvtier.transfer import native
from tests.support.services import unavailable


@pytest.fixture
def compiled():
    """The compiled copy module, or skip (fail under KVTIER_REQUIRE_SERVICES=1) when it is not built."""
    module = compiled_modules.built(native.COMPILED)
    if module is None:
        unavailable("kvtier.transfer._native is not built (no C compiler at install time?)")
    return module
