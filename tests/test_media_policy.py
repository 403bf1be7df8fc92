"""The media fetch policy in process: static URL checks, and real fetches from local HTTP servers.

Servers listen on 127.0.0.1 only; names resolve through the system resolver (``localhost``) or an
in-process override of :func:`omni_serve.media.policy.resolve`. Each server's request log shows what
was fetched: a refused target must never see a request.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from omni_serve.media import policy as media_policy
from omni_serve.media.policy import MediaPolicy, address_allowed, check_url, fetch
from tests import media
from tests.conftest import HTTP_PORT
from tests.media import MediaServer, png

ALLOWED_PORT = HTTP_PORT + 50  # the allowed media server
PRIVATE_PORT = HTTP_PORT + 51  # a loopback server nothing may reach
PARAM = "messages.0.content.1"
LIMIT = 64 << 10


@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[MediaServer, MediaServer]]:
    with MediaServer(ALLOWED_PORT) as allowed, MediaServer(PRIVATE_PORT) as private:
        yield allowed, private


@pytest.fixture
def policy(tmp_path: Path) -> MediaPolicy:
    return MediaPolicy(
        allowed_domains=["127.0.0.1", "localhost", "media.test", "*.cdn.test"],
        allowed_schemes=["http"],
        allowed_addresses=[f"127.0.0.1:{ALLOWED_PORT}"],
        allowed_local_dir=str(tmp_path),
        max_redirects=2,
        connect_timeout_s=2,
        read_timeout_s=1,
        fetch_timeout_s=2,
    )


def refused(call, status: int = 400) -> str:
    return media.refused(call, PARAM, status)


def get(url: str, policy: MediaPolicy, max_bytes: int = LIMIT) -> bytes:
    return asyncio.run(fetch(url, PARAM, policy, max_bytes))


# --- static checks -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("ftp://media.test/cat.png", "scheme 'ftp'"),
        ("gopher://media.test/", "scheme 'gopher'"),
        ("javascript:alert(1)", "scheme 'javascript'"),
        ("https://media.test/cat.png", "https: URLs are not accepted"),
        ("http://elsewhere.test/cat.png", "not in the server's media allow-list"),
        ("http://cdn.test/cat.png", "not in the server's media allow-list"),  # *.cdn.test: subdomains only
        ("http://evilcdn.test/cat.png", "not in the server's media allow-list"),
        ("http://169.254.169.254/latest/meta-data/", "allow-list"),
        ("http://user:pw@media.test/cat.png", "credentials"),
        ("http://media.test@127.0.0.2/cat.png", "credentials"),
        (f"http://127.0.0.1:{PRIVATE_PORT}/cat.png", "not a public address"),  # allow-listed host, private address
        ("http://médiä.test/cat.png", "ASCII"),
        ("http://media.test/" + "a" * 9000, "longer than"),
        ("http://[::1", "invalid URL"),
        ("file:///etc/passwd", "outside the server's media directory"),
        ("file://remote.test/etc/passwd", "local path"),
    ],
)
def test_urls_refused_before_any_io(url: str, why: str, policy: MediaPolicy) -> None:
    assert why in str(refused(lambda: check_url(url, PARAM, policy)))


def test_literal_and_mapped_addresses(policy: MediaPolicy) -> None:
    private = [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "100.100.100.200",
        "0.0.0.0",
        "224.0.0.1",
        "::1",
        "fe80::1",
        "fd00:ec2::254",
        "::ffff:127.0.0.1",
        "::ffff:10.0.0.1",
    ]
    for text in private:
        assert not address_allowed(ipaddress.ip_address(text), 80, policy), text
    assert address_allowed(ipaddress.ip_address("93.184.216.34"), 443, policy)  # public: no I/O in this check
    assert address_allowed(ipaddress.ip_address("127.0.0.1"), ALLOWED_PORT, policy)  # the explicit exception
    assert not address_allowed(ipaddress.ip_address("127.0.0.1"), PRIVATE_PORT, policy)  # ... for its port only
    network = policy.model_copy(update={"allowed_addresses": ["10.8.0.0/16", "[::1]:8080"]})
    assert address_allowed(ipaddress.ip_address("10.8.3.4"), 1, network)
    assert not address_allowed(ipaddress.ip_address("10.9.0.1"), 1, network)
    assert address_allowed(ipaddress.ip_address("::1"), 8080, network)
    assert not address_allowed(ipaddress.ip_address("::1"), 8081, network)
    with pytest.raises(ValueError, match="not an IP"):
        MediaPolicy(allowed_addresses=["localhost:80"])


def test_defaults_fetch_nothing_remote_or_local() -> None:
    default = MediaPolicy()
    assert "allow-list" in str(refused(lambda: check_url("https://example.com/cat.png", PARAM, default)))
    assert "file: URLs are not accepted" in str(refused(lambda: check_url("file:///tmp/cat.png", PARAM, default)))
    assert "http: URLs are not accepted" in str(refused(lambda: check_url("http://example.com/a", PARAM, default)))


# --- fetches from real local servers ----------------------------------------------------------


def test_allowed_fetch_returns_the_body(servers, policy: MediaPolicy) -> None:
    allowed, _ = servers
    body = png()
    url = allowed.route("/cat.png", body, headers={"Content-Type": "text/html"})  # headers are not trusted
    assert get(url, policy) == body
    assert get(f"http://localhost:{ALLOWED_PORT}/cat.png", policy) == body  # the name resolves to the exception


def test_names_resolving_to_private_addresses_are_never_connected(servers, policy, monkeypatch) -> None:
    allowed, private = servers
    private.route("/secret", b"secret")
    seen: list[str] = []

    async def resolver(host: str, port: int, policy: MediaPolicy, param: str) -> list:
        seen.append(host)
        table = {"media.test": ["10.0.0.5"], "a.cdn.test": ["93.184.216.34", "127.0.0.1"], "b.cdn.test": ["127.0.0.1"]}
        return [ipaddress.ip_address(a) for a in table[host]]

    before = list(private.requests)
    assert "resolves to 127.0.0.1" in str(refused(lambda: get(f"http://localhost:{PRIVATE_PORT}/secret", policy)))
    monkeypatch.setattr(media_policy, "resolve", resolver)
    assert "resolves to 10.0.0.5" in str(refused(lambda: get("http://media.test/secret", policy)))
    # One private address among public ones refuses the host: no address of it is tried.
    assert "resolves to 127.0.0.1" in str(refused(lambda: get(f"http://a.cdn.test:{PRIVATE_PORT}/secret", policy)))
    # The connection goes to the address that was checked (resolved once), not to a second lookup.
    allowed.route("/by-name.png", b"named")
    assert get(f"http://b.cdn.test:{ALLOWED_PORT}/by-name.png", policy) == b"named"
    assert seen == ["media.test", "a.cdn.test", "b.cdn.test"]
    assert private.requests == before


def test_redirects_are_checked_hop_by_hop(servers, policy: MediaPolicy) -> None:
    allowed, private = servers
    private.route("/secret", b"secret")
    before = list(private.requests)
    body = png(seed=3)
    allowed.route("/cat.png", body)
    ok = allowed.route("/moved", status=302, headers={"Location": "/cat.png"})
    assert get(ok, policy) == body
    # Each refusal names the hop check that made it: any of these hops, unchecked, would still end in
    # some 400 (the connect-time address check, or the fetch's catch-all for what httpcore cannot do).
    inside = Path(policy.allowed_local_dir, "cat.png")
    inside.write_bytes(body)
    for n, (target, why) in enumerate(
        [
            (f"http://127.0.0.1:{PRIVATE_PORT}/secret", "address 127.0.0.1 is not a public address"),
            (f"http://localhost:{PRIVATE_PORT}/secret", "host 'localhost' resolves to"),  # checked at connect
            ("http://169.254.169.254/latest/meta-data/", "host '169.254.169.254' is not in the server's media"),
            ("http://10.0.0.1/secret", "host '10.0.0.1' is not in the server's media allow-list"),
            ("file:///etc/passwd", "file: URL outside the server's media directory"),
            (inside.as_uri(), "redirect to a file: URL"),  # a path the policy would serve, but not via a redirect
            ("ftp://127.0.0.1/secret", "URL scheme 'ftp' is not accepted"),
        ]
    ):
        url = allowed.route(f"/to/{n}", status=307, headers={"Location": target})
        assert why in refused(lambda url=url: get(url, policy)), target
    loop = allowed.route("/loop", status=301, headers={"Location": "/loop"})
    assert "more than 2 redirects" in str(refused(lambda: get(loop, policy)))
    assert private.requests == before


def test_size_and_time_limits(servers, policy: MediaPolicy) -> None:
    allowed, _ = servers
    declared = allowed.route("/big", b"x" * (LIMIT + 1))
    assert "over the limit" in str(refused(lambda: get(declared, policy), 413))
    chunked = allowed.route("/big-undeclared", b"x" * (LIMIT + 1), headers={"Content-Length": ""})
    assert "over the limit" in str(refused(lambda: get(chunked, policy), 413))
    drip = allowed.route("/drip", b"y" * 100, drip_s=0.2)  # each read succeeds; the whole takes 20 s
    assert "longer than 2 s" in str(refused(lambda: get(drip, policy)))
    stall = allowed.route("/stall", b"z", stall_s=5)
    assert "ReadTimeout" in str(refused(lambda: get(stall, policy)))
    missing = allowed.route("/gone", b"", status=404)
    assert "HTTP 404" in str(refused(lambda: get(missing, policy)))
    assert get(allowed.route("/empty", b""), policy) == b""  # empty is the decoder's refusal, not the fetcher's


def test_local_files_only_under_the_media_directory(policy: MediaPolicy, tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(b"png bytes")
    (tmp_path / "escape").symlink_to("/etc/passwd")
    (tmp_path / "dir").mkdir()
    assert get(f"file://{tmp_path}/cat.png", policy) == b"png bytes"
    assert "outside" in str(refused(lambda: get(f"file://{tmp_path}/escape", policy)))
    assert "outside" in str(refused(lambda: get(f"file://{tmp_path}/../../etc/passwd", policy)))
    assert "regular file" in str(refused(lambda: get(f"file://{tmp_path}/dir", policy)))
    assert "cannot be read" in str(refused(lambda: get(f"file://{tmp_path}/missing.png", policy)))
    (tmp_path / "big.png").write_bytes(b"x" * (LIMIT + 1))
    assert "over the limit" in str(refused(lambda: get(f"file://{tmp_path}/big.png", policy), 413))
    assert os.path.exists("/etc/passwd")


# --- Python 3.10's asyncio (requires-python allows it) -----------------------------------------


class _Py310TimeoutError(Exception):
    """Python 3.10's ``asyncio.TimeoutError``: its own class, not the builtin ``TimeoutError`` (equal from 3.11)."""


