"""The routing rules on their own: bounded-load placement, pins that yield, moved keys, the breaker.

Plain synchronous tests over stand-in upstreams; `test_retries.py` drives the same rules through
real sockets.
"""

from __future__ import annotations

import random

import pytest

from gymproxy.errors import NoUpstream
from gymproxy.pinning import Pinner, Signer, _score
from gymproxy.upstream import CLOSED, HALF_OPEN, OPEN, Breaker, Pace


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Up:
    """What pinning reads of an upstream."""

    def __init__(self, name: str, weight: float = 1.0) -> None:
        self.name = self.url = name
        self.weight = weight
        self.healthy = True
        self.inflight = 0
        self.blocked = False
        self.pace: float | None = None

    def __repr__(self) -> str:
        return f"Up({self.name})"


SIGNER = Signer(b"secret", 3600)


def fleet(n: int = 4, **kwargs) -> tuple[list[Up], Pinner[Up], Clock]:
    ups = [Up(f"u{i}") for i in range(n)]
    clock = Clock()
    return ups, Pinner(ups, SIGNER, placement="least_outstanding", clock=clock, **kwargs), clock


def first_choice(key: str, ups: list[Up]) -> Up:
    return max(ups, key=lambda u: _score(key, u))


def keys_on(name: str, ups: list[Up], n: int) -> list[str]:
    """`n` session keys whose first rendezvous choice is the upstream `name`."""
    found = [k for k in (f"session-{i}" for i in range(5000)) if first_choice(k, ups).name == name]
    return found[:n]


# --- item 1: bounded placement ---------------------------------------------------------------------


def test_keyed_sessions_take_their_first_choice_while_balanced_and_two_workers_agree():
    ups, one, _ = fleet()
    _, other, _ = fleet()
    for u in ups:
        u.inflight = 50
    for i in range(200):
        key = f"k{i}"
        assert one.pick(None, key).upstream is first_choice(key, ups)
        # another worker (its own Pinner) over upstreams with the same names and loads
        assert other.pick(None, key).upstream.name == first_choice(key, ups).name
    assert one.moves == dict.fromkeys(one.moves, 0) and not one.moved


def test_a_hot_upstream_is_skipped_by_new_keyed_sessions():
    ups, pinner, _ = fleet()
    for u in ups:
        u.inflight = 20
    ups[0].inflight = 200  # far over max(avg * 1.25, avg + 10) (times 1.5)
    for key in keys_on("u0", ups, 20):
        pin = pinner.pick(None, key)
        assert pin.upstream is not ups[0]
        order = sorted(ups, key=lambda u: _score(key, u), reverse=True)
        assert pin.upstream is order[1]  # its next choice: under the bound
    assert pinner.moves["overloaded"] == 20


def test_the_walk_goes_past_every_upstream_over_its_bound():
    ups, pinner, _ = fleet(epsilon=0.25, slack=0, hysteresis=0)
    key = keys_on("u0", ups, 1)[0]
    order = sorted(ups, key=lambda u: _score(key, u), reverse=True)
    for u, load in zip(order, (100, 100, 1, 1), strict=True):
        u.inflight = load
    # avg = 203/4 = 50.75; bound 63.4: the first two are over it
    assert pinner.pick(None, key).upstream is order[2]


def test_weights_scale_the_bound():
    heavy, light = Up("heavy", weight=3.0), Up("light", weight=1.0)
    pinner = Pinner([heavy, light], SIGNER, placement="least_outstanding", slack=0, hysteresis=0)
    heavy.inflight, light.inflight = 60, 20  # exactly in proportion to the weights: both under bound
    for i in range(100):
        key = f"w{i}"
        assert pinner.pick(None, key).upstream is first_choice(key, [heavy, light])


