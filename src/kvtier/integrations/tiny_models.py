"""The old import path of :mod:`kvtier.tiny_models` (the demo's small models), kept for
code written against it."""

from ..tiny_models import MODELS, WINDOW, build  # noqa: F401
