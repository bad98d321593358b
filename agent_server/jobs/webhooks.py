"""Webhooks: when a job is done or failed, its status JSON is POSTed to the job's `webhook_url`, signed.

Signature (what a receiver checks): the header

    X-Agent-Server-Signature: t=<unix seconds>,v1=<hex HMAC-SHA256>

where the HMAC is keyed with the API key's webhook secret and taken over `<t>.` followed by the raw body bytes.
A receiver recomputes it over the body exactly as received (before any JSON parsing), compares in constant
time, and refuses a `t` more than a few minutes old (a replayed delivery):

    expected = hmac.new(secret, f"{t}.".encode() + body, hashlib.sha256).hexdigest()
    ok = hmac.compare_digest(expected, v1) and abs(time.time() - t) <= 300

(`verify_signature` below is that receiver, for tests and for Python receivers.) The secret per key is
`webhook_secret(root, key_id)`: an HMAC of the key's fingerprint under the server's root secret, so every replica
derives the same one and no table is kept; the key's owner reads it from the server (docs/jobs.md, the second
phase's `GET /v1/jobs/webhook-secret`). `X-Agent-Server-Event` says `job.done` or `job.failed`; the body's `id`
identifies the job (a receiver may see a delivery more than once: retries, a replica dying mid-delivery).

Where a delivery may go: only http(s) URLs, and only to addresses inside the operator's `--webhook-allow` CIDR
list (default: none, so no webhook is sent and a job asking for one is refused at submission). The host is
resolved, every address it resolves to must be allowed (one address outside refuses the URL: no DNS trick picks
the bad one), and the connection goes to one of the addresses checked, never to a second lookup. A redirect is
followed only for 307/308 (which keep the POST), only to a URL that passes the same check, at most
`MAX_REDIRECTS` times; any other redirect ends the delivery.

Retries: a connection error, a timeout, 408, 429 or a 5xx is tried again after `first_delay_s`, doubling up to
`max_delay_s` (or after the answer's `Retry-After`, when it asks for longer, still at most `max_delay_s`),
`attempts` times in all; any other status ends it (2xx: delivered; 4xx: the receiver refuses). The sender makes one
attempt at a time (`WebhookSender.attempt`) and `RetryPolicy.retry_in_s` says when the next one is due: the job
store keeps that schedule (its webhook outbox, runner.py), so a retry survives the replica that started it.

The client is a minimal HTTP/1.1 POST over asyncio streams (TLS with the system's trust store for https): the
runtime has no HTTP client library, and the connection must go to the checked address while TLS verifies the
URL's host name, which a general client does not offer.
"""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import hmac
import ipaddress
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

SIGNATURE_HEADER = "X-Agent-Server-Signature"
EVENT_HEADER = "X-Agent-Server-Event"
SIGNATURE_VERSION = "v1"
DEFAULT_TOLERANCE_S = 300.0  # a receiver refuses a signature older than this
USER_AGENT = "agent-server-webhooks/1"
MAX_REDIRECTS = 3
MAX_RESPONSE_HEAD_BYTES = 64 * 1024
DEFAULT_ATTEMPTS = 8
DEFAULT_FIRST_DELAY_S = 1.0
DEFAULT_MAX_DELAY_S = 300.0
DEFAULT_TIMEOUT_S = 10.0
RETRY_STATUSES = frozenset({408, 429})
FOLLOWED_REDIRECTS = frozenset({307, 308})
SCHEME_PORTS = {"http": 80, "https": 443}
SECRET_PREFIX = "whsec_"

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Resolver = Callable[[str, int], Awaitable[Sequence[str]]]  # (host, port) -> addresses


class WebhookRefused(Exception):
    """The URL may not be called (scheme, or an address outside --webhook-allow): no retry helps."""


class WebhookUnresolved(WebhookRefused):
    """The URL's host did not resolve. Refused at submission; at delivery (the name resolved when the job was
    submitted) a passing resolver fault, so that attempt failed and is retried."""


# ---- signing ----------------------------------------------------------------------------------------------


def webhook_secret(root: bytes, key_id: str) -> str:
    """The webhook secret of an API key (by its fingerprint): the same on every replica with the same root."""
    return SECRET_PREFIX + hmac.new(root, b"webhook-secret:" + key_id.encode(), hashlib.sha256).hexdigest()


