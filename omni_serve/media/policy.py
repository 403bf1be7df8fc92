"""The media fetch policy: which URLs a request's media may come from, and the fetch that enforces it.

``data:`` URLs (and ``input_audio``) are always accepted: the bytes are in the request. Everything
else is refused unless the graph's ``media_policy`` allows it, and the entry stage fetches it:

- ``http(s)``: the scheme is in ``allowed_schemes`` and the host in ``allowed_domains`` (a name, an IP
  literal, or ``*.example.com`` for its subdomains). After DNS resolution every address of the host
  must be a public unicast address: loopback, private, link-local (the cloud metadata address
  169.254.169.254 is one), shared (100.64/10), reserved, multicast and unspecified addresses are
  refused unless ``allowed_addresses`` names them (``IP``, ``IP:port``, ``[IPv6]:port`` or a CIDR
  network), IPv4-mapped IPv6 addresses as the IPv4 address they map.
- The connection goes to the address that was checked: the resolution happens inside the HTTP
  client's network backend, right before it connects, so a second DNS answer cannot swap the target
  (no check-then-connect race). TLS still verifies the certificate of the host name.
- Redirects are followed by hand, at most ``max_redirects``, each hop checked like the first.
- Connect and read timeouts per operation, ``fetch_timeout_s`` for the whole download (a server
  that drips one byte at a time trips it), and the byte cap while streaming: a body is cut off the
  moment it passes ``MediaLimits.max_bytes`` (a declared ``Content-Length`` above it is refused first).
- ``file:`` URLs only under ``allowed_local_dir`` (after resolving symlinks), regular files only.
- What came back is never trusted from headers: :mod:`omni_serve.media.inputs` sniffs the bytes.

Every refusal is an :class:`~omni_serve.exceptions.InvalidStageInput` naming the content part
(``messages.<i>.content.<j>``): a 400, or 413 for size.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import socket
import stat
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal
from urllib.parse import unquote, urljoin, urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from omni_serve.exceptions import InvalidStageInput

if sys.version_info >= (3, 11):
    from asyncio import timeout as _timeout
else:  # pragma: no cover - Python 3.10
    from async_timeout import timeout as _timeout

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
MAX_URL_LENGTH = 8192
_REDIRECTS = frozenset({301, 302, 303, 307, 308})


class MediaPolicy(BaseModel):
    """Graph arg ``media_policy``: where media URLs may point. Defaults fetch nothing remote or local."""

    model_config = ConfigDict(extra="forbid")

    allowed_domains: list[str] = Field(
        default_factory=list,
        description="Hosts http(s) media may come from: exact names or IP literals, or '*.example.com' for its "
        "subdomains. Empty: no remote media (data URLs only).",
    )
    allowed_schemes: list[Literal["http", "https"]] = Field(
        default_factory=lambda: ["https"],  # type: ignore[arg-type]  # a list of the literal; mypy infers list[str]
        description="Remote URL schemes accepted (plain http only if listed).",
    )
    allowed_addresses: list[str] = Field(
        default_factory=list,
        description="Exceptions to the public-address rule: 'IP', 'IP:port', '[IPv6]:port' or a CIDR network. "
        "Only for hosts that are allow-listed too (e.g. an internal media server).",
    )
    allowed_local_dir: str | None = Field(
        None, description="file:// URLs are accepted only for regular files under this directory; None: never."
    )
    max_redirects: int = Field(3, ge=0, le=10, description="Redirect hops followed; each is checked like the URL.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Seconds to connect (per address tried).")
    read_timeout_s: float = Field(10.0, gt=0, description="Seconds one read of the response may wait.")
    fetch_timeout_s: float = Field(30.0, gt=0, description="Seconds the whole download may take, redirects included.")

    @field_validator("allowed_domains")
    @classmethod
    def _normalize_domains(cls, domains: list[str]) -> list[str]:
        return [d.strip().lower().rstrip(".").strip("[]") for d in domains if d.strip()]

    @field_validator("allowed_addresses")
    @classmethod
    def _parse_addresses(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            _address_rule(entry)  # raises ValueError naming the entry
        return entries

    @field_validator("allowed_local_dir")
    @classmethod
    def _absolute_dir(cls, path: str | None) -> str | None:
        if path is not None and not os.path.isabs(path):
            raise ValueError("must be an absolute path")
        return path


@dataclass(frozen=True)
class _AddressRule:
    network: ipaddress.IPv4Network | ipaddress.IPv6Network
    port: int | None


def _address_rule(entry: str) -> _AddressRule:
    text = entry.strip()
    try:
        if text.startswith("["):  # [IPv6]:port or [IPv6]
            host, _, rest = text[1:].partition("]")
            port = int(rest[1:]) if rest.startswith(":") else None
            return _AddressRule(ipaddress.ip_network(host), port)
        if text.count(":") == 1:  # IPv4:port
            host, port_text = text.split(":")
            return _AddressRule(ipaddress.ip_network(host), int(port_text))
        return _AddressRule(ipaddress.ip_network(text, strict=False), None)
    except ValueError:
        raise ValueError(f"'{entry}' is not an IP, IP:port, [IPv6]:port or CIDR network") from None


def _refused(param: str, message: str, status: int = 400) -> InvalidStageInput:
    return InvalidStageInput(f"{param}: {message}", param, status=status)


# --- static checks (the ingress runs these too: cheap, no I/O) ----------------------------------


def host_allowed(host: str, policy: MediaPolicy) -> bool:
    return any(host == d or (d.startswith("*.") and host.endswith(d[1:])) for d in policy.allowed_domains)


def address_allowed(ip: IPAddress, port: int, policy: MediaPolicy) -> bool:
    """A public unicast address, or one ``allowed_addresses`` names (with its port, if the rule has one)."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for rule in map(_address_rule, policy.allowed_addresses):
        if ip.version == rule.network.version and ip in rule.network and rule.port in (None, port):
            return True
    return ip.is_global and not ip.is_multicast


