"""The live events hub (``app.http.live_feed``): bounded buffers, subscriber limits, the
slots kept for the tray and the dashboard, the latest of each event for a newcomer,
heartbeats, closing (the SSE stream of a real server: live/test_events.py)."""

from __future__ import annotations

import asyncio

import pytest

from app.http.live_feed import BUFFER, SESSION, TOKEN, LiveFeed, NoRoom


def test_slow_subscriber_is_dropped_and_memory_stays_bounded():
    async def scenario() -> None:
        hub = LiveFeed()
        stream = hub.stream(hub.subscribe())
        assert (await anext(stream)).startswith("retry:")
        for i in range(BUFFER * 5):  # the subscriber reads nothing meanwhile
            hub.publish("sample", {"i": i})
        assert hub.dropped == 1 and not hub.subscribers
        with pytest.raises(StopAsyncIteration):
            await anext(stream)

    asyncio.run(scenario())


def test_subscriber_that_keeps_up_gets_every_event():
    async def scenario() -> None:
        hub = LiveFeed()
        stream = hub.stream(hub.subscribe())
        await anext(stream)
        for i in range(BUFFER * 3):
            hub.publish("sample", {"i": i})
            message = await anext(stream)
            assert message == f'event: sample\ndata: {{"i":{i}}}\n\n'
        assert hub.dropped == 0

    asyncio.run(scenario())


def test_subscriber_limits_overall_and_per_client():
    hub = LiveFeed(max_subscribers=3, max_per_client=2, kept=())

    async def scenario() -> None:
        stream = hub.stream(hub.subscribe("a"))
        await anext(stream)
        second = hub.subscribe("a")
        with pytest.raises(NoRoom) as mine:
            hub.subscribe("a")
        assert mine.value.per_client
        hub.subscribe("b")
        with pytest.raises(NoRoom) as anyone:
            hub.subscribe("c")
        assert not anyone.value.per_client
        await stream.aclose()  # its slot is given back
        hub.release(second)
        hub.release(second)  # releasing twice is harmless
        assert len(hub.subscribers) == 1
        hub.subscribe("a")

    asyncio.run(scenario())


def test_a_slot_is_kept_for_the_token_and_one_for_the_session():
    """Callers without a proof, whatever ids they claim, fill only what is not kept; the
    token and the session each still get one; a second of either competes like anyone."""
    hub = LiveFeed(max_subscribers=5, max_per_client=1)
    anyone = [hub.subscribe(f"id-{i}") for i in range(3)]
    with pytest.raises(NoRoom) as full:
        hub.subscribe("id-3")
    assert not full.value.per_client
    tray = hub.subscribe("tray#admin", TOKEN)
    with pytest.raises(NoRoom):
        hub.subscribe("tray-2#admin", TOKEN)  # its kept slot is taken: the session's is not
    with pytest.raises(NoRoom):
        hub.subscribe("id-4")
    dashboard = hub.subscribe("browser#admin", SESSION)
    assert len(hub.subscribers) == 5
    hub.release(anyone[0])  # a slot no one keeps: anyone may take it
    hub.subscribe("id-5")
    hub.release(tray)  # the token's slot is kept again, from anyone and from the session
    for claimed, proof in (("id-6", ""), ("browser-2#admin", SESSION)):
        with pytest.raises(NoRoom):
            hub.subscribe(claimed, proof)
    hub.subscribe("tray#admin", TOKEN)
    hub.release(dashboard)
    assert len(hub.subscribers) == 4


def test_closing_the_hub_ends_every_stream_and_refuses_new_ones():
    async def scenario() -> tuple[list[str], list[str]]:
        hub = LiveFeed()
        first = hub.stream(hub.subscribe())
        assert await first.__anext__() == "retry: 2000\n\n"
        hub.publish("sample", {"t": 1})
        hub.close()
        late = [message async for message in hub.stream(hub.subscribe())]
        return [message async for message in first], late

    remaining, late = asyncio.run(scenario())
    assert remaining == [] and late == []  # the backlog is dropped, the stream ends


def test_a_new_subscriber_gets_the_latest_of_each_event_at_once():
    async def scenario() -> list[str]:
        hub = LiveFeed()
        hub.publish("state", {"state": "ok"})
        for i in range(3):
            hub.publish("sample", {"i": i})
        stream = hub.stream(hub.subscribe())
        assert (await anext(stream)).startswith("retry:")
        return [await anext(stream), await anext(stream)]

    assert asyncio.run(scenario()) == ['event: state\ndata: {"state":"ok"}\n\n',
                                       'event: sample\ndata: {"i":2}\n\n']


def test_heartbeats_are_comments_that_readers_skip():
    async def scenario() -> str:
        hub = LiveFeed()
        stream = hub.stream(hub.subscribe())
        await anext(stream)
        hub.heartbeat("loading")
        return await anext(stream)

    assert asyncio.run(scenario()) == ": loading\n\n"