def test_unkeyed_new_sessions_go_to_the_least_loaded():
    ups, pinner, _ = fleet()
    for u, load in zip(ups, (5, 3, 1, 7), strict=True):
        u.inflight = load
    assert {pinner.pick(None).upstream.name for _ in range(20)} == {"u2"}
    ups[3].inflight = 1
    assert {pinner.pick(None).upstream.name for _ in range(200)} == {"u2", "u3"}  # ties broken at random


def test_unkeyed_round_robin_when_configured():
    ups = [Up(f"u{i}") for i in range(3)]
    pinner = Pinner(ups, SIGNER, placement="round_robin")
    ups[0].inflight = 100
    assert {pinner.pick(None).upstream.name for _ in range(6)} == {"u0", "u1", "u2"}


# --- item 2: pins that yield -----------------------------------------------------------------------


def test_a_balanced_fleet_with_noise_never_moves_anyone():
    """Thousands of sessions, loads wandering ±30 % around the mean: with the default hysteresis
    no pinned or keyed session ever moves."""
    ups, pinner, _ = fleet(8)
    rng = random.Random(7)
    cookies = [SIGNER.sign(ups[i % 8].name) for i in range(400)]
    keys = [f"agent-{i}" for i in range(400)]
    homes = {k: first_choice(k, ups) for k in keys}
    for mean in (3, 20, 150, 800):
        for _ in range(25):
            for u in ups:
                u.inflight = max(0, round(rng.gauss(mean, 0.3 * mean + 2)))
            for cookie in cookies:
                assert pinner.pick(cookie).cookie is None
            for key in keys:
                assert pinner.pick(None, key).upstream is homes[key]
    assert pinner.moves == dict.fromkeys(pinner.moves, 0) and not pinner.moved


def test_a_pin_far_over_the_bound_moves_and_its_cookie_is_re_signed():
    ups, pinner, _ = fleet()
    for u in ups:
        u.inflight = 40
    cookie = SIGNER.sign("u1")
    ups[1].inflight = 80  # over the bound (55), not over bound * 1.5 (82.5)
    assert pinner.pick(cookie).cookie is None
    ups[1].inflight = 200
    pin = pinner.pick(cookie)
    assert pin.upstream is not ups[1] and pin.cookie is not None
    assert (SIGNER.unsign(pin.cookie) or ("",))[0] == pin.upstream.name
    assert pinner.moves["overloaded"] == 1
    again = pinner.pick(cookie)
    assert again.upstream is pin.upstream  # deterministic: the cookie is the key of its order
    new = pin.cookie
    ups[1].inflight = 40
    assert pinner.pick(new).cookie is None and pinner.pick(new).upstream is pin.upstream  # no flap back


def test_a_pin_moves_off_a_down_breaker_open_or_removed_upstream():
    ups, pinner, _ = fleet()
    cookie = SIGNER.sign("u2")
    ups[2].healthy = False
    assert pinner.pick(cookie).upstream is not ups[2]
    ups[2].healthy, ups[2].blocked = True, True
    assert pinner.pick(cookie).upstream is not ups[2]
    ups[2].blocked = False
    assert pinner.pick(cookie).upstream is ups[2]
    pinner.set_upstreams([u for u in ups if u is not ups[2]])
    pin = pinner.pick(cookie)
    assert pin.upstream is not ups[2] and (SIGNER.unsign(pin.cookie or "") or ("",))[0] == pin.upstream.name
    assert {k: v for k, v in pinner.moves.items() if v} == {"down": 1, "breaker": 1, "removed": 1}


def test_a_busy_answer_moves_the_session_to_its_next_choice():
    ups, pinner, _ = fleet()
    key = "agent-7"
    home = first_choice(key, ups)
    pin = pinner.pick(None, key, exclude=(home,), reason="busy")
    order = sorted(ups, key=lambda u: _score(key, u), reverse=True)
    assert pin.upstream is order[1] and pinner.moves["busy"] == 1
    assert pinner.moved[key][0] == order[1].name  # remembered: the next request goes there too
    assert pinner.pick(None, key).upstream is order[1]


