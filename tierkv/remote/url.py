"""Where the remote tier lives: one URL for a single server or a Redis Cluster, with TLS and auth.

Accepted forms (Valkey speaks the same protocol and takes the same URLs)::

    redis://[[user]:password@]host[:port][/db]            one server, plain TCP
    rediss://[[user]:password@]host[:port][/db]           one server, TLS
    redis+cluster://[[user]:password@]h1:p1,h2:p2,...     Redis Cluster: seed nodes (any few of its primaries)
    rediss+cluster://...                                  Redis Cluster over TLS

Query options pass TLS settings to redis-py: ``ssl_ca_certs=/path/ca.pem``, ``ssl_certfile=``,
``ssl_keyfile=``, ``ssl_cert_reqs=required|optional|none`` (default required: the server's certificate is
verified); ``username=`` and ``password=`` are also taken from the query, as redis-py does (the userinfo
wins). A password in the URL wins; else ``$TIERKV_REDIS_PASSWORD`` (``tierkv.settings``) is used, so a
secret need not appear in code or in a process list.

The password never appears in :meth:`RemoteURL.redacted` (what logs, reprs and stats print) nor in any error
about a URL, well-formed or not: a message shows the URL with its userinfo and every query value other than
the TLS options masked (:func:`redact`; a username is shown only beside a password: alone it may be the password
in the wrong place), and any text that could hold the secret passes :func:`scrub`. The
userinfo is everything before the *last* ``@`` of the part before the query, so a password holding ``/``,
``:`` or ``@`` parses as one (better: percent-encode such characters, ``%2F`` for ``/``).

Hosts are checked here, not at the first command: a name the resolver cannot take (an empty label, a label over
63 characters), two ports, or brackets around anything but an IPv6 address is an :class:`InvalidConfigError`;
so is a username or password that is not UTF-8 text.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import re
import ssl
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, unquote

from tierkv.errors import InvalidConfigError

SCHEMES = {"redis": (False, False), "rediss": (True, False), "redis+cluster": (False, True),
           "rediss+cluster": (True, True)}  # scheme -> (tls, cluster)
DEFAULT_PORT = 6379
TLS_OPTIONS = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_cert_reqs")
AUTH_OPTIONS = ("username", "password")
CERT_REQS = ("required", "optional", "none")
MASK = "***"
_EXAMPLE = "e.g. redis://127.0.0.1:6379/0, rediss://:secret@cache.internal:6380/0 or redis+cluster://h1:7000,h2:7001"
_ENCODE = "percent-encode special characters of a password (%40 for @, %2F for /, %3F for ?, %23 for #)"
_NAME = re.compile(r"[A-Za-z0-9._~%+-]+")  # a username shown as is; anything else is masked
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]{0,30}")
_OPTION = re.compile(r"[a-z][a-z0-9_]{0,39}")


@dataclass(frozen=True, slots=True)
class RemoteURL:
    """A parsed remote-tier URL: the nodes to reach, and how."""

    nodes: tuple[tuple[str, int], ...]  # one for a single server; the seeds for a cluster
    db: int = 0
    tls: bool = False
    cluster: bool = False
    username: str | None = field(default=None, repr=False)
    password: str | None = field(default=None, repr=False)
    tls_options: tuple[tuple[str, str], ...] = ()

    def redacted(self) -> str:
        """The URL without its password, for logs and messages."""
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        user = self.username if self.username is None or _shows_username(self.username, bool(self.password)) \
            else MASK
        auth = f"{user or ''}:{MASK}@" if self.password else (f"{user}@" if user else "")
        hosts = ",".join(f"[{host}]:{port}" if ":" in host else f"{host}:{port}" for host, port in self.nodes)
        return f"{scheme}://{auth}{hosts}" + ("" if self.cluster else f"/{self.db}")

    def scrub(self, text: str) -> str:
        """``text`` (an exception's message, say) with this URL's password masked wherever it occurs."""
        return _mask(text, {self.password} if self.password else set())


def parse_remote_url(url: str, password: str | None = None) -> RemoteURL:
    """Parse ``url`` (see the module doc); ``password`` is used when the URL carries none. Every error is an
    :class:`InvalidConfigError` whose message shows the URL redacted (:func:`redact`)."""
    if not isinstance(url, str):
        raise InvalidConfigError(f"remote must be a Redis URL string; got a {type(url).__name__}. {_EXAMPLE}.")
    try:
        return _parse(url, password)
    except InvalidConfigError as exc:
        raise InvalidConfigError(scrub(str(exc), url)) from None


def _parse(url: str, password: str | None) -> RemoteURL:
    shown = redact(url)
    scheme, sep, rest = url.partition("://")
    if not sep:
        raise InvalidConfigError(f"remote={shown!r} is not a Redis URL (no scheme://); {_EXAMPLE}.")
    if scheme.lower() not in SCHEMES:
        raise InvalidConfigError(f"remote URL {shown}: scheme {_shown_scheme(scheme)!r} is not one of "
                                 f"{', '.join(SCHEMES)}; {_EXAMPLE}.")
    tls, cluster = SCHEMES[scheme.lower()]
    if _ambiguous(rest):
        raise InvalidConfigError(f"remote URL {shown} is ambiguous: an '@' after the '?' (a password holding '?', "
                                 f"or a query value holding '@'); {_ENCODE}.")
    userinfo, hostpart, query = _split(rest)
    if "#" in hostpart or "#" in query:
        raise InvalidConfigError(f"remote URL {shown} has a '#' outside its password; {_ENCODE}.")
    hostlist, _, path = hostpart.partition("/")
    username, _, url_password = userinfo.partition(":") if userinfo is not None else ("", "", "")
    nodes = tuple(_node(item, shown) for item in hostlist.split(","))
    if len(nodes) > 1 and not cluster:
        raise InvalidConfigError(f"remote URL {shown} names several hosts; use redis+cluster:// for a cluster "
                                 "(or one host for a single server).")
    db = _db(path, shown, cluster)
    options = dict(parse_qsl(query, keep_blank_values=True))  # a repeated option: the last one counts
    unknown = sorted(set(options) - set(TLS_OPTIONS) - set(AUTH_OPTIONS))
    if unknown:
        plain = {key for (key, _), masked in _pairs(query) if not masked}  # the others may be part of a password
        names = ", ".join(name if name in plain else MASK for name in unknown)
        hint = "" if set(unknown) <= plain else f" ({MASK}: a name that may be part of a password; {_ENCODE}, %26 " \
            "for &)"
        raise InvalidConfigError(f"remote URL {shown} has unknown options {names}{hint}; "
                                 f"valid: {', '.join(TLS_OPTIONS + AUTH_OPTIONS)}.")
    tls_options = {key: value for key, value in options.items() if key in TLS_OPTIONS}
    if tls_options and not tls:
        raise InvalidConfigError(f"remote URL {shown} has TLS options but the scheme is not rediss://.")
    _check_tls(tls_options, shown)
    username = unquote(username) or options.get("username") or ""
    secret = unquote(url_password) or options.get("password") or password or None
    for name, text in (("username", username), ("password", secret)):
        if text is not None and not _utf8(text):
            raise InvalidConfigError(f"remote URL {shown}: the {name} holds a character that is not UTF-8 text (a "
                                     f"byte of another encoding, as a non-UTF-8 locale passes it); give the {name} "
                                     "as UTF-8 text (percent-encoded in the URL).")
    return RemoteURL(nodes=nodes, db=db, tls=tls, cluster=cluster, username=username or None, password=secret,
                     tls_options=tuple(sorted(tls_options.items())))


def _shows_username(username: str, beside_password: bool) -> bool:
    """Whether messages may show ``username``: a plain name given with a password (in the URL or apart, as
    ``$TIERKV_REDIS_PASSWORD``). A name alone (``redis://NAME@host``, ``redis://NAME:@host``) is as likely a password
    written in the username's place."""
    return beside_password and _NAME.fullmatch(username) is not None


def _check_tls(options: dict[str, str], shown: str) -> None:
    """The TLS options' values, checked here rather than by redis-py at the first command (where a typo would be
    a remote failure, not a configuration error): ``ssl_cert_reqs`` one of :data:`CERT_REQS` (normalised to lower
    case, as redis-py wants it), the files existing regular files."""
    reqs = options.get("ssl_cert_reqs")
    if reqs is not None:
        if reqs.lower() not in CERT_REQS:
            raise InvalidConfigError(f"remote URL {shown}: ssl_cert_reqs must be one of {', '.join(CERT_REQS)} (got "
                                     f"{reqs!r}).")
        options["ssl_cert_reqs"] = reqs.lower()
    for key in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"):
        path = options.get(key)
        if path is not None and not os.path.isfile(path):
            raise InvalidConfigError(f"remote URL {shown}: {key}={path!r} is not a file; give the path of the PEM "
                                     "file (percent-encoded in the URL).")
    _load_tls(options, shown)


def _load_tls(options: dict[str, str], shown: str) -> None:
    """Load the TLS files as the connection will (into an ``ssl`` context), so a file that is no PEM certificate,
    a key that does not match its certificate or a certificate without its key is a configuration error naming
    the file, not an unreachable server at the first command."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca, cert, key = (options.get(name) for name in ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile"))
    if ca is not None:
        try:
            context.load_verify_locations(cafile=ca)
        except (ssl.SSLError, OSError, ValueError) as exc:
            raise InvalidConfigError(f"remote URL {shown}: ssl_ca_certs={ca!r} holds no usable PEM certificate "
                                     f"({exc}); give the CA certificate that signed the server's (-----BEGIN "
                                     "CERTIFICATE-----).") from None
    if key is not None and cert is None:
        raise InvalidConfigError(f"remote URL {shown}: ssl_keyfile={key!r} without ssl_certfile; a client key goes "
                                 "with its certificate: give ssl_certfile= too.")
    if cert is not None:
        try:
            context.load_cert_chain(cert, key, password=lambda: b"")  # an encrypted key fails, never prompts
        except (ssl.SSLError, OSError, ValueError) as exc:
            if key is None:
                problem = (f"ssl_certfile={cert!r} is not a PEM certificate followed by its private key ({exc}); "
                           "give the key with ssl_keyfile= (or a PEM holding both)")
            else:
                problem = (f"ssl_certfile={cert!r} and ssl_keyfile={key!r} do not load as a certificate and its "
                           f"unencrypted private key ({exc}): check that both are PEM and that the key is this "
                           "certificate's")
            raise InvalidConfigError(f"remote URL {shown}: {problem}.") from None


def _split(rest: str) -> tuple[str | None, str, str]:
    """``(userinfo or None, hosts[/db], query)`` of what follows ``scheme://``: the userinfo ends at the last
    ``@`` before the query (a password may hold ``/``, ``:`` or ``@``), the query at the first ``?`` after it."""
    before, question, after = rest.partition("?")
    if "@" in before:
        userinfo, _, hostpart = before.rpartition("@")
        return userinfo, hostpart, after
    return None, before, after


def _node(item: str, shown: str) -> tuple[str, int]:
    item = item.strip()
    if item.startswith("["):  # [IPv6]:port
        host, bracket, port = item[1:].partition("]")
        if not bracket or port and not port.startswith(":"):
            raise InvalidConfigError(f"remote URL {shown} has an unclosed '[' or text after its ']'; write an "
                                     "IPv6 address in brackets, then the port: redis://[::1]:6379/0.")
        if not _ipv6(host):
            raise InvalidConfigError(f"remote URL {shown} has something other than an IPv6 address in brackets; "
                                     "write redis://[::1]:6379/0, or a host name without brackets.")
        port = port.removeprefix(":")
    elif item.count(":") > 1 and not _ipv6(item):
        raise InvalidConfigError(f"remote URL {shown} has more than one ':port' on a host; give one port "
                                 "(host:6379), or an IPv6 address in brackets ([::1]:6379).")
    elif item.count(":") == 1:
        host, port = item.split(":")
    else:
        host, port = item, ""
    if not host:
        raise InvalidConfigError(f"remote URL {shown} has an empty host; {_EXAMPLE} ({_ENCODE}).")
    _check_host(host, shown)
    if not port:
        return host, DEFAULT_PORT
    if not _number(port) or not 0 < int(port) < 65536:
        raise InvalidConfigError(f"remote URL {shown} has a bad port; a port is 1-65535 (a password goes before "
                                 f"an '@': redis://:password@host:6379/0; {_ENCODE}).")
    return host, int(port)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _ipv6(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return True


def _check_host(host: str, shown: str) -> None:
    """Refuse a host the resolver cannot take (an empty or over-63-character label, a leading dot): it would
    fail only at the first command, inside the socket's IDNA encoding, not as a configuration error."""
    if ":" in host:
        return  # an IPv6 address, checked by the caller
    try:
        encoded = host.encode("idna")
    except UnicodeError:
        encoded = b""
    labels = encoded.removesuffix(b".").split(b".")
    if not encoded or len(encoded) > 253 or not all(0 < len(label) < 64 for label in labels):
        raise InvalidConfigError(f"remote URL {shown} has a host that is no valid host name (an empty label such "
                                 "as '..' or a leading dot, or a label over 63 characters); give a name such as "
                                 "cache.internal, an IPv4 address or an IPv6 address in brackets ([::1]:6379).")


def _db(path: str, shown: str, cluster: bool) -> int:
    text = path.strip("/")
    if not text:
        return 0
    if not _number(text):
        raise InvalidConfigError(f"remote URL {shown} has a database path that is not a number; a database is a "
                                 "number (/0).")
    if cluster and int(text) != 0:
        raise InvalidConfigError(f"remote URL {shown}: Redis Cluster has only database 0.")
    return int(text)


def _number(text: str) -> bool:
    """ASCII digits only: ``str.isdigit`` also takes '²' (which ``int`` refuses) and fullwidth digits."""
    return text.isascii() and text.isdigit()


def _shown_scheme(scheme: str) -> str:
    return scheme if _SCHEME.fullmatch(scheme) else MASK


def _ambiguous(rest: str) -> bool:
    """An ``@`` after the first ``?``: a password holding ``?``, or a query value holding ``@`` — no reading
    of it is safe to act on or to print."""
    return "@" in rest.partition("?")[2]


def redact(url: str) -> str:
    """``url`` for a message, whether or not it parses: the scheme if it looks like one, the userinfo masked
    (a plain username kept), the hosts and database, and the query with every value but a TLS option's
    masked; an ambiguous URL (:func:`_ambiguous`) shows only its scheme."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    shown_scheme = _shown_scheme(scheme) + sep if sep else ""
    if _ambiguous(rest):
        return f"{shown_scheme}{MASK}"
    userinfo, hostpart, query = _split(rest)
    auth = ""
    if userinfo is not None:
        user, _, password = userinfo.partition(":")
        auth = f"{user}:{MASK}@" if password and (not user or _shows_username(user, True)) else f"{MASK}@"
    if "?" in rest:
        pairs = []
        for (key, value), hidden in _pairs(query):
            if hidden:
                pairs.append(MASK)
            else:
                pairs.append(f"{key}={value}" if key in TLS_OPTIONS else f"{key}={MASK}")
        query = "?" + "&".join(pairs)
    hosts, slash, path = hostpart.partition("/")
    hosts = ",".join(_shown_node(item) for item in hosts.split(","))
    path = path if _number(path.strip("/")) or not path else MASK
    return f"{shown_scheme}{auth}{hosts}{slash}{path}{query}"


def _shown_node(item: str) -> str:
    """A host of a message: its port masked unless it is a number (a misplaced password would land there)."""
    host, colon, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
    return f"{host}:{port if _number(port) else MASK}" if colon else item


def secrets(url: str) -> set[str]:
    """Every string of ``url`` that some reading of it takes for a password, as written and decoded: after
    the ``:`` of the userinfo (ending at the last ``@``, or at the last ``@`` before the query), a userinfo
    that is no plain name, a ``password=`` or ``username=`` value, a query item without ``=``."""
    found: set[str] = set()
    rest = url.partition("://")[2] or url
    for userinfo in (rest.rpartition("@")[0], rest.partition("?")[0].rpartition("@")[0]):
        user, _, password = userinfo.partition(":")
        found |= {password}
        # a name alone may be a password in the wrong place; one of letters only (a word: "redis") stays readable
        found |= {userinfo, user} if userinfo and not _shows_username(user, bool(password)) \
            and not user.isalpha() else set()
    for pair in re.split("[&;]", rest.partition("?")[2]):
        key, equals, value = pair.partition("=")
        found |= {value} if key in AUTH_OPTIONS else set() if equals else {key}
    found |= {unquote(text) for text in found}
    return {text for text in found if text}


def _pairs(query: str) -> list[tuple[tuple[str, str], bool]]:
    """Each ``key=value`` item of ``query``, and whether even its key may be part of a password: an item without
    ``=``, a key that is no option name, or an unknown key after a ``username=``/``password=`` item (a password
    holding ``&`` or ``;`` continues there)."""
    items = []
    after_secret = False
    for pair in re.split("[&;]", query):
        key, equals, value = pair.partition("=")
        known = key in TLS_OPTIONS or key in AUTH_OPTIONS
        items.append(((key, value), not equals or not _OPTION.fullmatch(key) or after_secret and not known))
        after_secret = after_secret or key in AUTH_OPTIONS
    return items


def scrub(text: str, url: str) -> str:
    """``text`` with every possible password of ``url`` (:func:`secrets`) masked."""
    return _mask(text, secrets(url))


def _mask(text: str, secrets: set[str]) -> str:
    forms = {form for secret in secrets for form in _forms(secret)}
    for secret in sorted(forms, key=len, reverse=True):  # longest first: a secret may contain another
        text = text.replace(secret, MASK)
    return text


def _forms(secret: str) -> set[str]:
    """``secret`` as written and as an exception's repr or message would quote it (escaped, or as bytes)."""
    forms = {secret, repr(secret)[1:-1], ascii(secret)[1:-1], secret.encode("unicode_escape").decode("ascii")}
    for encoding in ("utf-8", "latin-1"):
        with contextlib.suppress(UnicodeEncodeError):  # a character latin-1 lacks
            forms.add(repr(secret.encode(encoding, "surrogateescape"))[2:-1])
    return {form for form in forms if form}
