"""Where the remote tier lives: one URL for a single server or a Redis Cluster, with TLS and auth.

Accepted forms (Valkey speaks the same protocol and takes the same URLs)::

    redis://[[user]:password@]host[:port][/db]            one server, plain TCP
    rediss://[[user]:password@]host[:port][/db]           one server, TLS
    redis+cluster://[[user]:password@]h1:p1,h2:p2,...     Redis Cluster: seed nodes (any few of its primaries)
    rediss+cluster://...                                  Redis Cluster over TLS

Query options pass TLS settings to redis-py: ``ssl_ca_certs=/path/ca.pem``, ``ssl_certfile=``,
``ssl_keyfile=``, ``ssl_cert_reqs=required|optional|none`` (default required: the server's certificate is
verified). A password in the URL wins; else ``$TIERKV_REDIS_PASSWORD`` (``tierkv.settings``) is used, so a
secret need not appear in code or in a process list. The password never appears in :meth:`RemoteURL.redacted`,
which is what logs and errors print.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import parse_qs, unquote, urlsplit

from tierkv.errors import InvalidConfigError

SCHEMES = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
           "rediss+cluster": (True, True)}  # scheme -> (tls, cluster)
DEFAULT_PORT = 6379
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
_EXAMPLE = "e.g. redis://127.0.0.1:6379/0, rediss://:secret@cache.internal:6380/0 or redis+cluster://h1:7000,h2:7001"


@dataclass(frozen=True, slots=True)
class RemoteURL:
    """A parsed remote-tier URL: the nodes to reach, and how."""

    nodes: tuple[tuple[str, int], ...]  # one for a single server; the seeds for a cluster
    db: int = 0
    tls: bool = False
    cluster: bool = False
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str], ...] = ()

    def redacted(self) -> str:
        """The URL without its password, for logs and messages."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        auth = f"{self.username or ''}:***@" if self.password else (f"{self.username}@" if self.username else "")
        hosts = ",".join(f"{host}:{port}" for host, port in self.nodes)
        return f"{scheme}://{auth}{hosts}" + ("" if self.cluster else f"/{self.db}")


def parse_remote_url(url: str, password: str | None = None) -> RemoteURL:
    """Parse ``url`` (see the module doc); ``password`` is used when the URL carries none."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidConfigError(f"remote={url!r} is not a Redis URL; {_EXAMPLE}.")
    scheme, rest = url.split("://", 1)
    if scheme.lower() not in SCHEMES:
        raise InvalidConfigError(f"remote URL scheme {scheme!r} is not one of {', '.join(SCHEMES)}; {_EXAMPLE}.")
    tls, cluster = SCHEMES[scheme.lower()]
    # urlsplit does not accept a comma-separated host list: split the netloc by hand.
    parts = urlsplit("//" + rest)
    netloc = rest.split("/", 1)[0].split("?", 1)[0]
    userinfo, _, hostlist = netloc.rpartition("@")
    username, _, url_password = userinfo.partition(":")
    nodes = tuple(_node(item, url) for item in hostlist.split(","))
    if len(nodes) > 1 and not cluster:
        raise InvalidConfigError(f"remote URL {_redact(url)} names several hosts; use redis+cluster:// for a cluster "
                                 "(or one host for a single server).")
    db = _db(parts.path, url, cluster)
    options = {key: values[-1] for key, values in parse_qs(parts.query).items()}
    unknown = sorted(set(options) - set(TLS_OPTIONS))
    if unknown:
        raise InvalidConfigError(f"remote URL {_redact(url)} has unknown options {', '.join(unknown)}; "
                                 f"valid: {', '.join(TLS_OPTIONS)}.")
    if options and not tls:
        raise InvalidConfigError(f"remote URL {_redact(url)} has TLS options but the scheme is not rediss://.")
    return RemoteURL(nodes=nodes, db=db, tls=tls, cluster=cluster, username=unquote(username) or None,
                     password=unquote(url_password) or password or None, tls_options=tuple(sorted(options.items())))


def _node(item: str, url: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, _, port = item[1:].partition("]")
        port = port.removeprefix(":")
    elif item.count(":") == 1:
        host, port = item.split(":")
    else:
        host, port = item, ""
    if not host:
        raise InvalidConfigError(f"remote URL {_redact(url)} has an empty host; {_EXAMPLE}.")
    if not port:
        return host, DEFAULT_PORT
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise InvalidConfigError(f"remote URL {_redact(url)} has port {port!r}; a port is 1-65535.")
    return host, int(port)


def _db(path: str, url: str, cluster: bool) -> int:
    text = path.strip("/")
    if not text:
        return 0
    if not text.isdigit():
        raise InvalidConfigError(f"remote URL {_redact(url)} has database {text!r}; a database is a number (/0).")
    if cluster and int(text) != 0:
        raise InvalidConfigError(f"remote URL {_redact(url)}: Redis Cluster has only database 0.")
    return int(text)


def _redact(url: str) -> str:
    """``url`` with any password replaced (for messages about a URL that did not parse)."""
    scheme, sep, rest = url.partition("://")
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.split(":", 1)[0] + ":***"
    return f"{scheme}{sep}{userinfo}{at}{hosts}{slash}{tail}"
