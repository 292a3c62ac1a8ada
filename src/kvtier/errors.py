"""Every error class of kvtier, in one module (no imports, so any part of kvtier can use it).

Each derives from :class:`KVTierError`; a second base keeps the built-in exception
it was before, so callers that catch ``ValueError``, ``NotImplementedError``,
``RuntimeError`` or ``OSError`` keep working::

    KVTierError
    ├── UsageError (ValueError)             the caller passed something wrong: an argument, a spec,
    │   └── TraceError                      a URL, a command-line value, a trace file
    ├── IntegrityError (RuntimeError)       a broken invariant: a bug in kvtier, or state changed behind its back
    ├── UnsupportedError                    a combination kvtier does not serve; the message says what to use
    │   ├── UnsupportedLayoutError (NotImplementedError)
    │   ├── UnsupportedVLLMSetupError (NotImplementedError)
    │   ├── UnsupportedModelError (ValueError)
    │   ├── UnsupportedPoolError (ValueError)
    │   └── UnsupportedHostPoolError (ValueError)
    ├── CacheClosedError (RuntimeError)     a call after HierarchicalCache.close()
    ├── LoadError (RuntimeError)            a host -> device load failed
    ├── RegionError (RuntimeError)          a vLLM pool file that is missing, foreign or mismatched
    ├── ServerUnavailable (RuntimeError)    a benchmark's local server cannot run here
    └── storage faults, internal to the storage backends (a fault is a miss, never raised to callers):
        CorruptObject, UnexpectedObject, BackendDown (ConnectionError), NotAnObject (OSError)

The policy: caller misuse raises :class:`UsageError` with the numbers in the message;
an unsupported combination raises an :class:`UnsupportedError` naming what to use
instead, with the built-in base it always had (``NotImplementedError`` where sglang's
and vLLM's callers catch that, ``ValueError`` for the ones first raised as bad
arguments); a broken invariant raises :class:`IntegrityError`, never an ``assert``
(``python -O`` drops those). Running out of space is not an error (``None``). The
command line answers a :class:`UsageError` or an :class:`UnsupportedError` in one
line, and shows anything else as a bug, with its traceback.
"""


class KVTierError(Exception):
    """The base of every error kvtier raises."""


class UsageError(KVTierError, ValueError):
    """The caller (a user, a command line, an engine) passed something wrong; the
    message names the value and what would be accepted. A ``ValueError``."""


class IntegrityError(KVTierError, RuntimeError):
    """A broken invariant of the cache's state (``HierarchicalCache.check_integrity``),
    an allocator's (a page freed twice) or a lock's (an unlock without a lock): a bug in
    kvtier, or state changed behind its back. The message names what broke."""


class UnsupportedError(KVTierError):
    """A combination kvtier does not serve (a layout, a model, an engine setup); the
    message says what to use instead. Each subclass also keeps its built-in base."""


class UnsupportedLayoutError(UnsupportedError, NotImplementedError):
    """An operation the host layout cannot do; the message names the layout to use.

    Subclasses ``NotImplementedError`` so callers written for sglang's HiCache,
    which catch that, keep working.
    """


class UnsupportedVLLMSetupError(UnsupportedError, NotImplementedError):
    """A vLLM configuration kvtier's offloading spec cannot serve; the message says what to change."""


class UnsupportedModelError(UnsupportedError, ValueError):
    """The model's cache cannot be mapped to pages (e.g. linear-attention or recurrent state)."""


class UnsupportedPoolError(UnsupportedError, ValueError):
    """An sglang host pool kvtier cannot read in place; the message says what would work."""


class UnsupportedHostPoolError(UnsupportedError, ValueError):
    """A host pool configuration kvtier's sglang pool does not take; the message says
    what to use instead."""


class TraceError(UsageError):
    """A malformed trace line; the message names the file and line."""


class CacheClosedError(KVTierError, RuntimeError):
    """A call on a :class:`~kvtier.HierarchicalCache` after :meth:`~kvtier.HierarchicalCache.close`."""


class LoadError(KVTierError, RuntimeError):
    """A host -> device load (or one it depended on) failed; its KV must not be used."""


class RegionError(KVTierError, RuntimeError):
    """A vLLM pool file that is missing, foreign, or does not match what its reader expects."""


class ServerUnavailable(KVTierError, RuntimeError):
    """A benchmark's server cannot run here: its binary is missing or exits at start. The message says which."""


class CorruptObject(KVTierError):
    """A stored object failed a check of its own header or checksum: delete it."""


class UnexpectedObject(KVTierError):
    """An object that is not what the reader expects (another length), but that its
    header does not call broken: a miss, and the object stays."""


class BackendDown(KVTierError, ConnectionError):
    """A storage call refused without touching the network: the breaker is open."""


class NotAnObject(KVTierError, OSError):
    """Something other than a regular file sits at a file store's object path."""
