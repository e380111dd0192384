"""http(s) image URLs under ``serve --allow-remote-media`` and the SSRF guard
(``vlmbatch/preprocessing/guard.py``): the address rules over many spellings (hypothesis, no
network), then the fetcher against real servers on 127.0.0.1 with a stub resolver (a
redirect from an allowed host to loopback; a DNS answer that changes between check and
connect), then a real ``vlmbatch serve`` through the official client: an allowed host's
image answered as the same image sent as a data: URL, refused URLs a 400
``invalid_image_url``, and in a batch the refused line's own ``source`` error."""

from __future__ import annotations

import base64
import ipaddress
import json
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import quote

import httpcore
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.loopback import LoopbackServer
from tests.server.serving import (
    IMAGES,
    Server,
    batch_lines,
    chat_body,
    create_batch,
    data_url,
    server_fixture,
    wait_batch,
)
from vlmbatch.preprocessing.fetch import Fetcher
from vlmbatch.preprocessing.guard import GuardedBackend, MediaBlocked, check_url_host, host_refusal
from vlmbatch.preprocessing.limits import FetchOptions, MediaGuard
from vlmbatch.preprocessing.sources import SourceError

INTERNAL_V4 = [ipaddress.ip_network(n) for n in (
    "127.0.0.0/8", "10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "169.254.0.0/16",
    "100.64.0.0/10", "0.0.0.0/8", "224.0.0.0/4", "240.0.0.0/4")]
INTERNAL_V6 = [ipaddress.ip_network(n) for n in ("::1/128", "fc00::/7", "fe80::/10", "ff00::/8")]
PUBLIC = "93.184.216.34"  # a global address; the tests' network never connects to it
RED = "Is there a red shape?"


def address_in(nets: list) -> st.SearchStrategy:
    return st.sampled_from(nets).flatmap(
        lambda n: st.integers(0, n.num_addresses - 1).map(lambda i: n[i]))


def v4_spellings(a: ipaddress.IPv4Address) -> list[str]:
    """``a`` written as URL hosts that mean it to one parser or another."""
    n, b = int(a), a.packed
    return [str(a), str(a) + ".", str(n), hex(n), f"0{n:o}", ".".join(f"0{x:o}" for x in b),
            ".".join(hex(x) for x in b), f"0x{b[0]:x}.{int.from_bytes(b[1:], 'big')}",
            f"{b[0]}.{b[1]}.{int.from_bytes(b[2:], 'big')}", f"[::ffff:{a}]",
            f"[::ffff:{n >> 16:x}:{n & 0xFFFF:x}]", f"[64:ff9b::{a}]", f"[::{a}]"]


def no_dns(host: str, port: int) -> list[str]:
    raise AssertionError(f"the check resolved {host!r}: a literal needs no DNS")


def refused(host: str) -> None:
    """Every layer of the guard refuses ``host``: its spelling, the backend's connect, a URL."""
    assert host_refusal(host) is not None, host
    with pytest.raises(MediaBlocked):
        GuardedBackend(MediaGuard(), no_dns).addresses(host, 80)
    with pytest.raises(SourceError, match="SSRF guard|Invalid IPv4"):  # httpx refuses some
        in_url = f"[{host}]" if ":" in host and not host.startswith("[") else host
        check_url_host(f"http://{in_url}:8080/a.png", MediaGuard())


@settings(max_examples=100, derandomize=True, deadline=None)
@given(address_in(INTERNAL_V4))
def test_internal_ipv4_refused_in_every_spelling(a: ipaddress.IPv4Address) -> None:
    for spelling in v4_spellings(a):
        refused(spelling)


@settings(max_examples=100, derandomize=True, deadline=None)
@given(address_in(INTERNAL_V6))
def test_internal_ipv6_refused(a: ipaddress.IPv6Address) -> None:
    refused(f"[{a}]")
    refused(a.exploded)


@settings(max_examples=150, derandomize=True, deadline=None)
@given(st.integers(0, 2 ** 32 - 1).map(ipaddress.IPv4Address).filter(
    lambda a: a.is_global and not a.is_multicast))
def test_public_addresses_pass_without_network(a: ipaddress.IPv4Address) -> None:
    assert host_refusal(str(a)) is None
    assert GuardedBackend(MediaGuard(), no_dns).addresses(str(a), 80) == [str(a)]
    check_url_host(f"http://{a}/x.png", MediaGuard())


@pytest.mark.parametrize("host, why", [
    ("169.254.169.254", "metadata"), ("[fd00:ec2::254]", "metadata"), ("localhost", "loopback"),
    ("2130706433", "numeric"), ("0x7f.1", "numeric"), ("127.1", "numeric"),
    ("[::ffff:127.0.0.1]", "127.0.0.1, a loopback"), ("100.64.1.2", "CGNAT"),
    ("%31%32%37.0.0.1", "DNS name"), ("", "no host")])
