"""agent_server.jobs.webhooks: signatures a receiver can verify, the --webhook-allow check on every resolved
address, retries with backoff, redirects only to allowed places; deliveries go to a real HTTP receiver on
127.0.0.1 (an asyncio server that records what it gets)."""

from __future__ import annotations

import asyncio
import email.utils
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

import orjson
import pytest

from agent_server.jobs.webhooks import (
    EVENT_HEADER,
    SIGNATURE_HEADER,
    AllowList,
    Attempt,
    RetryPolicy,
    WebhookRefused,
    WebhookSender,
    check_url,
    parse_retry_after_s,
    sign,
    verify_signature,
    webhook_secret,
)

from tests.agent_server.jobs.conftest import run
from tests.agent_server.jobs.webhook_receiver import Receiver

pytestmark = pytest.mark.timeout(30)

NOW_S = 1_796_000_000
LOOPBACK = AllowList.parse(["127.0.0.0/8"])
ROOT = b"root secret of the fleet"
BODY = orjson.dumps({"id": "job_0001", "status": "done", "segments_done": 3})


def with_receiver(answers: list[tuple[int, dict[str, str]]],
                  body: Callable[[Receiver], Awaitable[None]]) -> Receiver:
    receiver = Receiver(answers)

    async def scenario() -> None:
        await receiver.start()
        try:
            await body(receiver)
        finally:
            await receiver.stop()

    run(scenario())
    return receiver


def sender(allow: AllowList = LOOPBACK, **kwargs: Any) -> WebhookSender:
    return WebhookSender(allow, lambda key_id: webhook_secret(ROOT, key_id), clock=lambda: NOW_S, **kwargs)


# ---- signatures ----------------------------------------------------------------------------------------


def test_a_signature_verifies_and_anything_changed_does_not() -> None:
    secret = webhook_secret(ROOT, "k_0123456789ab")
    header = sign(secret, BODY, NOW_S)
    assert header.startswith(f"t={NOW_S},v1=")
    assert verify_signature(secret, BODY, header, NOW_S + 10)
    assert not verify_signature(secret, BODY + b" ", header, NOW_S)  # the body changed
    assert not verify_signature(webhook_secret(ROOT, "k_other"), BODY, header, NOW_S)  # another key's secret
    assert not verify_signature(secret, BODY, header, NOW_S + 301)  # replayed later
    assert not verify_signature(secret, BODY, None, NOW_S)
    assert not verify_signature(secret, BODY, header.replace(f"t={NOW_S}", f"t={NOW_S + 1}"), NOW_S)
    assert webhook_secret(ROOT, "k_0123456789ab") == secret  # every replica derives the same
    assert webhook_secret(b"another root", "k_0123456789ab") != secret


# ---- the allow list ------------------------------------------------------------------------------------


def test_the_allow_list_parses_cidrs_and_refuses_everything_by_default() -> None:
    allow = AllowList.parse(["10.0.0.0/8", " 2001:db8::/32 ", ""])
    assert allow.networks == (ipaddress.ip_network("10.0.0.0/8"), ipaddress.ip_network("2001:db8::/32"))
    assert allow.allows("10.1.2.3")
    assert allow.allows("::ffff:10.1.2.3")  # IPv4-mapped IPv6 is the IPv4 address
    assert allow.allows("2001:db8::1")
    assert not allow.allows("11.0.0.1")
    assert not allow.allows("not an address")
    assert not AllowList().allows("127.0.0.1")
    with pytest.raises(ValueError, match=r"'10\.0\.0\.0/33'"):
        AllowList.parse(["10.0.0.0/33"])


def resolver(table: Mapping[str, Sequence[str]]) -> Callable[[str, int], Awaitable[Sequence[str]]]:
    async def resolve(host: str, port: int) -> Sequence[str]:
        if host not in table:
            raise OSError(f"unknown host {host}")
        return table[host]

    return resolve


def test_every_address_a_host_resolves_to_must_be_allowed() -> None:
    table = {"hooks.example": ["127.0.0.5"], "rebind.example": ["127.0.0.5", "10.9.8.7"], "none.example": []}

    async def scenario() -> None:
        target = await check_url("https://hooks.example/cb?x=1", LOOPBACK, resolver(table))
        assert (target.host, target.port, target.path, target.addresses) == ("hooks.example", 443, "/cb?x=1",
                                                                              ("127.0.0.5",))
        with pytest.raises(WebhookRefused, match=r"10\.9\.8\.7, outside --webhook-allow"):
            await check_url("http://rebind.example/", LOOPBACK, resolver(table))
        with pytest.raises(WebhookRefused, match="no address"):
            await check_url("http://none.example/", LOOPBACK, resolver(table))
        with pytest.raises(WebhookRefused, match="does not resolve"):
            await check_url("http://nowhere.example/", LOOPBACK, resolver(table))
        with pytest.raises(WebhookRefused, match="only http"):
            await check_url("ftp://hooks.example/", LOOPBACK, resolver(table))
        with pytest.raises(WebhookRefused, match="webhooks are off"):
            await check_url("http://hooks.example/", AllowList(), resolver(table))

    run(scenario())


# ---- deliveries ----------------------------------------------------------------------------------------


def test_a_delivery_arrives_signed_with_the_keys_secret() -> None:
    async def body(receiver: Receiver) -> None:
        attempt = await sender().attempt(receiver.url + "/hooks/tts?token=abc", BODY, "k_0123456789ab", "job.done")
        assert attempt.delivered and attempt.status == 200

    receiver = with_receiver([(200, {})], body)
    (got,) = receiver.received
    assert got.path == "/hooks/tts?token=abc"
    assert got.body == BODY
    assert got.headers["content-type"] == "application/json"
    assert got.headers[EVENT_HEADER.lower()] == "job.done"
    assert got.headers["host"] == f"127.0.0.1:{receiver.port}"
    secret = webhook_secret(ROOT, "k_0123456789ab")
    assert verify_signature(secret, got.body, got.headers.get(SIGNATURE_HEADER.lower()), NOW_S)