def check_url(url: str, param: str, policy: MediaPolicy) -> None:
    """Refuse a remote/local media URL the policy rules out before any I/O (scheme, host, literal address, path).

    ``data:`` URLs are not handled here (:func:`omni_serve.media.inputs.parse_data_url`).
    """
    if len(url) > MAX_URL_LENGTH:
        raise _refused(param, f"URL longer than {MAX_URL_LENGTH} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as err:
        raise _refused(param, f"invalid URL ({err})") from None
    scheme = parts.scheme.lower()
    if scheme == "file":
        local_path(url, param, policy)
        return
    if scheme not in ("http", "https"):
        raise _refused(param, f"URL scheme '{scheme}' is not accepted (data:, http(s): and file: URLs only)")
    if scheme not in policy.allowed_schemes:
        raise _refused(param, f"{scheme}: URLs are not accepted by this server's media policy")
    if parts.username is not None or parts.password is not None:
        raise _refused(param, "URLs with credentials are not accepted")
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise _refused(param, "URL has no host")
    if not host.isascii():
        raise _refused(param, "URL host must be ASCII (IDNA-encode it)")
    if not host_allowed(host, policy):
        raise _refused(param, f"host '{host}' is not in the server's media allow-list")
    literal = _ip_literal(host)
    if literal is not None and not address_allowed(literal, port or _default_port(scheme), policy):
        raise _refused(param, f"address {literal} is not a public address")


def local_path(url: str, param: str, policy: MediaPolicy) -> str:
    """The real path of a ``file:`` URL, if it lies under ``allowed_local_dir``."""
    if policy.allowed_local_dir is None:
        raise _refused(param, "file: URLs are not accepted by this server's media policy")
    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise _refused(param, "file: URLs must name a local path")
    path = os.path.realpath(unquote(parts.path))
    root = os.path.realpath(policy.allowed_local_dir)
    if os.path.commonpath([path, root]) != root:
        raise _refused(param, "file: URL outside the server's media directory")
    return path


def _ip_literal(host: str) -> IPAddress | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def _default_port(scheme: str) -> int:
    return 443 if scheme == "https" else 80


# --- the fetch (entry stage) -------------------------------------------------------------------


async def resolve(host: str, port: int, policy: MediaPolicy, param: str) -> list[IPAddress]:
    """Every address ``host`` resolves to (the system resolver; tests replace this function)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await asyncio.wait_for(loop.getaddrinfo(host, port, type=socket.SOCK_STREAM), policy.connect_timeout_s)
    except (OSError, asyncio.TimeoutError):  # not the builtin TimeoutError before Python 3.11
        raise _refused(param, f"host '{host}' does not resolve") from None
    return list(dict.fromkeys(ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos))


def _backend(policy: MediaPolicy, param: str) -> Any:
    """httpcore's network backend with the address check bound to the connect.

    httpcore hands ``connect_tcp`` the URL's host; this resolves it here, refuses the whole host if
    any address is not allowed, and connects to the checked address itself (TLS still verifies the
    host name: httpcore passes it as the server name when it starts TLS).
    """
    import httpcore

    class CheckedBackend(httpcore.AsyncNetworkBackend):
        def __init__(self) -> None:
            self._inner = httpcore.AnyIOBackend()

        async def connect_tcp(
            self,
            host: str,
            port: int,
            timeout: float | None = None,
            local_address: str | None = None,
            socket_options: Any = None,
        ) -> Any:
            literal = _ip_literal(host)
            addresses = [literal] if literal is not None else await resolve(host, port, policy, param)
            refused = [ip for ip in addresses if not address_allowed(ip, port, policy)]
            if refused or not addresses:
                raise _refused(
                    param, f"host '{host}' resolves to {refused[0] if refused else 'nothing'}, not a public address"
                )
            error: Exception | None = None
            for ip in addresses:
                try:
                    return await self._inner.connect_tcp(str(ip), port, timeout, local_address, socket_options)
                except (httpcore.ConnectError, httpcore.ConnectTimeout) as err:
                    error = err
            raise _refused(param, f"could not connect to '{host}' ({type(error).__name__})")

        async def sleep(self, seconds: float) -> None:
            await self._inner.sleep(seconds)

    return CheckedBackend()


async def fetch(url: str, param: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    """The body at ``url`` (http(s) or file), under every rule of the policy; at most ``max_bytes``."""
    try:
        async with _timeout(policy.fetch_timeout_s):
            if urlsplit(url).scheme.lower() == "file":
                return await asyncio.to_thread(_read_local, url, param, policy, max_bytes)
            return await _fetch_http(url, param, policy, max_bytes)
    except asyncio.TimeoutError:  # what wait_for and async_timeout raise on 3.10 (the builtin only from 3.11)
        raise _refused(param, f"fetching the media took longer than {policy.fetch_timeout_s:g} s") from None


async def _fetch_http(url: str, param: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    import httpcore

    timeouts = {
        "connect": policy.connect_timeout_s,
        "read": policy.read_timeout_s,
        "write": policy.read_timeout_s,
        "pool": policy.connect_timeout_s,
    }
    async with httpcore.AsyncConnectionPool(network_backend=_backend(policy, param), retries=0) as pool:
        for _hop in range(policy.max_redirects + 1):
            check_url(url, param, policy)
            if urlsplit(url).scheme.lower() == "file":  # a redirect may not lead out of http(s)
                raise _refused(param, "redirect to a file: URL")
            try:
                async with pool.stream(
                    "GET", url, headers=[(b"accept", b"*/*")], extensions={"timeout": timeouts}
                ) as response:
                    if response.status in _REDIRECTS:
                        location = _header(response.headers, b"location")
                        if not location:
                            raise _refused(param, f"redirect {response.status} without a Location")
                        url = urljoin(url, location)
                        continue
                    if response.status != 200:
                        raise _refused(param, f"fetching the media returned HTTP {response.status}")
                    declared = _header(response.headers, b"content-length")
                    if declared and declared.isdigit() and int(declared) > max_bytes:
                        raise _refused(param, f"media of {declared} bytes is over the limit of {max_bytes}", 413)
                    return await _read_capped(response.aiter_stream(), param, max_bytes)
            except (
                httpcore.TimeoutException,
                httpcore.NetworkError,
                httpcore.ProtocolError,
                httpcore.UnsupportedProtocol,
            ) as err:
                raise _refused(param, f"fetching the media failed ({type(err).__name__})") from None
        raise _refused(param, f"more than {policy.max_redirects} redirects")


def _header(headers: list[tuple[bytes, bytes]], name: bytes) -> str | None:
    for key, value in headers:
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


async def _read_capped(chunks: AsyncIterator[bytes], param: str, max_bytes: int) -> bytes:
    parts, size = [], 0
    async for chunk in chunks:
        size += len(chunk)
        if size > max_bytes:
            raise _refused(param, f"media over the limit of {max_bytes} bytes", 413)
        parts.append(chunk)
    return b"".join(parts)


def _read_local(url: str, param: str, policy: MediaPolicy, max_bytes: int) -> bytes:
    path = local_path(url, param, policy)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as err:
        raise _refused(param, f"file: URL cannot be read ({err.strerror})") from None
    info = os.fstat(fd)  # of what was opened, not of the name: a swapped path cannot slip through
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise _refused(param, "file: URL is not a regular file")
    with os.fdopen(fd, "rb") as f:
        if info.st_size > max_bytes:
            raise _refused(param, f"media of {info.st_size} bytes is over the limit of {max_bytes}", 413)
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _refused(param, f"media over the limit of {max_bytes} bytes", 413)
    return data
