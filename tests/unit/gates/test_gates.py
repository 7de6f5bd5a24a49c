"""Token buckets with a fake clock; Host and Origin parsing."""

from __future__ import annotations

import pytest

from app.errors import RateLimited
from app.gates.host_origin import HostOriginGate, split_host
from app.gates.rate_limit import Rate, RateLimiter
from app.http.scope import client_key, route_family
from app.http.stats import RequestStats


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def limiter(clock: FakeClock, burst: int = 3, per_second: float = 1.0,
            global_rate: Rate | None = None, max_clients: int = 4096) -> RateLimiter:
    return RateLimiter({"classify": Rate(burst, per_second)},
                       {"classify": global_rate} if global_rate else {}, clock=clock,
                       max_clients=max_clients)


def test_burst_then_refill():
    clock = FakeClock()
    rl = limiter(clock)
    assert [rl.check("classify", "a").allowed for _ in range(4)] == [True, True, True, False]
    clock.now += 0.5
    assert not rl.check("classify", "a").allowed
    clock.now += 0.5
    assert rl.check("classify", "a").allowed
    assert not rl.check("classify", "a").allowed


def test_retry_after_arithmetic():
    clock = FakeClock()
    rl = limiter(clock, burst=2, per_second=0.25)  # one token every 4 s
    rl.check("classify", "a")
    rl.check("classify", "a")
    clock.now += 1.0
    denied = rl.check("classify", "a")
    assert not denied.allowed and denied.retry_after == pytest.approx(3.0)
    error = RateLimited("x", retry_after=denied.retry_after, limit=denied.limit,
                        reset=denied.reset)
    headers = error.headers()
    assert headers["Retry-After"] == "3" and headers["RateLimit-Limit"] == "2"
    assert headers["RateLimit-Remaining"] == "0" and headers["RateLimit-Reset"] == "7"
    assert error.status == 429


def test_rejections_cost_no_token():
    clock = FakeClock()
    rl = limiter(clock, burst=1, per_second=1.0)
    assert rl.check("classify", "a").allowed
    for _ in range(50):  # an impatient client hammering
        clock.now += 0.01
        assert not rl.check("classify", "a").allowed
    clock.now += 0.5  # 1 s after its last success: honouring Retry-After works
    assert rl.check("classify", "a").allowed
    assert rl.rejected == 50


def test_clients_are_separate_but_share_the_global_bucket():
    clock = FakeClock()
    rl = limiter(clock, burst=2, global_rate=Rate(3, 1.0))
    assert rl.check("classify", "a").allowed and rl.check("classify", "a").allowed
    assert not rl.check("classify", "a").allowed
    assert rl.check("classify", "b").allowed
    assert not rl.check("classify", "b").allowed  # b has a token, the global bucket not


def test_a_check_outside_the_global_bucket_neither_needs_nor_takes_its_tokens():
    clock = FakeClock()
    rl = limiter(clock, burst=2, global_rate=Rate(1, 1.0))
    assert rl.check("classify", "a").allowed
    assert not rl.check("classify", "b").allowed  # the global bucket is empty
    assert rl.check("classify", "c", shared=False).allowed
    clock.now += 1.0  # one global token back, and "c" did not take it
    assert rl.check("classify", "b").allowed


def test_idle_buckets_expire_and_memory_is_bounded():
    clock = FakeClock()
    rl = limiter(clock, burst=2, per_second=1.0, max_clients=100)
    for i in range(1000):
        rl.check("classify", f"client-{i}")
    assert len(rl) <= 100
    clock.now += 10  # every bucket is full again
    rl.check("classify", "late")
    assert len(rl) == 1


def test_families_and_keys():
    assert route_family("POST", "/v1/classify") == "classify"
    assert route_family("POST", "/v1/memory/empty-cache") == "admin"
    assert route_family("GET", "/v1/memory") == "read"
    scope = {"client": ("127.0.0.1", 5000), "headers": [(b"x-client-id", b"photo-app")]}
    assert client_key(scope) == "127.0.0.1/photo-app"
    scope["headers"] = [(b"x-client-id", b"bad id with spaces")]
    assert client_key(scope) == "127.0.0.1"


