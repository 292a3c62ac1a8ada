"""``redis://``, ``rediss://`` (TLS) and ``redis+cluster://``: Redis or Valkey.

Each page key is one Redis hash ``<prefix><key>``; each stored part is one field
of it (``<fingerprint>/<part>``), so a page's parts live on one node of a cluster,
``delete`` is one ``DEL``, and ``ttl`` expires a page whole. Batches go through
non-transactional pipelines. Timeouts are short by default: a server that is down
or slow turns into misses, and redis-py reconnects on the next call once the
server is back.
"""

from __future__ import annotations

from .base import ObjectStorage


class RedisStorage(ObjectStorage):
    scheme = "redis"

    def __init__(self, url: str, *, ttl: int | None = None, prefix: str = "kvtier:", socket_timeout: float = 5.0,
                 socket_connect_timeout: float = 2.0, password: str | None = None,
                 client_options: dict | None = None, **options) -> None:
        super().__init__(**options)
        try:
            import redis
        except ImportError:  # pragma: no cover - depends on the environment
            raise ValueError("redis:// needs the redis package: pip install 'kvtier[redis]'") from None
        if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"ttl must be a positive int (seconds) or None, got {ttl!r}")
        self.ttl, self.prefix = ttl, prefix
        kwargs = {"socket_timeout": socket_timeout, "socket_connect_timeout": socket_connect_timeout}
        if password is not None:
            kwargs["password"] = password
        kwargs.update(client_options or {})  # e.g. ssl_ca_certs=..., ssl_certfile=... for rediss://
        if url.startswith("redis+cluster://"):
            from redis.cluster import RedisCluster

            self._client = RedisCluster.from_url("redis://" + url.split("://", 1)[1], **kwargs)
        else:
            self._client = redis.Redis.from_url(url, **kwargs)

    def _name(self, key: str) -> str:
        return self.prefix + key

    def _pipeline(self, commands) -> list:
        pipe = self._client.pipeline(transaction=False)
        for name, *args in commands:
            getattr(pipe, name)(*args)
        return pipe.execute(raise_on_error=False)

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
        results = self._pipeline([("hget", self._name(k), f) for k, f in items])
        return [r if self._ok(r) else None for r in results]

    def _has(self, items) -> list[bool]:
        return [r is True or r == 1 for r in self._pipeline([("hexists", self._name(k), f) for k, f in items])]

    def _has_any(self, keys) -> list[bool]:
        return [r == 1 for r in self._pipeline([("exists", self._name(k)) for k in keys])]

    def _remove(self, items) -> None:
        self._pipeline([("hdel", self._name(k), f) for k, f in items])

    def _remove_keys(self, keys) -> None:
        self._pipeline([("delete", self._name(k)) for k in keys])

    def _remove_all(self) -> None:
        batch = []
        for name in self._client.scan_iter(match=self.prefix + "*", count=1000):
            batch.append(name)
            if len(batch) >= 1000:
                self._pipeline([("delete", n) for n in batch])
                batch = []
        if batch:
            self._pipeline([("delete", n) for n in batch])

    def close(self) -> None:
        super().close()
        self._client.close()