def test_named_reasons(host: str, why: str) -> None:
    backend = GuardedBackend(MediaGuard(), lambda h, p: ["127.0.0.1", "::1"])
    with pytest.raises(MediaBlocked, match=why):
        backend.addresses(host, 80)


def test_every_answer_is_checked_and_allowed_hosts_pass() -> None:
    answers = {"mixed.test": [PUBLIC, "10.1.2.3"], "pub.test": [PUBLIC, "2606:4700::1111"]}
    guard = MediaGuard(("127.0.0.1", ".corp.test", "a.test"))
    backend = GuardedBackend(guard, lambda h, p: answers.get(h, ["10.0.0.7"]))
    with pytest.raises(MediaBlocked, match="10.1.2.3, a private"):
        backend.addresses("mixed.test", 80)  # one bad answer refuses the host
    assert backend.addresses("PUB.test.", 80) == answers["pub.test"]
    assert backend.addresses("127.0.0.1", 80) == ["127.0.0.1"]
    assert backend.addresses("x.corp.test", 80) == ["10.0.0.7"]  # a listed subdomain
    assert backend.addresses("A.TEST.", 80) == ["10.0.0.7"]
    for host in ("corp.test", "xa.test", "a.test.evil", "localhost"):  # not listed
        with pytest.raises(MediaBlocked):
            backend.addresses(host, 80)


# --- the fetcher against real loopback servers, a stub resolver beside them --------------


class LoopbackOnly(httpcore.NetworkBackend):
    """Sockets to 127.0.0.1 only (nothing leaves the machine); every address asked for is
    recorded: the pinning shows as the checked address being the one connected to."""

    def __init__(self) -> None:
        self.inner, self.connected = httpcore.SyncBackend(), []

    def connect_tcp(self, host: str, port: int, *args: object, **kw: object):  # noqa: ANN201
        self.connected.append(host)
        if host != "127.0.0.1":
            raise httpcore.ConnectError(f"test network: {host} is unreachable")
        return self.inner.connect_tcp(host, port, *args, **kw)  # type: ignore[arg-type]

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)


@pytest.fixture(scope="module")
def png() -> bytes:
    return (IMAGES / "scene_01.png").read_bytes()


@pytest.fixture
def site(png: bytes) -> Iterator[LoopbackServer]:
    with LoopbackServer({"a.png": png, "b.png": png}) as s:
        yield s


def fetcher(guard: MediaGuard, answers: dict[str, list[list[str]]], net: LoopbackOnly,
            retries: int = 0) -> Fetcher:
    """A guarded fetcher whose resolver gives each host its next answer in turn."""
    calls = {h: iter(a) for h, a in answers.items()}
    return Fetcher(FetchOptions(retries=retries, backoff_s=0.01, timeout_s=5, guard=guard),
                   resolve=lambda h, p: next(calls[h]), network=net)


@pytest.mark.parametrize("target", ["http://127.0.0.1:{port}/img/b.png",
                                    "http://2130706433:{port}/img/b.png",
                                    "http://[::ffff:127.0.0.1]:{port}/img/b.png",
                                    "http://localhost.:{port}/img/b.png"])
def test_redirect_from_an_allowed_host_to_loopback_is_refused(
        site: LoopbackServer, png: bytes, target: str) -> None:
    port = site.httpd.server_port
    net = LoopbackOnly()
    f = fetcher(MediaGuard(("media.test",)), {"media.test": [["127.0.0.1"]] * 3,
                                              "localhost": [["127.0.0.1"]]}, net)
    with f:
        assert f.fetch(f"http://media.test:{port}/img/a.png", Path("/")) == png  # allowed
        assert f.fetch(f"http://media.test:{port}/redirect/2/a.png", Path("/")) == png
        hop = quote(target.format(port=port), safe="")
        with pytest.raises(MediaBlocked, match="SSRF guard"):
            f.fetch(f"http://media.test:{port}/location/{hop}", Path("/"))
    assert site.requests[f"/location/{hop}"] == 1 and site.requests["/img/b.png"] == 0
    assert net.connected == ["127.0.0.1"]  # one pooled connection, to media.test's address


def test_dns_rebinding_is_pinned_then_refused(site: LoopbackServer) -> None:
    """The resolver answers a public address, then 127.0.0.1: the first connection goes to
    the address that was checked (and fails: nothing public is reachable here), the retry's
    lookup is checked again and refused; the loopback server is never asked."""
    port = site.httpd.server_port
    net = LoopbackOnly()
    with fetcher(MediaGuard(), {"rebind.test": [[PUBLIC], ["127.0.0.1"]]}, net, retries=1) as f:
        with pytest.raises(MediaBlocked, match="127.0.0.1, a loopback"):
            f.fetch(f"http://rebind.test:{port}/img/a.png", Path("/"))
    assert net.connected == [PUBLIC] and sum(site.requests.values()) == 0


