"""One connection to the remote tier: a bounded redis-py pool, timeouts, and a breaker for a server that is down.

The remote tier is a cache: it must never fail or stall the model. So every command runs through
:meth:`RemoteConnection.run`, which

- refuses at once (a miss) while the server is marked down, instead of waiting for a timeout on every call;
- marks it down on a connection error, a timeout or an answer that is not Redis protocol (another service on
  that port) for a back-off that doubles from ``backoff_s`` up to ``max_backoff_s`` (retried by the next call
  after it), and logs the change once;
- classifies a server's refusal to store (``OOM`` under ``maxmemory`` with ``noeviction``) as *full*, not down;
- never retries inside redis-py (its default retry would multiply a dead server's timeout).

The client is built lazily, on the first command: a cache that names an unreachable server starts fine
(and a Redis Cluster client, which contacts its seeds when built, is only built once one answers).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any, TypeVar

from tierkv import logs
from tierkv.errors import InvalidConfigError
from tierkv.inputs import printable
from tierkv.remote.url import RemoteURL

log = logging.getLogger("tierkv.remote")
T = TypeVar("T")
_REDIS = f"{os.sep}redis{os.sep}"  # a frame of redis-py's
_TIERKV = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # a frame of tierkv's
_CUT = ("broken pipe", "connection reset", "connection closed", "closed by server")  # a connection cut mid-command


def redis_module() -> Any:
    """The redis package, or InvalidConfigError naming the install command."""
    try:
        import redis
    except ImportError as exc:
        raise InvalidConfigError("the remote tier needs redis-py: pip install 'tierkv[redis]' "
                                 "(or drop remote=).") from exc
    return redis


class RemoteConnection:
    """A lazily built redis-py client (single server or cluster) with a bounded pool and a down-breaker.

    Args:
        url: where the server is (:func:`tierkv.remote.url.parse_remote_url`).
        timeout_s: socket timeout of every command (a slow server costs at most this per call, then it
            is marked down), and the longest wait for a free pooled connection.
        connect_timeout_s: TCP/TLS connect timeout.
        max_connections: pool bound (per node for a cluster).
        write_timeout_s: the socket timeout of writes (:meth:`run` with ``write=True``, on a client of their own):
            a pipeline of large blocks is sent in one ``sendall``, which the timeout bounds as a whole, so it
            needs longer than a read of the same bytes (default ``timeout_s``).
    """

    def __init__(self, url: RemoteURL, timeout_s: float = 2.0, connect_timeout_s: float = 1.0,
                 max_connections: int = 8, backoff_s: float = 1.0, max_backoff_s: float = 30.0,
                 write_timeout_s: float | None = None) -> None:
        redis_module()  # a missing redis-py is a construction error, not a silent miss
        self.url = url
        self.timeout_s = timeout_s
        self.write_timeout_s = timeout_s if write_timeout_s is None else write_timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.counts: Counter[str] = Counter()  # what happened, for stats(): see RemoteBlockStore.stats
        self._lock = threading.Lock()
        self._client: Any = None
        self._write_client: Any = None
        self._down_until = 0.0
        self._backoff = backoff_s
        self._down = False
        self._closed = False

    # ----------------------------------------------------------------------------------- health
    @property
    def down(self) -> bool:
        """True while the breaker is open (the server failed recently; calls are misses until it retries)."""
        return self._down and time.monotonic() < self._down_until

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def warn(self, kind: str, message: str, counted: bool = False) -> None:
        """Log ``message`` at WARNING, at most once a minute for each ``kind`` and server in the process
        (:mod:`tierkv.logs`: every cache of the process, one per conversation, meets the server's condition),
        with how often this connection met it so far unless the message ``counted`` that itself; the password is
        masked wherever a message (an exception's text, say) would carry it, and control characters are removed: the
        server's own text (an error reply) must not drive the terminal or forge log lines."""
        message = printable(self.url.scrub(message))
        with self._lock:
            self.counts[f"warnings_{kind}"] += 1
            seen = self.counts[f"warnings_{kind}"]
        if not logs.due(self.url.redacted(), kind):
            return
        suffix = f" ({seen} so far)" if seen > 1 and not counted else ""
        log.warning("tierkv remote %s: %s%s", self.url.redacted(), message, suffix)

    def _failed(self, exc: BaseException, write: bool = False) -> None:
        """Open the breaker for the back-off, doubled for the next time. Calls that were in flight when the server
        failed fail too, inside the same back-off: they count as errors, not as failed retries."""
        with self._lock:
            self.counts["errors"] += 1
            was_down, self._down = self._down, True
            if was_down and time.monotonic() < self._down_until:
                return  # the same outage, seen by another call in flight
            self._down_until = time.monotonic() + self._backoff
            retry = self._backoff
            self._backoff = min(self._backoff * 2, self.max_backoff_s)
        if not was_down:
            self.warn("down", f"unreachable ({type(exc).__name__}: {exc}){self._hint(exc, write)}; remote lookups "
                              f"are misses and writes are dropped, retrying in {retry:.3g} s")

    def _hint(self, exc: BaseException, write: bool = False) -> str:
        """What an error from the server most likely means, and what to change: "" when nothing more is known."""
        redis = redis_module()
        text = str(exc)
        lower = text.lower()
        if isinstance(exc, redis.exceptions.AuthenticationError) or any(
                mark in lower for mark in ("wrongpass", "noauth", "invalid password", "invalid username-password",
                                           "authentication required")):
            cluster = (" (in a Redis Cluster, on every node, replicas too: requirepass and ACL users are per node, and "
                       "a replica promoted without them refuses the workers)") if self.url.cluster else ""
            return f"; give the password in the URL or in $TIERKV_REDIS_PASSWORD{cluster}"
        if isinstance(exc, (redis.exceptions.MovedError, redis.exceptions.AskError)) or \
                text.startswith(("MOVED ", "ASK ")):
            return ("; the server is a Redis Cluster node, which a redis:// URL cannot use: use "
                    "redis+cluster://host:port (rediss+cluster:// with TLS)")
        if any(mark in lower for mark in ("cluster mode is not enabled", "cluster support disabled",
                                          "'cluster|slots'")):
            return ("; the server refused CLUSTER SLOTS: either it is not a cluster (use redis://host:port/db) or "
                    "the ACL user lacks +cluster|slots (add it: docs/remote.md)")
        if "db index is out of range" in lower:
            return (f"; the URL's database /{self.url.db} is not below the server's 'databases' setting (default "
                    "16): use a smaller /N or raise 'databases' in the server's configuration")
        if "mismatch" in lower and "certificate" in lower:
            return ("; the server's certificate is not for the host name (or IP address) of the URL: connect by a "
                    "name the certificate lists, or have the certificate issued for this one")
        if isinstance(exc, redis.exceptions.ReadOnlyError):
            return "; the server is a read-only replica, which cannot store blocks: point the URL at its primary"
        if isinstance(exc, redis.exceptions.NoPermissionError):
            return "; grant the ACL user that command (the commands tierkv needs: docs/remote.md, Security)"
        if isinstance(exc, redis.exceptions.InvalidResponse) or "connection not ready" in lower:  # (data unasked)
            return "; what answers there does not speak the Redis protocol: check the URL's host and port"
        if "invalid bulk length" in lower or "invalid multibulk length" in lower:  # a value sent whole, then refused
            return ("; the server refused a value's length: a block exceeds its proto-max-bulk-len (raise it, "
                    "docs/remote.md)")
        if write and any(mark in lower for mark in _CUT):
            return ("; the server cut the connection during a write: a block may exceed its limits "
                    "(proto-max-bulk-len, client-query-buffer-limit, client-output-buffer-limit: raise them, "
                    "docs/remote.md) or the server restarted")
        if self.url.tls and isinstance(exc, redis.exceptions.TimeoutError) and "connect" in lower:
            return ("; a TLS connection timed out while connecting: check that the port serves TLS (tls-port), "
                    "or use redis:// for a plain one")
        return ""

    def _succeeded(self) -> None:
        if not self._down:
            return
        with self._lock:
            self._down, self._backoff = False, self.backoff_s
        log.info("tierkv remote %s: reachable again", self.url.redacted())

    # ---------------------------------------------------------------------------------- commands
    def run(self, op: Callable[[Any], T], fallback: T, write: bool = False) -> T:
        """``op(client)``, or ``fallback`` when the server is down, unreachable, slow or refuses (counted,
        warned). ``write``: on the writes' client (``write_timeout_s``). Programming errors (anything not from
        redis-py or the socket) propagate."""
        redis = redis_module()
        if self._closed:
            return fallback
        if self.down:
            self.count("skipped_down")
            return fallback
        try:
            result = op(self._get_client(write))
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            if self._closed:  # close() shut the socket under this call: no failure of the server's
                return fallback
            return self._failure(exc, fallback, write)
        except (AttributeError, IndexError, KeyError, TypeError, ValueError, RecursionError) as exc:
            if not _raised_in_redis_py(exc):
                raise  # tierkv's own bug: not the server's
            if self._closed:
                return fallback
            self._failed(_as_redis_error(exc), write)
            self._drop_client_if_cluster()
            return fallback
        self._succeeded()
        return result

    def _failure(self, exc: BaseException, fallback: T, write: bool) -> T:
        """``fallback``, with ``exc`` (redis-py's, or the socket's) counted and warned: a refusal, or a failure
        that opens the breaker."""
        errors = redis_module().exceptions
        if isinstance(exc, (errors.ConnectionError, errors.TimeoutError, OSError, errors.InvalidResponse,
                            errors.ClusterError, errors.RedisClusterException)):
            self._failed(exc, write)  # first: closing the client fails the other calls in flight (EBADF), not this
            self._drop_client_if_cluster()
        elif isinstance(exc, errors.ResponseError):
            self._refused(exc)
        else:  # any other of redis-py's own (e.g. building a connection)
            self._failed(exc, write)
        return fallback

    def _refused(self, exc: BaseException) -> None:
        if isinstance(exc, redis_module().exceptions.OutOfMemoryError):
            self.count("rejected_full")
            self.warn("full", f"the server is full and refused a write ({exc}); set maxmemory-policy allkeys-lru "
                              "so old blocks make room, or where it evicts already, raise maxmemory above what "
                              "a write needs (docs/remote.md)")
        else:
            self.count("refused")
            errors = redis_module().exceptions
            shown = f"{'MOVED' if isinstance(exc, errors.MovedError) else 'ASK'} {exc}" \
                if isinstance(exc, errors.AskError) else str(exc)  # redis-py's text drops the word: "3406 host:port"
            self.warn("refused", f"the server refused a command: {shown}{self._hint(exc)}")

    def refused(self, results: list[Any]) -> None:
        """Count and warn about the per-command errors of a pipeline run with ``raise_on_error=False``."""
        for item in results:
            if isinstance(item, Exception):
                self._refused(item)

    def pipeline(self, client: Any) -> Any:
        """A pipeline of ``client`` (``transaction=False``). On a cluster, redis-py resends one at a time every command
        that met an error (MOVED, ASK, but also a connection error or a timeout): to a frozen node each resend costs
        another full timeout, one per key. So once a resend met a node that does not answer, the others are refused,
        and a node that failed (connection error, timeout) raises out of ``execute`` as a single-server pipeline does:
        the call is a miss and the breaker opens, instead of per-command errors taken for refusals."""
        pipe = client.pipeline(transaction=False)
        if self.url.cluster:
            _bound_cluster_pipeline(pipe)
        return pipe

    def _get_client(self, write: bool = False) -> Any:
        with self._lock:
            if write:
                if self._write_client is None:
                    self._write_client = self._build(self.write_timeout_s, 2)  # one writer thread
                return self._write_client
            if self._client is None:
                self._client = self._build(self.timeout_s, self.max_connections)
            return self._client

    def _take_clients(self) -> list[Any]:
        with self._lock:
            clients, self._client, self._write_client = [self._client, self._write_client], None, None
        return [client for client in clients if client is not None]

    def _drop_client_if_cluster(self) -> None:
        """A cluster client caches the slot map; after a failure it is rebuilt from the seeds next time."""
        if self.url.cluster:
            for client in self._take_clients():
                client.close()

    def _build(self, timeout_s: float, max_connections: int) -> Any:
        redis = redis_module()
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        url = self.url
        common: dict[str, Any] = dict(  # RESP2: no HELLO, which servers without it answer with a warning per connection
            username=url.username, password=url.password, socket_timeout=timeout_s, protocol=2,
            socket_connect_timeout=self.connect_timeout_s, retry=Retry(NoBackoff(), 0),
        )
        if url.tls:
            tls = dict(url.tls_options)
            # redis-py < 6 does not check the certificate's host name unless asked: a certificate the CA signed
            # for any other host would pass
            common.update(ssl=True, ssl_check_hostname=tls.get("ssl_cert_reqs", "required") != "none", **tls)
        if url.cluster:
            from redis.cluster import ClusterNode, RedisCluster

            return RedisCluster(startup_nodes=[ClusterNode(host, port) for host, port in url.nodes],
                                max_connections=max_connections, **common)
        ssl = common.pop("ssl", False)
        connection = redis.SSLConnection if ssl else redis.Connection
        (host, port), = url.nodes
        pool = redis.BlockingConnectionPool(host=host, port=port, db=url.db, max_connections=max_connections,
                                            timeout=timeout_s, connection_class=connection, **common)
        return redis.Redis(connection_pool=pool)

    def close(self) -> None:
        self._closed = True
        for client in self._take_clients():
            client.close()
            pool = getattr(client, "connection_pool", None)
            if pool is not None:
                pool.disconnect()


def _bound_cluster_pipeline(pipe: Any) -> None:
    """See :meth:`RemoteConnection.pipeline`."""
    errors = redis_module().exceptions
    failed: list[BaseException] = []  # a resend of this execute that met a node not answering
    resend, execute = getattr(pipe, "parent_execute_command", None), pipe.execute

    def resend_once_a_node_failed(*args: Any, **options: Any) -> Any:
        if failed:  # the others would each wait their own timeout for the same node: the call is a miss anyway
            raise errors.TimeoutError("Timeout: a cluster node did not answer (an earlier resend of this call timed "
                                      "out)")
        assert resend is not None  # set only where redis-py has it
        try:
            return resend(*args, **options)  # a MOVED/ASK resend to a node that answers, however slowly, goes on
        except (errors.ConnectionError, errors.TimeoutError) as exc:
            failed.append(exc)
            raise

    def execute_or_raise(raise_on_error: bool = True) -> list[Any]:
        failed.clear()
        results = execute(raise_on_error=raise_on_error)
        for result in results:
            if isinstance(result, (errors.ConnectionError, errors.TimeoutError)):
                raise result
        return results

    pipe.execute = execute_or_raise
    if resend is not None:  # redis-py >= 7 resends through it; 5.x-6.x call the class's own (not bounded here)
        pipe.parent_execute_command = resend_once_a_node_failed


def _raised_in_redis_py(exc: BaseException) -> bool:
    """Whether ``exc`` was raised inside redis-py or what it calls (its reply parser, given what a server that does
    not speak Redis sends; the socket's IDNA encoding of a host name it cannot take), not in tierkv's code: some
    frame after the last of tierkv's is redis-py's."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [index for index, frame in enumerate(frames) if _TIERKV in frame.filename]
    return any(_REDIS in frame.filename for frame in frames[ours[-1] + 1 if ours else 0:])


def _as_redis_error(exc: BaseException) -> Exception:
    """A connection failure standing for ``exc``, raised inside redis-py: its type and message, never its repr, and
    for a Unicode error not even the message (it quotes the string it failed on: the password, say)."""
    redis = redis_module()
    if isinstance(exc, UnicodeError):
        return redis.exceptions.ConnectionError(
            f"{type(exc).__name__} inside redis-py: a host name or password it cannot encode (check the URL's host "
            "and that the password is UTF-8 text)")
    return redis.exceptions.InvalidResponse(f"a reply redis-py could not parse ({type(exc).__name__}: {exc})")
