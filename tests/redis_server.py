"""A real ``redis-server`` for the remote-tier tests: loopback, an ephemeral port, no persistence.

Each :class:`RedisServer` is a child process started from the Debian package's binary (``.ci/run`` installs
it), bound to 127.0.0.1 only, with ``--save ''`` and ``--appendonly no`` so nothing is written outside the
test's temporary directory. Tests can kill it (SIGKILL) mid-run and start it again on the same port,
pause it (``CLIENT PAUSE``) or freeze it (SIGSTOP), and build it with ``maxmemory`` and an eviction policy.
The fixtures skip with a reason only when ``redis-server`` (or redis-py) is not installed.

    def test_x(redis_server):                   # one server per test, default settings
        store = RemoteBlockStore(redis_server.url, ...)

    def test_y(redis_factory):                  # variants
        server = redis_factory(maxmemory="2mb", policy="allkeys-lru")
"""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

START_TIMEOUT_S = 10.0


def _free_port() -> int:
    """A port the kernel just handed out on loopback (closed again; redis binds it right after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """One ``redis-server`` child process on ``127.0.0.1:port``.

    Args:
        directory: its working directory (nothing is persisted there; redis needs one).
        maxmemory: e.g. ``"2mb"``; None: unlimited.
        policy: ``maxmemory-policy`` (``noeviction``, ``allkeys-lru`` ...).
        extra: more ``--option value`` arguments (e.g. TLS or cluster settings).
        password: ``requirepass``; clients then need it.
    """

    def __init__(self, directory: Path, maxmemory: str | None = None, policy: str = "noeviction",
                 extra: tuple[str, ...] = (), password: str | None = None, port: int | None = None,
                 tls: Path | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.maxmemory = maxmemory
        self.policy = policy
        self.extra = extra
        self.password = password
        self.port = port or _free_port()
        self.tls = tls  # a folder from make_tls_files(): the server speaks TLS only
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        if self.tls:
            return f"rediss://{auth}127.0.0.1:{self.port}/0?ssl_ca_certs={self.tls / 'ca.crt'}"
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                "--save", "", "--appendonly", "no", "--dir", str(self.directory), "--protected-mode", "yes",
                "--maxmemory-policy", self.policy, "--loglevel", "warning",
                "--logfile", str(self.directory / "redis.log")]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory]
        if self.password:
            argv += ["--requirepass", self.password]
        if self.tls:
            argv += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(self.tls / "server.crt"),
                     "--tls-key-file", str(self.tls / "server.key"), "--tls-ca-cert-file", str(self.tls / "ca.crt"),
                     "--tls-auth-clients", "no"]
        return argv + list(self.extra)

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING (a port taken meanwhile: one more try on another,
        unless the port was fixed by a restart)."""
        for attempt in range(3):
            self.process = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            if self._wait_ready():
                return self
            self.stop()
            if attempt == 2:
                break
            time.sleep(0.2)
        log = self.directory / "redis.log"
        raise RuntimeError(f"redis-server did not answer PING on port {self.port}: "
                           f"{log.read_text()[-2000:] if log.exists() else 'no log'}")

    def _wait_ready(self) -> bool:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(Exception):
                if self.client(timeout=0.5).ping():
                    return True
            time.sleep(0.02)
        return False

    def client(self, timeout: float = 5.0):
        """A raw redis-py client (for tests that overwrite, evict or inspect values behind the tier's back)."""
        import redis

        # the host name is not checked here: a test may serve a certificate for another name on purpose
        tls = dict(ssl=True, ssl_ca_certs=str(self.tls / "ca.crt"), ssl_check_hostname=False) if self.tls else {}
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=timeout,
                           socket_connect_timeout=timeout, protocol=2, **tls)  # RESP2: works without HELLO

    def kill(self) -> None:
        """SIGKILL, as a crashed or partitioned server would go: clients see reset connections."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()
        if self.process.stderr is not None:
            self.process.stderr.close()
        self.process = None

    def restart(self) -> RedisServer:
        """A fresh, empty server on the same port (what a client sees after the server came back)."""
        self.kill()
        self.stop()
        return self.start()

    @contextlib.contextmanager
    def frozen(self) -> Iterator[None]:
        """SIGSTOP for the block, then SIGCONT: a host that stopped answering while its connections stay open."""
        assert self.process is not None
        self.process.send_signal(signal.SIGSTOP)
        try:
            yield
        finally:
            self.process.send_signal(signal.SIGCONT)

    def pause(self, seconds: float) -> None:
        """``CLIENT PAUSE``: the server holds every client's commands for ``seconds`` (a slow server)."""
        self.client().execute_command("CLIENT", "PAUSE", int(seconds * 1000), "ALL")


def make_tls_files(directory: Path, names: str = "IP:127.0.0.1") -> Path:
    """A throw-away CA and a server certificate for ``names`` (its subjectAltName: 127.0.0.1 by default; e.g.
    ``"DNS:elsewhere.invalid"`` for a certificate of another host) signed by it (``openssl``), in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=directory, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=tierkv-test-ca",
            "-addext", "keyUsage=critical,keyCertSign,cRLSign", "-keyout", "ca.key", "-out", "ca.crt")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=127.0.0.1", "-keyout", "server.key",
            "-out", "server.csr")
    # what Python 3.13's default context requires (VERIFY_X509_STRICT): the CA's key usage (above), the server
    # certificate's authority key identifier
    (directory / "san.cnf").write_text(f"subjectAltName={names}\nauthorityKeyIdentifier=keyid,issuer\n"
                                       "basicConstraints=CA:FALSE\n")
    openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-days", "2", "-extfile", "san.cnf", "-out", "server.crt")
    return directory


class RedisCluster:
    """``masters`` cluster-enabled servers on loopback joined by ``redis-cli --cluster create`` (no replicas)."""

    def __init__(self, directory: Path, masters: int = 3) -> None:
        self.servers = []
        for i in range(masters):
            bus = _free_port()
            self.servers.append(RedisServer(directory / f"node-{i}", extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf", "--cluster-port", str(bus),
                "--cluster-node-timeout", "2000")))

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(f"127.0.0.1:{server.port}" for server in self.servers[:2])

    def start(self) -> RedisCluster:
        for server in self.servers:
            server.start()
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{s.port}" for s in self.servers),
                        "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            states = [server.client().execute_command("CLUSTER", "INFO") for server in self.servers]
            if all(b"cluster_state:ok" in state for state in states):
                return self
            time.sleep(0.1)
        raise RuntimeError(f"the test cluster did not reach cluster_state:ok: {states}")

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _skip_without_redis() -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed (Debian: apt-get install redis-server; .ci/run installs it)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install -e '.[redis]')")


@pytest.fixture
def redis_factory(tmp_path) -> Iterator:
    """Build and start servers with settings; every one is stopped at the end of the test."""
    _skip_without_redis()
    servers: list[RedisServer] = []

    def make(**options) -> RedisServer:
        server = RedisServer(tmp_path / f"redis-{len(servers)}", **options)
        servers.append(server)
        return server.start()

    yield make
    for server in servers:
        server.stop()


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator[RedisCluster]:
    """A 3-primary Redis Cluster on loopback (no replicas)."""
    _skip_without_redis()
    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli is not installed (Debian: redis-tools, a dependency of redis-server)")
    cluster = RedisCluster(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture
def redis_server(redis_factory) -> RedisServer:
    """One server with default settings (unlimited memory, no eviction)."""
    return redis_factory()