def test_object_stores_refused_under_the_guard() -> None:
    with Fetcher(FetchOptions(guard=MediaGuard())) as f, pytest.raises(MediaBlocked):
        f.fetch("s3://bucket/a.png", Path("/"))
    with pytest.raises(SourceError, match="connection"):  # unguarded: a plain fetch error
        with Fetcher(FetchOptions(retries=0, timeout_s=2)) as f:
            f.fetch("http://127.0.0.1:1/a.png", Path("/"))


# --- the server --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def remote(png: bytes) -> Iterator[LoopbackServer]:
    with LoopbackServer({"a.png": png, "b.png": png}) as s:
        yield s


server = server_fixture("--allow-remote-media", "--allowed-media-domains", "127.0.0.1",
                        "--fetch-retries", "0")


def p_yes(client: openai.OpenAI, url: str) -> float:
    r = client.chat.completions.create(**chat_body(url, RED, max_tokens=1))
    return float(r.model_extra["vlmbatch"]["p_yes"])


def test_allowed_host_answers_as_the_data_url(server: Server, remote: LoopbackServer) -> None:
    client = server.openai()
    want = p_yes(client, data_url(IMAGES / "scene_01.png"))
    assert p_yes(client, remote.url("/img/a.png")) == pytest.approx(want, abs=1e-6)
    assert remote.requests["/img/a.png"] == 1


def test_refused_urls_are_400_invalid_image_url(server: Server,
                                                remote: LoopbackServer) -> None:
    client = server.openai()
    port = remote.httpd.server_port
    hop = quote(f"http://localhost:{port}/img/b.png", safe="")
    for url, why in [(f"http://localhost:{port}/img/b.png", "loopback"),
                     ("http://169.254.169.254/latest/meta-data/", "metadata"),
                     ("http://0x7f.1/a.png", "numeric"),
                     (remote.url(f"/location/{hop}"), "loopback")]:  # allowed, then a hop out
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**chat_body(url, RED, max_tokens=1))
        err = e.value.body
        assert err["code"] == "invalid_image_url" and "SSRF guard" in err["message"], err
        assert why in err["message"], err
    assert remote.requests["/img/b.png"] == 0 and remote.requests[f"/location/{hop}"] == 1


def test_batch_line_refused_alone(server: Server, remote: LoopbackServer) -> None:
    client = server.openai()
    port = remote.httpd.server_port
    text = batch_lines([("ok", remote.url("/img/a.png"), RED),
                        ("internal", f"http://localhost:{port}/img/b.png", RED),
                        ("inline", data_url(IMAGES / "scene_01.png"), RED)])
    b = wait_batch(client, create_batch(client, text).id, timeout=60)
    assert b.status == "completed" and b.request_counts.failed == 1, b
    lines = client.files.content(b.output_file_id).text.splitlines()
    out = {x["custom_id"]: x for x in map(json.loads, lines)}
    (err,) = map(json.loads, client.files.content(b.error_file_id).text.splitlines())
    assert err["custom_id"] == "internal" and err["error"]["code"] == "source_error"
    assert "SSRF guard" in err["error"]["message"] and "loopback" in err["error"]["message"]
    ps = [out[c]["response"]["body"]["vlmbatch"]["p_yes"] for c in ("ok", "inline")]
    assert ps[0] == pytest.approx(ps[1], abs=1e-6)
    assert remote.requests["/img/b.png"] == 0


def test_a_clip_from_an_allowed_host_answers_as_its_data_url(
        server: Server, remote: LoopbackServer) -> None:
    """A ``video_url`` part under the images' fetch policy (``server/chat_media.py``): the
    allowed host's clip answered as the same bytes inline; a loopback host refused by the
    guard, a 400 naming the part."""
    from tests.preprocessing.video_clips import frames, make_clip

    clip = make_clip(frames(10, 32, 32))
    remote.files["c.mkv"] = clip
    inline = "data:video/x-matroska;base64," + base64.b64encode(clip).decode()

    def ask(url: str) -> dict:
        r = server.openai().chat.completions.create(
            model="vlmbatch", max_tokens=1, extra_body={"mm_processor_kwargs": {"num_frames": 2}},
            messages=[{"role": "user", "content": [
                {"type": "video_url", "video_url": {"url": url}},
                {"type": "text", "text": RED}]}])
        return dict(r.model_extra["vlmbatch"])

    got, want = ask(remote.url("/img/c.mkv")), ask(inline)
    assert got["p_yes"] == pytest.approx(want["p_yes"], abs=1e-6)
    assert got["seconds"] == want["seconds"] and got["frames"] == 2, (got, want)
    with pytest.raises(openai.BadRequestError) as e:
        ask(f"http://localhost:{remote.httpd.server_port}/img/c.mkv")
    err = e.value.body
    assert err["code"] == "invalid_video_url" and "SSRF guard" in err["message"], err
    assert err["message"].startswith("video_url part: "), err
    assert remote.requests["/img/c.mkv"] == 1  # fetched once; the refused one never
