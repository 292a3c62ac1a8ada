"""``redis://``, ``rediss://`` (TLS) and ``redis+cluster://``: Redis or Valkey.

Each page key is one Redis hash ``<prefix><key>``; each stored part is one field
of it (``<fingerprint>/p<page size>/<part>``), so a page's parts live on one node
of a cluster, ``delete`` is one ``DEL``, and ``ttl`` expires a page whole. Batches
go through non-transactional pipelines.

A read asks for the fields' lengths (``HSTRLEN``) first and fetches only values
no longer than the object the reader expects: a planted huge value is never
transferred. A timeout or connection error opens a circuit breaker: for
``backoff`` seconds every call is a miss and a counted error without touching the
network (redis-py's own retries are off, so one call costs at most one timeout);
after that, calls try the server again. At open, one ``PING`` checks the database
index and credentials when the server is reachable.
"""

from __future__ import annotations

import re
import threading
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import UsageError
from .codec import Partial
from .faults import BackendDown, Breaker
from .objectstore import ObjectStorage
from .options import Opt, check_options

_GLOB = re.compile(r"[\\*?\[\]]")  # what SCAN MATCH reads as a pattern in a prefix


def _db_index(url: str) -> int:
    parts = urlsplit(url)
    try:
        parts.port
    except ValueError:
        raise UsageError(f"redis URL {url!r} has an invalid port") from None
    if parts.query:
        raise UsageError(f"redis URL {url!r}: URL options are read by kvtier.storage.open(); pass keywords here")
    path = unquote(parts.path).strip("/")
    if not path:
        return 0
    if not path.isdecimal() or not path.isascii():
        raise UsageError(f"redis URL {url!r}: the path must be /<database index>, a non-negative int; got /{path}")
    return int(path)


