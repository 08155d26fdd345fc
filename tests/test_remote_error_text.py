"""A server's error text is untrusted: a hostile or broken Redis must not drive the operator's terminal or forge log
lines through tierkv's warnings, and the password stays masked in them."""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from collections.abc import Iterator

import pytest

from tierkv.remote import parse_remote_url
from tierkv.remote.connection import RemoteConnection

PASSWORD = "hunter2-pw"
HOSTILE = f"ERR \x1b[2J\x1b]0;pwned-title\x07\rINFO tierkv: all good (forged line) {PASSWORD}\x9b".encode()
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


@contextlib.contextmanager
def hostile_server() -> Iterator[int]:
    """A fake Redis on a free port that answers every command with an error reply holding terminal escapes, a
    carriage return before a forged log line, and the password; yields its port."""
    listener = socket.create_server(("127.0.0.1", 0))
    answered: list[socket.socket] = []

    def answer(connection: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := connection.recv(64 << 10):
                commands = data.count(b"\r\n*") + data.startswith(b"*")  # RESP arrays at line starts
                connection.sendall((b"-" + HOSTILE + b"\r\n") * commands)

    def accept() -> None:
        with contextlib.suppress(OSError):  # the listener closed: the test is over
            while True:
                connection, _ = listener.accept()
                answered.append(connection)
                threading.Thread(target=answer, args=(connection,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() (Linux), which close() alone does not
        listener.close()
        thread.join(timeout=10)
        for connection in answered:
            connection.close()


@pytest.mark.parametrize("auth", [False, True], ids=["refused-command", "refused-auth"])
def test_a_servers_error_text_is_logged_without_control_characters(auth: bool, caplog) -> None:
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[redis]')")
    caplog.set_level(logging.INFO, logger="tierkv")
    with hostile_server() as port:
        credentials = f":{PASSWORD}@" if auth else ""
        connection = RemoteConnection(parse_remote_url(f"redis://{credentials}127.0.0.1:{port}/0"), backoff_s=0.05)
        try:
            assert connection.run(lambda client: client.get("k"), "miss") == "miss"
        finally:
            connection.close()
    messages = [record.getMessage() for record in caplog.records if record.name.startswith("tierkv")]
    assert any("pwned-title" in message for message in messages), messages  # the server's text was logged
    for message in messages:
        assert not CONTROL.search(message), repr(message)
        assert not auth or PASSWORD not in message, message  # the URL's password is masked in the server's text
