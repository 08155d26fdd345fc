"""Remote-tier URLs, the password setting and the value framing: parsing and checks, no server needed."""

from __future__ import annotations

import re

import pytest
from redis_server import make_tls_files

from tierkv import settings
from tierkv.errors import InvalidConfigError
from tierkv.remote.framing import HEADER, frame, unframe
from tierkv.remote.url import parse_remote_url, redact, scrub


def test_single_server_urls(tmp_path) -> None:
    url = parse_remote_url("redis://cache.internal:6380/3")
    assert (url.nodes, url.db, url.tls, url.cluster, url.password) == ((("cache.internal", 6380),), 3, False, False,
                                                                      None)
    assert parse_remote_url("redis://localhost").nodes == (("localhost", 6379),)
    assert parse_remote_url("redis://[::1]:7000/0").nodes == (("::1", 7000),)
    ca = make_tls_files(tmp_path) / "ca.crt"
    tls = parse_remote_url(f"rediss://alice:s%40cret@h:6390/1?ssl_ca_certs={ca}&ssl_cert_reqs=REQUIRED")
    assert tls.tls and tls.username == "alice" and tls.password == "s@cret"
    assert dict(tls.tls_options) == {"ssl_ca_certs": str(ca), "ssl_cert_reqs": "required"}  # as redis-py wants it


def test_cluster_urls() -> None:
    url = parse_remote_url("redis+cluster://:pw@10.0.0.1:7000,10.0.0.2:7001,10.0.0.3")
    assert url.cluster and not url.tls and url.password == "pw"
    assert url.nodes == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("10.0.0.3", 6379))
    assert parse_remote_url("rediss+cluster://h1:7000").tls


def test_tls_files_are_loaded_when_the_url_is_parsed(tmp_path) -> None:
    """A TLS file that would fail the first connection fails the URL instead, naming the file and the problem."""
    tls = make_tls_files(tmp_path)
    ca, cert, key, other = (str(tls / name) for name in ("ca.crt", "server.crt", "server.key", "ca.key"))
    base = f"rediss://h:1/0?ssl_ca_certs={ca}"
    assert parse_remote_url(f"{base}&ssl_certfile={cert}&ssl_keyfile={key}").tls
    for query, problem in [(f"ssl_ca_certs={key}", f"ssl_ca_certs='{key}' holds no usable PEM certificate"),
                           (f"ssl_ca_certs={tls / 'san.cnf'}", "holds no usable PEM certificate"),
                           (f"ssl_ca_certs={ca}&ssl_certfile={cert}", "give the key with ssl_keyfile="),
                           (f"ssl_ca_certs={ca}&ssl_certfile={cert}&ssl_keyfile={other}", "KEY_VALUES_MISMATCH"),
                           (f"ssl_ca_certs={ca}&ssl_keyfile={key}", "without ssl_certfile")]:
        with pytest.raises(InvalidConfigError, match=re.escape(problem)):
            parse_remote_url(f"rediss://h:1/0?{query}")


def test_password_from_the_url_wins_over_the_setting() -> None:
    assert parse_remote_url("redis://h:1/0", password="env").password == "env"
    assert parse_remote_url("redis://:url@h:1/0", password="env").password == "url"


@pytest.mark.parametrize(("url", "problem"), [
    ("localhost:6379", "is not a Redis URL"),
    ("http://h:6379", "scheme 'http' is not one of"),
    ("redis://h1:1,h2:2", r"use redis\+cluster://"),
    ("redis://h:99999", "a port is 1-65535"),
    ("redis://:6379", "empty host"),
    ("redis://h:1/db0", "a database is a number"),
    ("redis+cluster://h:1/2", "only database 0"),
    ("redis://h:1/0?ssl_ca_certs=/x", "not rediss://"),
    ("rediss://h:1/0?timeout=3", "unknown options timeout"),
    ("redis://h:\u00b2/0", "a port is 1-65535"),  # str.isdigit() takes '²', int() does not
    ("redis://h:\uff16\uff13\uff17\uff19/0", "a port is 1-65535"),  # fullwidth 6379 is not a port either
    ("redis://h:1/\u00b3", "a database is a number"),
    ("rediss://h:1/0?ssl_cert_reqs=requird", "ssl_cert_reqs must be one of required, optional, none"),
    ("rediss://h:1/0?ssl_ca_certs=/nonexistent/ca.pem", "ssl_ca_certs='/nonexistent/ca.pem' is not a file"),
    ("redis://a..b:6379/0", "no valid host name"),  # the resolver's IDNA encoding would fail at the first command
    ("redis://" + "x" * 64 + ".example:6379/0", "a label over 63 characters"),
    ("redis://.leadingdot:6379/0", "no valid host name"),
    ("redis+cluster://h1:7000,a..b:7001", "no valid host name"),
    ("redis://h:6379:6380/0", "more than one ':port'"),
    ("redis://[::1:6379/0", r"an unclosed '\['"),
    ("redis://[::1]x/0", "text after its ']'"),
    ("redis://[cache.internal]:6379/0", "other than an IPv6 address in brackets"),
])
def test_bad_urls_name_the_problem(url: str, problem: str) -> None:
    with pytest.raises(InvalidConfigError, match=problem):
        parse_remote_url(url)


