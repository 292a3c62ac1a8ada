"""Named errors of kvtier."""


class UnsupportedLayoutError(NotImplementedError):
    """An operation the host layout cannot do; the message names the layout to use.

    Subclasses ``NotImplementedError`` so callers written for sglang's HiCache,
    which catch that, keep working.
    """


class IntegrityError(RuntimeError):
    """A broken invariant of the cache's state (``HierarchicalCache.check_integrity``):
    a bug in kvtier, or state changed behind its back. The message names what broke."""