def sign(secret: str, body: bytes, timestamp_s: int) -> str:
    """The signature header's value for `body` sent at `timestamp_s`."""
    mac = hmac.new(secret.encode(), f"{timestamp_s}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp_s},{SIGNATURE_VERSION}={mac}"


def verify_signature(secret: str, body: bytes, header: str | None, now_s: float,
                     tolerance_s: float = DEFAULT_TOLERANCE_S) -> bool:
    """What a receiver does: True when `header` signs `body` with `secret`, no older than `tolerance_s`."""
    if not header:
        return False
    parts = dict(item.split("=", 1) for item in header.split(",") if "=" in item)
    stamp, mac = parts.get("t", ""), parts.get(SIGNATURE_VERSION, "")
    if not (stamp.isascii() and stamp.isdigit()) or not mac:
        return False
    expected = hmac.new(secret.encode(), f"{stamp}.".encode() + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, mac) and abs(now_s - int(stamp)) <= tolerance_s


# ---- where a delivery may go ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AllowList:
    """--webhook-allow: the CIDR networks webhook deliveries may reach (empty: none)."""

    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, cidrs: Iterable[str]) -> AllowList:
        """Raises ValueError naming a bad entry."""
        networks: list[Network] = []
        for cidr in cidrs:
            text = cidr.strip()
            if not text:
                continue
            try:
                networks.append(ipaddress.ip_network(text, strict=False))
            except ValueError as exc:
                raise ValueError(f"--webhook-allow: {text!r} is not a CIDR network ({exc})") from None
        return cls(tuple(networks))

    def allows(self, address: str) -> bool:
        try:
            ip: Address = ipaddress.ip_address(address.split("%", 1)[0])  # (an IPv6 zone index is dropped)
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == net.version and ip in net for net in self.networks)


@dataclass(frozen=True, slots=True)
class Target:
    """A URL checked for a delivery: where to connect (an allowed address) and what to say."""

    url: str
    scheme: str
    host: str  # for the Host header and TLS verification
    port: int
    path: str  # path and query
    addresses: tuple[str, ...]  # every address the host resolved to, all allowed


async def system_resolver(host: str, port: int) -> Sequence[str]:
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