class RedisStorage(ObjectStorage):
    scheme = "redis"
    OPTIONS = {**ObjectStorage.OPTIONS, "ttl": Opt(int, 1, none_ok=True), "prefix": Opt(str),
               "socket_timeout": Opt(float, 0.001), "socket_connect_timeout": Opt(float, 0.001),
               "backoff": Opt(float, 0)}
    KEYWORDS = ObjectStorage.KEYWORDS | {"password", "client_options"}

    def __init__(self, url: str, *, ttl: int | None = None, prefix: str = "kvtier:", socket_timeout: float = 5.0,
                 socket_connect_timeout: float = 2.0, backoff: float = 5.0, password: str | None = None,
                 client_options: dict | None = None, **options) -> None:
        super().__init__(**options)
        check_options(self.OPTIONS, ttl=ttl, prefix=prefix, socket_timeout=socket_timeout,
                      socket_connect_timeout=socket_connect_timeout, backoff=backoff)
        if not prefix:
            raise UsageError("redis:// storage: prefix must not be empty: the store's keys are those under it "
                             "(clear() removes them all), and an empty one is every key of the database")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:  # pragma: no cover - depends on the environment
            raise UsageError("redis:// needs the redis package: pip install 'kvtier[redis]'") from None
        db = _db_index(url)
        self.ttl, self.prefix = ttl, prefix
        self._breaker = Breaker(backoff)
        kwargs = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout,
                  "retry": Retry(NoBackoff(), 0)}  # the breaker, not redis-py, decides when to try again
        if password is not None:
            kwargs["password"] = password
        kwargs.update(client_options or {})  # e.g. ssl_ca_certs=..., ssl_certfile=... for rediss://
        self._lock = threading.Lock()
        self._client = None
        self._closed = False
        if url.startswith("redis+cluster://"):
            if db:
                raise UsageError(f"redis URL {url!r}: a Redis cluster has database 0 only")
            from redis.cluster import RedisCluster

            rest = urlunsplit(urlsplit(url)._replace(scheme="redis", path=""))
            self._make = lambda: RedisCluster.from_url(rest, **kwargs)
        else:
            self._make = lambda: redis.Redis.from_url(url, **kwargs)
        self._check_server(redis)

    def _check_server(self, redis) -> None:
        """One PING: a database index or credentials the server refuses fail here."""
        try:
            self._call(lambda client: client.ping())
        except (redis.AuthenticationError, redis.ResponseError) as e:
            self.close()
            raise UsageError(f"the redis server refused this connection: {type(e).__name__}: {e}") from None
        except redis.ConnectionError as e:
            if "Invalid Database" in str(e):
                self.close()
                raise UsageError(f"the redis server refused the database index: {e}") from None
            self._fault("open", e)
        except Exception as e:  # down now: counted, and calls fail fast for the backoff
            self._fault("open", e)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _call(self, fn):
        """``fn(client)``, unless the breaker is open; an exception opens the breaker.
        The client is made on first use: a cluster client connects when it is made,
        and a cluster that is down must be a miss, like a server that is down."""
        self._breaker.check()
        try:
            with self._lock:
                if self._closed:
                    raise BackendDown("the store is closed")
                if self._client is None:
                    self._client = self._make()
                client = self._client
            return fn(client)
        except Exception as e:
            self._breaker.trip(e)
            raise

    @staticmethod
    def _execute(client, commands) -> list:
        pipe = client.pipeline(transaction=False)
        for name, *args in commands:
            getattr(pipe, name)(*args)
        return pipe.execute(raise_on_error=False)

    def _pipeline(self, commands) -> list:
        return self._call(lambda client: self._execute(client, commands))

    @staticmethod
    def _ok(result) -> bool:
        return not isinstance(result, Exception)

    def _put(self, items) -> list[bool]:
        commands = []
        for key, field, blob in items:
            commands.append(("hset", self._name(key), field, memoryview(blob)))
            if self.ttl:
                commands.append(("expire", self._name(key), self.ttl))
        results = self._pipeline(commands)
        failed = [r for r in results if not self._ok(r)]
        if failed:
            self._fault("set", failed[0])
        per_item = len(results) // len(items) if items else 1
        return [all(self._ok(r) for r in results[i * per_item:(i + 1) * per_item]) for i in range(len(items))]

    def _get(self, items, dest) -> list:
        names = [(self._name(k), f) for k, f in items]
        lengths = self._pipeline([("hstrlen", n, f) for n, f in names])
        out: list = [None] * len(items)
        fetch, empty = [], []
        for i, (n, buf) in enumerate(zip(lengths, dest)):
            if not self._ok(n):  # e.g. WRONGTYPE: something else sits at the key
                self._fault("get", n)
            elif n > buf.nbytes:
                out[i] = Partial(b"", n)  # never fetched
            elif n:
                fetch.append(i)
            else:
                empty.append(i)
        if empty:
            # NOTE: a length of 0 is a missing field or an empty value; an empty one is a
            # damaged object (judged corrupt, counted and deleted), not a miss that stays
            # present to every lookup. Rare (lookups come first): asked only then.
            there = self._pipeline([("hexists", *names[i]) for i in empty])
            for i, r in zip(empty, there):
                if r is True or r == 1:
                    out[i] = b""
        if fetch:
            # NOTE: a value replaced by a larger one between the two round trips is still
            # fetched; decode() then rejects it. Only a race can make it happen.
            values = self._pipeline([("hget", *names[i]) for i in fetch])
            for i, value in zip(fetch, values):
                if not self._ok(value):
                    self._fault("get", value)
                else:
                    out[i] = value
        return out

    def _has(self, items) -> list[bool]:
        return [r is True or r == 1 for r in self._pipeline([("hexists", self._name(k), f) for k, f in items])]

    def _has_any(self, keys) -> list[bool]:
        return [r == 1 for r in self._pipeline([("exists", self._name(k)) for k in keys])]

    def _remove(self, items) -> None:
        self._pipeline([("hdel", self._name(k), f) for k, f in items])

    def _remove_keys(self, keys) -> None:
        self._pipeline([("delete", self._name(k)) for k in keys])

    def _remove_all(self) -> None:
        def run(client) -> None:
            batch = []
            # NOTE: the prefix matched as it is: SCAN's glob would read * ? [ ] and \ in it
            # as patterns, and clear keys of other prefixes (another tenant's) but not its own
            for name in client.scan_iter(match=_GLOB.sub(r"\\\g<0>", self.prefix) + "*", count=1000):
                batch.append(("delete", name))
                if len(batch) >= 1000:
                    self._execute(client, batch)
                    batch = []
            if batch:
                self._execute(client, batch)
        self._call(run)

    def close(self) -> None:
        super().close()
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            client.close()