def test_keyed_moves_are_remembered_then_expire():
    ups, pinner, clock = fleet(moved_ttl=60)
    for u in ups:
        u.inflight = 20
    key = keys_on("u0", ups, 1)[0]
    ups[0].inflight = 300
    moved_to = pinner.pick(None, key).upstream
    assert moved_to is not ups[0]
    ups[0].inflight = 20  # cooled down: the session stays where it went (its cache is there now)
    for _ in range(3):
        clock.now += 50  # each use keeps the entry fresh
        assert pinner.pick(None, key).upstream is moved_to
    clock.now += 61
    assert pinner.pick(None, key).upstream is ups[0]  # expired: back to its first choice
    assert key not in pinner.moved


def test_the_moved_map_is_bounded_and_drops_the_least_recently_used():
    ups, pinner, _ = fleet(moved_max=3)
    ups[0].healthy = False
    keys = keys_on("u0", ups, 10)
    for key in keys:
        pinner.pick(None, key)
    assert len(pinner.moved) == 3
    assert list(pinner.moved) == keys[-3:]


def test_a_moved_key_naming_a_removed_upstream_is_ignored():
    ups, pinner, _ = fleet()
    key = keys_on("u0", ups, 1)[0]
    target = pinner.pick(None, key, exclude=(ups[0],), reason="busy").upstream
    pinner.set_upstreams([u for u in ups if u is not target])
    assert pinner.pick(None, key).upstream is ups[0]


def test_every_upstream_breaker_open_is_503():
    ups, pinner, _ = fleet(2)
    for u in ups:
        u.blocked = True
    with pytest.raises(NoUpstream):
        pinner.pick(None, "k")


# --- the breaker ---------------------------------------------------------------------------------


def test_breaker_opens_after_n_failures_probes_once_then_closes_or_reopens():
    clock = Clock()
    breaker = Breaker("u", failures=3, cooldown=5.0, clock=clock)
    for _ in range(2):
        breaker.failed()
    breaker.succeeded()  # the streak is broken: failures must be in a row
    for _ in range(2):
        breaker.failed()
    assert breaker.state == CLOSED and not breaker.blocked
    breaker.failed()
    assert breaker.state == OPEN and breaker.blocked and breaker.opened == 1
    clock.now += 4.9
    assert breaker.blocked
    clock.now += 0.2
    assert not breaker.blocked  # the cooldown is over: one request may go
    breaker.admit()
    assert breaker.state == HALF_OPEN and breaker.blocked  # ...and only one
    breaker.failed()  # the probe failed
    assert breaker.state == OPEN and breaker.blocked and breaker.opened == 2
    clock.now += 5.1
    breaker.admit()
    breaker.abandon()  # the probe was cancelled: the next request probes
    assert not breaker.blocked
    breaker.admit()
    breaker.succeeded()
    assert breaker.state == CLOSED and not breaker.blocked and breaker.streak == 0


class Counting(list):
    """A list of upstreams that counts how often it is walked."""

    walks = 0

    def __iter__(self):
        Counting.walks += 1
        return super().__iter__()


def test_a_pin_on_a_fine_upstream_never_walks_the_fleet():
    """The hot path: with the fleet's tally, checking a valid pin is O(1) at any load."""
    from gymproxy.upstream import Tally

    ups = [Up(f"u{i}") for i in range(16)]
    tally = Tally()
    pinner = Pinner(ups, SIGNER, placement="least_outstanding", tally=tally)
    pinner.upstreams = Counting(pinner.upstreams)
    for u in ups:
        u.inflight = 500
    tally.inflight = 500 * 16
    cookie = SIGNER.sign("u3")
    Counting.walks = 0
    for _ in range(100):
        assert pinner.pick(cookie).cookie is None
    assert Counting.walks == 0
    ups[3].inflight = 2000  # looks overloaded: now (and only now) the exact check walks the fleet
    tally.inflight += 1500
    assert pinner.pick(cookie).cookie is not None and Counting.walks > 0