def test_passwords_are_never_printed(monkeypatch: pytest.MonkeyPatch) -> None:
    url = parse_remote_url("rediss://bob:hunter2@h:6380/0")
    assert "hunter2" not in url.redacted() and "hunter2" not in repr(url)
    assert url.redacted() == "rediss://bob:***@h:6380/0"
    with pytest.raises(InvalidConfigError) as info:
        parse_remote_url("redis://:hunter2@h1:1,h2:2/0")
    assert "hunter2" not in str(info.value)
    monkeypatch.setenv("TIERKV_REDIS_PASSWORD", "hunter2")
    assert settings.get("redis_password") == "hunter2"
    assert settings.source("redis_password") == "TIERKV_REDIS_PASSWORD=***"
    assert settings.describe()["redis_password"] == ("***", "TIERKV_REDIS_PASSWORD=***")
    with settings.override(redis_password="other"):
        assert settings.get("redis_password") == "other" and "other" not in settings.source("redis_password")


@pytest.mark.parametrize("url", ["redis://hunter2:@h:1/0", "redis://hunter2@h:1/0", "redis://h:1/0?username=hunter2",
                                 "redis+cluster://hunter2:@h1:1,h2:2"])
def test_a_username_without_a_password_is_not_printed(url: str) -> None:
    """A password written where the username goes (``redis://SECRET:@host``) is sent as the username; messages
    show a username only beside a password, so such a one is masked in every display of the URL."""
    parsed = parse_remote_url(url)
    assert parsed.username == "hunter2"  # still sent as given: an ACL user with nopass authenticates this way
    for shown in (parsed.redacted(), repr(parsed), redact(url), scrub(f"AUTH failed for {url}", url)):
        assert "hunter2" not in shown, shown
    assert parse_remote_url("redis://alice:pw@h:1/0").redacted() == "redis://alice:***@h:1/0"
    assert redact("redis://alice:pw@h:1/0") == "redis://alice:***@h:1/0"
    # a password given apart (the documented $TIERKV_REDIS_PASSWORD pattern) makes the name a username
    assert parse_remote_url("redis://alice@h:1/0", password="pw").redacted() == "redis://alice:***@h:1/0"
    with pytest.raises(InvalidConfigError) as info:  # a word as the name: the message stays readable
        parse_remote_url("redis://redis@localhost:63x79/0")
    assert str(info.value).startswith("remote URL redis://***@localhost"), info.value


def test_valid_hosts_still_parse() -> None:
    for host in ("localhost", "cache.internal.", "my_cache-1.example", "10.0.0.5", "x" * 63 + ".example"):
        assert parse_remote_url(f"redis://{host}:6379/0").nodes == ((host, 6379),)
    assert parse_remote_url("redis://::1/0").nodes == (("::1", 6379),)  # a bare IPv6 address: the default port


def test_a_bad_host_error_masks_the_password() -> None:
    with pytest.raises(InvalidConfigError, match="no valid host name") as info:
        parse_remote_url("redis://:hunter2@a..b:6379/0")
    assert "hunter2" not in str(info.value) and "cache.internal" in str(info.value)  # the problem and the fix


def test_an_unknown_option_after_the_password_is_not_shown() -> None:
    """A password holding ``&`` continues into what parses as the next option: its name is not printed."""
    for url in ("redis://h:1/0?password=ab&hx7secretword9=1", "redis://h:1/0?password=ab&Hx7Secretword9=1",
                "redis://h:1/0?password=ab&hx%37secretword9=1"):
        with pytest.raises(InvalidConfigError, match="unknown options") as info:
            parse_remote_url(url)
        assert "secretword" not in str(info.value).lower() and "%26 for &" in str(info.value)
    with pytest.raises(InvalidConfigError, match="unknown options timeout"):  # no password: the name helps
        parse_remote_url("redis://h:1/0?timeout=3")


def test_framing_detects_any_change_and_the_wrong_key() -> None:
    key, payload = b"0123456789abcdef", bytes(range(256)) * 4
    value = frame(key, payload)
    assert len(value) == HEADER.size + len(payload)
    assert bytes(unframe(key, value)) == payload
    assert unframe(b"another-key-0000", value) is None
    for offset in (0, 5, 13, HEADER.size, len(value) - 1):  # magic, length, checksum, payload
        flipped = bytearray(value)
        flipped[offset] ^= 0x01
        assert unframe(key, bytes(flipped)) is None
    assert unframe(key, value[:-1]) is None and unframe(key, value[:7]) is None and unframe(key, b"") is None