@pytest.mark.parametrize(("value", "expected"), [
    ("127.0.0.1:8765", ("127.0.0.1", 8765)),
    ("[::1]:8765", ("::1", 8765)),
    ("[::1]", ("::1", None)),
    ("LocalHost:8765", ("localhost", 8765)),
    ("evil.example", ("evil.example", None)),
    ("::1:8765", None),
    ("[::1", None),
    ("[::1]x", None),
    ("localhost:abc", None),
    ("", None),
])
def test_split_host(value, expected):
    assert split_host(value) == expected


def test_host_and_origin_rules():
    guard = HostOriginGate(app=None, port=8765, extra_hosts=["myhost.lan"],  # type: ignore[arg-type]
                            allowed_origins=["http://localhost:3000"], stats=RequestStats())
    for ok in ("127.0.0.1:8765", "localhost:8765", "[::1]:8765", "myhost.lan:8765"):
        assert guard.host_allowed(ok)
    for bad in ("evil.example", "evil.example:8765", "127.0.0.1:9999", "127.0.0.1", None,
                "127.0.0.1.evil.example:8765"):
        assert not guard.host_allowed(bad)
    assert guard.origin_allowed("http://localhost:3000")
    assert guard.origin_allowed("http://127.0.0.1:8765")  # our own /docs page
    for bad in ("https://evil.example", "null", "http://localhost:3001", "file://"):
        assert not guard.origin_allowed(bad)


def test_configured_public_names_pass_with_any_port_or_only_the_one_they_name():
    """Behind a reverse proxy (or Ray Serve's) the Host is the public name and the proxy's
    port; our loopback names still need our own port."""
    guard = HostOriginGate(app=None, port=8765, allowed_origins=[],  # type: ignore[arg-type]
                           extra_hosts=["vision.example.com", "API.example.com:8443",
                                        "[2001:db8::1]", "2001:db8::2"], stats=RequestStats())
    for ok in ("vision.example.com", "vision.example.com:443", "Vision.Example.COM:8000",
               "api.example.com:8443", "[2001:db8::1]:8000", "[2001:db8::2]"):
        assert guard.host_allowed(ok), ok
    for bad in ("api.example.com", "api.example.com:443", "evil.example:443",
                "vision.example.com.evil.example", "localhost:8000", "127.0.0.1"):
        assert not guard.host_allowed(bad), bad
    for ok in ("https://vision.example.com", "http://vision.example.com:8765",
               "https://api.example.com:8443"):
        assert guard.origin_allowed(ok), ok  # our own pages, also through a TLS proxy
    for bad in ("https://evil.example", "ftp://vision.example.com", "https://localhost:8765",
                "https://127.0.0.1:8765",  # no TLS proxy on a loopback name
                "http://vision.example.com:3000",  # another web service on that machine
                "https://api.example.com"):  # not the port its entry names
        assert not guard.origin_allowed(bad), bad


def test_a_listed_loopback_name_stays_tied_to_our_port():
    """Listing localhost in allowed_hosts must not let other local web servers' pages in
    (a development server on localhost:3000 is another site)."""
    guard = HostOriginGate(app=None, port=8765, allowed_origins=[],  # type: ignore[arg-type]
                           extra_hosts=["localhost", "127.0.0.1:3000"], stats=RequestStats())
    assert guard.host_allowed("localhost:8765") and guard.origin_allowed("http://localhost:8765")
    for bad in ("localhost:3000", "127.0.0.1:3000"):
        assert not guard.host_allowed(bad), bad
    for bad in ("http://localhost:3000", "http://127.0.0.1:3000", "https://localhost"):
        assert not guard.origin_allowed(bad), bad