@pytest.fixture
def python310_timeouts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Time limits that raise as on Python 3.10: ``asyncio.wait_for`` and ``async_timeout`` raise
    ``asyncio.TimeoutError``, which there is not the builtin, so ``except TimeoutError`` misses it."""
    import contextlib

    monkeypatch.setattr(asyncio, "TimeoutError", _Py310TimeoutError)
    monkeypatch.setattr(asyncio.exceptions, "TimeoutError", _Py310TimeoutError)  # what wait_for raises

    @contextlib.asynccontextmanager
    async def timeout(delay: float):  # async_timeout.timeout on 3.10
        try:
            async with asyncio.timeout(delay):
                yield
        except TimeoutError:
            raise _Py310TimeoutError() from None

    monkeypatch.setattr(media_policy, "_timeout", timeout)


def test_a_slow_media_server_is_a_400_naming_the_part_on_python_310(servers, policy, python310_timeouts) -> None:
    """Was a 500: the fetch's time limit raised 3.10's asyncio.TimeoutError past ``except TimeoutError``."""
    allowed, _ = servers
    drip = allowed.route("/drip-310", b"y" * 100, drip_s=0.2)  # each read succeeds; the whole takes 20 s
    assert "longer than 2 s" in str(refused(lambda: get(drip, policy)))


def test_a_resolver_that_never_answers_is_a_400_naming_the_part_on_python_310(policy, python310_timeouts) -> None:
    class Hanging(asyncio.SelectorEventLoop):
        async def getaddrinfo(self, *args, **kwargs):  # type: ignore[override]
            await asyncio.sleep(3600)

    def resolve() -> None:
        loop = Hanging()
        try:
            loop.run_until_complete(media_policy.resolve("media.test", 80, policy, PARAM))
        finally:
            loop.close()

    assert "does not resolve" in str(refused(resolve))
