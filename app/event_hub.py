"""Live events for the tray and the dashboard: Server-Sent Events from one hub.

The memory monitor publishes a sample every second and a ``state`` event when
the memory state changes. Each subscriber has a small bounded buffer; one
that falls behind is dropped (its stream ends and it may reconnect), so a slow
client can never make the server hold more memory.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

BUFFER = 16
MAX_SUBSCRIBERS = 32


@dataclass(eq=False)
class Subscriber:
    queue: asyncio.Queue[str | None] = field(default_factory=lambda: asyncio.Queue(BUFFER))
    dropped: bool = False


class EventHub:
    """Publish from the event loop; each subscriber reads its own bounded queue."""

    def __init__(self, max_subscribers: int = MAX_SUBSCRIBERS) -> None:
        self.max_subscribers = max_subscribers
        self.subscribers: set[Subscriber] = set()
        self.dropped = 0
        self.closed = False
        self._latest: dict[str, str] = {}  # the last message of each event kind

    def full(self) -> bool:
        return len(self.subscribers) >= self.max_subscribers

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

    async def stream(self) -> AsyncIterator[str]:
        """One client's event stream; ends if the client falls too far behind."""
        if self.closed:
            return
        subscriber = Subscriber()
        for latest in self._latest.values():  # a new reader can draw at once
            subscriber.queue.put_nowait(latest)
        self.subscribers.add(subscriber)
        try:
            yield "retry: 2000\n\n"
            while (message := await subscriber.queue.get()) is not None:
                yield message
        finally:
            self.subscribers.discard(subscriber)