async def test_the_fleet_tally_follows_every_upstream():
    from gymproxy import build_config
    from gymproxy.fleet import Fleet
    from gymproxy.metrics import Metrics

    config = build_config({"base_url": ["http://a:1/v1", "http://b:1/v1"]}, environ={})
    fleet = Fleet(config, Metrics())
    a, b = fleet.upstreams
    assert a.tally is fleet.tally and b.tally is fleet.tally
    await a.acquire()
    await b.acquire()
    await b.acquire()
    assert fleet.tally.inflight == 3
    a.release()
    b.release()
    assert fleet.tally.inflight == 1 == a.inflight + b.inflight


# --- pace: an engine far slower than the fastest -----------------------------------------------------


def test_pace_is_unknown_until_a_few_replies_then_tracks_recent_ones_and_goes_stale():
    clock = Clock()
    pace = Pace(10.0, clock)
    for _ in range(19):
        pace.observe(1.0, 100)
    assert pace.value is None  # a few replies are not enough to steer by
    pace.observe(1.0, 100)
    assert pace.value == pytest.approx(0.01)
    for _ in range(300):  # the engine slows down 3x, 10 replies a second: the old ones decay away
        clock.now += 0.1
        pace.observe(3.0, 100)
    assert pace.value == pytest.approx(0.03, rel=0.02)
    for _ in range(5):  # steered off: a reply now and then keeps its pace known
        clock.now += 20
        pace.observe(3.0, 100)
        assert pace.value == pytest.approx(0.03, rel=0.02)
    clock.now += 31  # no reply for over 3 windows: not known any more (measured afresh when used)
    assert pace.value is None
    pace.observe(1.0, 100)
    assert pace.value is None  # afresh: some 20 replies again before it counts


def test_new_sessions_avoid_an_upstream_far_slower_than_the_fastest():
    ups, pinner, _ = fleet()
    for u in ups:
        u.pace = 0.020
    ups[0].pace = 0.029  # within 1.5x of the best: still takes its sessions
    keys = keys_on("u0", ups, 20)
    assert all(pinner.pick(None, key).upstream is ups[0] for key in keys)
    _, pinner, _ = fleet_over(ups)
    # Over 1.5x: new sessions without a key go elsewhere. A cookie-less keyed request may be a
    # returning session, so its first choice is held to a pin's hysteresis: 1.5 x 1.5.
    ups[0].pace = 0.031
    assert all(pinner.pick(None).upstream is not ups[0] for _ in range(50))
    assert all(pinner.pick(None, key).upstream is ups[0] for key in keys)
    _, pinner, _ = fleet_over(ups)
    ups[0].pace = 0.046
    assert all(pinner.pick(None, key).upstream is not ups[0] for key in keys)
    for u in ups[1:]:
        u.pace = None  # the others' paces are not known: nothing to compare with
    _, pinner, _ = fleet_over(ups)
    assert all(pinner.pick(None, key).upstream is ups[0] for key in keys)


def test_a_session_leaves_a_slow_upstream_only_past_the_hysteresis_and_off_turns_it_off():
    ups, pinner, clock = fleet()
    for u in ups:
        u.pace = 0.020
    cookie = SIGNER.sign("u0")
    ups[0].pace = 0.040  # 2x the best: no new sessions, but pinned ones stay (under 1.5 * 1.5)
    assert pinner.pick(cookie).cookie is None and pinner.pick(cookie).upstream is ups[0]
    ups[0].pace = 0.050  # 2.5x
    clock.now += 1  # past the cached best pace
    pin = pinner.pick(cookie)
    assert pin.upstream is not ups[0] and pinner.moves["slow"] == 1
    _, off, _ = fleet_over(ups, pace_tolerance=None)
    assert off.pick(cookie).upstream is ups[0] and off.pick(None, keys_on("u0", ups, 1)[0]).upstream is ups[0]


