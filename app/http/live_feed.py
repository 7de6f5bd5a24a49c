"""Live events for the tray and the dashboard: Server-Sent Events from one hub.

The memory monitor publishes a sample every second and a ``state`` event when
the memory state changes. Each subscriber has a small bounded buffer; one
that falls behind is dropped (its stream ends and it may reconnect), so a slow
client can never make the server hold more memory.

A slot is taken by ``subscribe``, synchronously in the request's handler, and
not when the stream first runs: otherwise many requests arriving together all
pass the check before any of them subscribes (40 at once all got streams, and
the dashboard then got none). One client (the rate limiter's: its address plus
``X-Client-Id``) may hold ``MAX_STREAMS_PER_CLIENT`` of them.

One slot is kept for each caller that proves who it is (``KEPT``): the tray, with the
admin token, and the dashboard, with its session. A client id is only a claim, so one
program rotating ids could otherwise hold every slot; while a proof holds no slot, its
slot is free for it alone.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

BUFFER = 16
MAX_SUBSCRIBERS = 32
# The tray needs one stream and each dashboard tab one; a browser's tabs share one client.
# Four leaves room for a few tabs and a reconnect that overlaps the stream it replaces,
# while a client that does not name itself holds at most an eighth of the slots.
MAX_STREAMS_PER_CLIENT = 4
TOKEN, SESSION = "token", "session"  # what a caller proved: the admin token, a dashboard session
KEPT = (TOKEN, SESSION)  # a slot kept for each: the tray's and the dashboard's


class NoRoom(Exception):
    """No stream slot is free: for anyone (``per_client`` False) or for this client."""

    def __init__(self, per_client: bool) -> None:
        super().__init__("per client" if per_client else "all")
        self.per_client = per_client


@dataclass(eq=False)
class Subscriber:
    client: str = ""
    proof: str = ""  # TOKEN, SESSION or nothing
    queue: asyncio.Queue[str | None] = field(default_factory=lambda: asyncio.Queue(BUFFER))
    dropped: bool = False


class LiveFeed:
    """Publish from the event loop; each subscriber reads its own bounded queue."""

    def __init__(self, max_subscribers: int = MAX_SUBSCRIBERS,
                 max_per_client: int = MAX_STREAMS_PER_CLIENT,
                 kept: tuple[str, ...] = KEPT) -> None:
        self.max_subscribers = max_subscribers
        self.max_per_client = max_per_client
        self.kept = kept
        self.subscribers: set[Subscriber] = set()
        self.dropped = 0
        self.closed = False
        self._latest: dict[str, str] = {}  # the last message of each event kind

    def subscribe(self, client: str = "", proof: str = "") -> Subscriber:
        """Take a slot for ``client``, which proved ``proof`` (or nothing), now, or raise
        NoRoom. Synchronous, so nothing else runs between the check and the taking. After
        ``close`` the subscriber is not added: its stream ends at once."""
        subscriber = Subscriber(client, proof)
        if self.closed:
            return subscriber
        if len(self.subscribers) >= self.max_subscribers - self._kept_from(proof):
            raise NoRoom(per_client=False)
        if sum(s.client == client for s in self.subscribers) >= self.max_per_client:
            raise NoRoom(per_client=True)
        for latest in self._latest.values():  # a new reader can draw at once
            subscriber.queue.put_nowait(latest)
        self.subscribers.add(subscriber)
        return subscriber

    def _kept_from(self, proof: str) -> int:
        """The slots kept for others than ``proof``: one for each kept proof that holds
        none now (once it holds one, it competes for the rest like anyone)."""
        held = {s.proof for s in self.subscribers}
        return sum(kind != proof and kind not in held for kind in self.kept)

    def release(self, subscriber: Subscriber) -> None:
        """Give the slot back (idempotent): the stream ended, or never started."""
        self.subscribers.discard(subscriber)

    def publish(self, event: str, data: dict[str, object]) -> None:
        message = f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"
        self._latest[event] = message
        self._send(message)

    def heartbeat(self, note: str) -> None:
        """An SSE comment: proof of life for readers while there is nothing to report
        (before the model is ready), so they can tell a silent server from a dead one."""
        self._send(f": {note}\n\n")

    def _send(self, message: str) -> None:
        for subscriber in list(self.subscribers):
            try:
                subscriber.queue.put_nowait(message)
            except asyncio.QueueFull:
                self._drop(subscriber)

    def _drop(self, subscriber: Subscriber) -> None:
        subscriber.dropped = True
        self.dropped += 1
        self._end(subscriber)

    def _end(self, subscriber: Subscriber) -> None:
        self.subscribers.discard(subscriber)
        while not subscriber.queue.empty():  # free its backlog, then tell it to end
            subscriber.queue.get_nowait()
        subscriber.queue.put_nowait(None)

    def close(self) -> None:
        """End every stream now (the server is shutting down): an open stream would
        hold the shutdown up for the whole graceful timeout."""
        self.closed = True
        for subscriber in list(self.subscribers):
            self._end(subscriber)

    async def stream(self, subscriber: Subscriber) -> AsyncIterator[str]:
        """The event stream of a subscriber from ``subscribe``; ends if it falls too far
        behind, and gives its slot back when it ends."""
        try:
            if self.closed:
                return
            yield "retry: 2000\n\n"
            while (message := await subscriber.queue.get()) is not None:
                yield message
        finally:
            self.release(subscriber)