def test_an_attempt_reports_the_answer_and_its_retry_after() -> None:
    async def body(receiver: Receiver) -> None:
        answers = [await sender().attempt(receiver.url, BODY, "k_1", "job.failed") for _ in range(4)]
        assert [(a.status, a.retryable, a.delivered) for a in answers] == [
            (503, True, False), (429, True, False), (404, False, False), (204, False, True)]
        assert [a.retry_after_s for a in answers] == [None, 30.0, None, None]

    with_receiver([(503, {}), (429, {"Retry-After": "30"}), (404, {}), (204, {})], body)


def test_the_retry_policy_doubles_its_waits_and_stops_where_nothing_more_helps() -> None:
    policy = RetryPolicy(attempts=5, first_delay_s=0.5, max_delay_s=3.0)
    no_answer = Attempt(None, "ConnectionRefusedError")
    assert [policy.retry_in_s(made, no_answer) for made in range(1, 6)] == [0.5, 1.0, 2.0, 3.0, None]
    assert policy.retry_in_s(1, Attempt(503, None)) == 0.5
    assert policy.retry_in_s(1, Attempt(408, None)) == 0.5
    assert policy.retry_in_s(1, Attempt(200, None)) is None  # delivered
    assert policy.retry_in_s(1, Attempt(404, None)) is None  # the receiver refuses: no retry helps
    assert policy.retry_in_s(1, Attempt(429, None, retry_after_s=2.0)) == 2.0  # the receiver asks for longer
    assert policy.retry_in_s(3, Attempt(429, None, retry_after_s=0.1)) == 2.0  # never shorter than the backoff
    assert policy.retry_in_s(1, Attempt(503, None, retry_after_s=3600.0)) == 3.0  # never beyond max_delay_s


def test_retry_after_reads_seconds_and_http_dates() -> None:
    assert parse_retry_after_s("120", NOW_S) == 120.0
    assert parse_retry_after_s(email.utils.formatdate(NOW_S + 90, usegmt=True), NOW_S) == 90.0
    assert parse_retry_after_s(email.utils.formatdate(NOW_S - 90, usegmt=True), NOW_S) == 0.0
    assert parse_retry_after_s("soon", NOW_S) is None
    assert parse_retry_after_s("\u00b2", NOW_S) is None  # "²": isdigit() but no int
    assert parse_retry_after_s(None, NOW_S) is None


def test_a_receiver_that_never_answers_gives_an_attempt_without_a_status() -> None:
    async def scenario() -> None:
        closed = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        port = closed.sockets[0].getsockname()[1]
        closed.close()
        await closed.wait_closed()  # nothing listens there any more: connection refused
        attempt = await sender().attempt(f"http://127.0.0.1:{port}/", BODY, "k", "x")
        assert attempt.status is None and attempt.error and attempt.retryable and not attempt.delivered

    run(scenario())


def test_a_name_that_does_not_resolve_at_delivery_is_an_attempt_to_retry() -> None:
    """The receiver's host resolved when the job was submitted; at delivery the resolver fails (EAI_AGAIN, a DNS
    outage): that attempt got no answer and is retried, not refused for good. An address outside the allow-list
    is still refused."""
    async def failing(host: str, port: int) -> Sequence[str]:
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")

    async def scenario() -> None:
        attempt = await sender(resolve=failing).attempt("http://hooks.example/cb", BODY, "k", "job.done")
        assert attempt.status is None and attempt.retryable and "does not resolve" in (attempt.error or "")
        with pytest.raises(WebhookRefused, match="outside --webhook-allow"):
            await sender(resolve=resolver({"hooks.example": ["10.0.0.5"]})).attempt(
                "http://hooks.example/cb", BODY, "k", "job.done")

    run(scenario())


def test_a_redirect_is_followed_only_as_307_or_308_and_only_to_an_allowed_address() -> None:
    async def allowed(receiver: Receiver) -> None:
        assert (await sender().attempt(receiver.url + "/old", BODY, "k", "job.done")).delivered

    receiver = with_receiver([(308, {"Location": "/new"}), (200, {})], allowed)
    assert [r.path for r in receiver.received] == ["/old", "/new"]
    assert receiver.received[1].body == BODY

    async def elsewhere(receiver: Receiver) -> None:
        with pytest.raises(WebhookRefused, match="outside --webhook-allow"):
            await sender().attempt(receiver.url + "/old", BODY, "k", "job.done")

    receiver = with_receiver([(307, {"Location": "http://10.255.0.1/steal"})], elsewhere)
    assert len(receiver.received) == 1  # nothing went to 10.255.0.1: refused before any connection

    async def see_other(receiver: Receiver) -> None:
        with pytest.raises(WebhookRefused, match="302"):
            await sender().attempt(receiver.url + "/old", BODY, "k", "job.done")

    receiver = with_receiver([(302, {"Location": "/new"})], see_other)
    assert len(receiver.received) == 1


def test_no_request_leaves_for_an_address_outside_the_allow_list() -> None:
    async def body(receiver: Receiver) -> None:
        only_ten = AllowList.parse(["10.0.0.0/8"])
        with pytest.raises(WebhookRefused, match="outside --webhook-allow"):
            await sender(allow=only_ten).attempt(receiver.url, BODY, "k", "job.done")

    assert with_receiver([(200, {})], body).received == []