def test_one_upstream_that_looks_far_faster_cannot_turn_sessions_away_from_the_rest():
    # It counts 10x the tokens it makes (or is an odd fast engine): the usual pace is the lower
    # median, so the others are not slow; a real slow one still is.
    ups, pinner, clock = fleet()
    for u in ups:
        u.pace = 0.020
    ups[0].pace = 0.002
    cookies = {u.name: SIGNER.sign(u.name) for u in ups}
    assert all(pinner.pick(cookie).upstream.name == name for name, cookie in cookies.items())
    assert pinner.moves["slow"] == 0
    assert {pinner.pick(None).upstream.name for _ in range(200)} == {u.name for u in ups}
    ups[1].pace = 0.050
    clock.now += 1
    assert pinner.pick(cookies["u1"]).upstream is not ups[1] and pinner.moves["slow"] == 1
    # With two upstreams there is no majority: the faster one sets the pace.
    two, pinner, _ = fleet_over(ups[:2])
    two[0].pace, two[1].pace = 0.020, 0.031
    assert all(pinner.pick(None).upstream is two[0] for _ in range(50))


def test_pace_differences_of_timing_noise_never_count():
    ups, pinner, _ = fleet()
    for u in ups:
        u.pace = 0.0002  # a test double answering in microseconds
    ups[0].pace = 0.0015  # 7x, but 1.3 ms a token: noise, not a slow engine
    cookie = SIGNER.sign("u0")
    assert pinner.pick(cookie).upstream is ups[0] and pinner.moves["slow"] == 0


def fleet_over(ups: list[Up], **kwargs) -> tuple[list[Up], Pinner[Up], Clock]:
    clock = Clock()
    return ups, Pinner(ups, SIGNER, placement="least_outstanding", clock=clock, **kwargs), clock


# --- an upstream joins: it gets its share of the running sessions --------------------------------------


def test_pinned_sessions_whose_first_choice_joined_move_there_once_and_the_rest_stay(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr("gymproxy.pinning.time.time", lambda: now[0])
    ups, pinner, _ = fleet()
    cookies = [pinner.pick(None).cookie or "" for _ in range(2000)]
    homes = [(SIGNER.unsign(c) or ("", "", 0))[0] for c in cookies]
    now[0] += 10
    new = Up("u4")
    pinner.set_upstreams([*ups, new])
    assert all(pinner.pick(c).cookie is None for c in cookies[:50])  # not joined yet (its health check)
    pinner.joined("u4")
    now[0] += 1
    moved = 0
    for cookie, home in zip(cookies, homes, strict=True):
        pin = pinner.pick(cookie)
        _, sid, _ = SIGNER.unsign(cookie) or ("", "", 0)
        assert pin.cookie is not None and (SIGNER.unsign(pin.cookie) or ("", ""))[1] == sid  # re-signed, same id
        if first_choice(sid, [*ups, new]) is new:
            assert pin.upstream is new
            moved += 1
        else:
            assert pin.upstream.name == home  # checked once, stays
        assert pinner.pick(pin.cookie).cookie is None  # and never checked again
    assert moved == pinner.moves["joined"] and 0.8 / 5 < moved / len(cookies) < 1.2 / 5


def test_a_remembered_keyed_move_yields_to_a_first_choice_that_joined_later(monkeypatch):
    now = [1_000_000.0]
    monkeypatch.setattr("gymproxy.pinning.time.time", lambda: now[0])
    ups, pinner, _ = fleet()
    new = Up("u4")
    pinner.set_upstreams([*ups, new])
    new.healthy = False  # added, its first health check not passed yet
    key = keys_on("u4", [*ups, new], 1)[0]
    went = pinner.pick(None, key).upstream
    assert went is not new and pinner.moved[key][0] == went.name
    now[0] += 1
    new.healthy = True
    pinner.joined("u4")
    assert pinner.pick(None, key).upstream is new and key not in pinner.moved