async def check_url(url: str, allow: AllowList, resolve: Resolver = system_resolver) -> Target:
    """The URL's target if every address its host resolves to is allowed. Raises WebhookRefused."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise WebhookRefused(f"not a URL: {exc}") from None
    if parts.scheme not in SCHEME_PORTS or not parts.hostname:
        raise WebhookRefused(f"only http(s) URLs with a host (got {url[:100]!r})")
    if not allow.networks:
        raise WebhookRefused("webhooks are off on this server (no --webhook-allow networks)")
    host = parts.hostname
    port = port or SCHEME_PORTS[parts.scheme]
    try:
        addresses = tuple(await resolve(host, port))
    except (OSError, UnicodeError) as exc:
        raise WebhookUnresolved(f"{host} does not resolve: {exc}") from None
    if not addresses:
        raise WebhookUnresolved(f"{host} resolves to no address")
    refused = [a for a in addresses if not allow.allows(a)]
    if refused:
        raise WebhookRefused(f"{host} resolves to {', '.join(refused)}, outside --webhook-allow")
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return Target(url, parts.scheme, host, port, path, addresses)


# ---- delivery ---------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Attempt:
    status: int | None  # the HTTP status, None when no answer came
    error: str | None  # what went wrong (no answer), None for an answer
    retry_after_s: float | None = None  # the answer's Retry-After (seconds), when it had one

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        return self.status is None or _retryable(self.status)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    attempts: int = DEFAULT_ATTEMPTS
    first_delay_s: float = DEFAULT_FIRST_DELAY_S
    max_delay_s: float = DEFAULT_MAX_DELAY_S
    timeout_s: float = DEFAULT_TIMEOUT_S  # per attempt: connect, send, and the response's head

    def delay_s(self, retry: int) -> float:
        """The wait before retry number `retry` (1, 2, ...)."""
        return min(self.max_delay_s, self.first_delay_s * 2.0 ** (retry - 1))

    def retry_in_s(self, made: int, last: Attempt) -> float | None:
        """After `made` attempts, the last one `last`: the wait before the next, or None when there is none
        (delivered, refused by the receiver, or every attempt made). A receiver's Retry-After lengthens the
        wait, never beyond `max_delay_s`."""
        if last.delivered or not last.retryable or made >= self.attempts:
            return None
        wait_s = self.delay_s(made)
        if last.retry_after_s is not None:
            wait_s = max(wait_s, min(self.max_delay_s, last.retry_after_s))
        return wait_s

    @property
    def attempt_bound_s(self) -> float:
        """The longest one attempt can take (its redirects included): how long a replica holds a delivery."""
        return self.timeout_s * (MAX_REDIRECTS + 1)


class WebhookSender:
    """Signs and delivers webhooks. `secret_for(key_id)` gives the key's secret (`webhook_secret`)."""

    def __init__(self, allow: AllowList, secret_for: Callable[[str], str], *, policy: RetryPolicy | None = None,
                 resolve: Resolver = system_resolver, clock: Callable[[], float] = time.time,
                 ssl_context: ssl.SSLContext | None = None) -> None:
        self.allow = allow
        self.policy = policy or RetryPolicy()
        self._secret_for = secret_for
        self._resolve = resolve
        self._clock = clock
        self._ssl = ssl_context

    async def attempt(self, url: str, body: bytes, key_id: str, event: str) -> Attempt:
        """One signed POST of `body` to `url` (signed now), following allowed 307/308 redirects. Never raises for
        the receiver's faults (no answer is an Attempt without a status); raises WebhookRefused for a URL, or a
        redirect, that may not be called."""
        headers = {"Content-Type": "application/json", EVENT_HEADER: event,
                   SIGNATURE_HEADER: sign(self._secret_for(key_id), body, int(self._clock()))}
        for _ in range(MAX_REDIRECTS + 1):
            try:
                async with asyncio.timeout(self.policy.timeout_s):  # (the name's resolution included)
                    target = await check_url(url, self.allow, self._resolve)
                    status, answer = await self._post(target, body, headers)
            except WebhookUnresolved as exc:
                return Attempt(None, str(exc)[:200])
            except (OSError, TimeoutError, ssl.SSLError, ValueError) as exc:
                return Attempt(None, f"{type(exc).__name__}: {exc}"[:200])
            location = answer.get("location")
            if status in FOLLOWED_REDIRECTS and location:
                url = urljoin(url, location)
                continue
            if 300 <= status < 400:
                raise WebhookRefused(f"redirect {status} not followed (only 307/308 to an allowed address)")
            return Attempt(status, None, parse_retry_after_s(answer.get("retry-after"), self._clock()))
        raise WebhookRefused(f"more than {MAX_REDIRECTS} redirects")

    async def _post(self, target: Target, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
        context = None
        if target.scheme == "https":
            context = self._ssl or ssl.create_default_context()
        reader, writer = await _connect_any(target, context)
        try:
            host = f"[{target.host}]" if ":" in target.host else target.host
            if target.port != SCHEME_PORTS[target.scheme]:
                host += f":{target.port}"
            lines = [f"POST {target.path} HTTP/1.1", f"Host: {host}", f"User-Agent: {USER_AGENT}",
                     f"Content-Length: {len(body)}", "Connection: close",
                     *(f"{name}: {value}" for name, value in headers.items())]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body)
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.LimitOverrunError:
            raise ValueError("response head too long") from None
        except asyncio.IncompleteReadError:
            raise ConnectionError("the receiver closed the connection before answering") from None
        finally:
            writer.close()
            try:
                await writer.wait_closed()
            except (OSError, ssl.SSLError):
                pass
        return _parse_head(head)


async def _connect_any(target: Target, context: ssl.SSLContext | None) -> tuple[asyncio.StreamReader,
                                                                                asyncio.StreamWriter]:
    """A connection to the first checked address that answers (TLS verifies the URL's host name)."""
    last: OSError | None = None
    for address in target.addresses:
        try:
            return await asyncio.open_connection(
                address, target.port, ssl=context, server_hostname=target.host if context is not None else None,
                limit=MAX_RESPONSE_HEAD_BYTES)
        except OSError as exc:
            last = exc
    raise last if last is not None else OSError("no address to connect to")


def _parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """(status, headers by lower-case name) of a response head. Raises ValueError for one that is not HTTP/1.x."""
    lines = head.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest[:3]
    if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
        raise ValueError(f"not an HTTP/1.x response: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip():
            headers[name.strip().lower()] = value.strip()
    return int(code), headers


def parse_retry_after_s(value: str | None, now_s: float) -> float | None:
    """Retry-After as seconds from now: delay-seconds or an HTTP date (RFC 9110 10.2.3); None when absent or
    unreadable."""
    if value is None:
        return None
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - now_s) if when.tzinfo is not None else None


def _retryable(status: int) -> bool:
    return status >= 500 or status in RETRY_STATUSES


def loggable_url(url: str) -> str:
    """The URL without its query (which may carry a receiver's token)."""
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"

