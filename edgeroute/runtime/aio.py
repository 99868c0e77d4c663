"""The runtime on an asyncio event loop: a generation's text pieces as an async iterator, the
decode on a worker thread, so a voice pipeline built on asyncio awaits tokens without a
thread of its own and without blocking its loop (audio in and out keeps flowing).

Each stream owns the stop event of its one generation, so stopping it never reaches another
call on the session. It stops within one token when the task consuming it is cancelled (also
while the loop body awaits, ``await tts.say(piece)``), when it is closed (``aclose()``), and
when it is dropped: a bare ``break`` out of ``async for`` lets go of the stream, which sets its
event at once (an async generator would stay suspended until the garbage collector and the
loop closed it, and the session's next call would find the decode still running). The
session's next call waits for that last token (``Session._exclusive``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
_PIECE, _END, _ERROR = range(3)


def _produce(make: Callable[[threading.Event], Iterator[T]], stop: threading.Event,
             loop: asyncio.AbstractEventLoop, items: asyncio.Queue) -> None:
    try:
        if not stop.is_set():  # stopped before the worker began: no generation at all
            for item in make(stop):
                loop.call_soon_threadsafe(items.put_nowait, (_PIECE, item))
                if stop.is_set():  # whatever ``make`` does with it: no item after the one in flight
                    break
    except BaseException as err:  # noqa: BLE001 - handed to the awaiting task as it is
        loop.call_soon_threadsafe(items.put_nowait, (_ERROR, err))
    else:
        loop.call_soon_threadsafe(items.put_nowait, (_END, None))


class ThreadedStream(AsyncIterator[T], Generic[T]):
    """The items of ``make(stop)``, iterated on a worker thread once the stream is first awaited,
    delivered on the running loop. ``make`` must end its iteration within one item once ``stop``
    is set (``Session`` makes it the generation's cancel event)."""

    def __init__(self, make: Callable[[threading.Event], Iterator[T]]) -> None:
        self._make = make
        self._stop = threading.Event()
        self._items: asyncio.Queue | None = None
        self._worker: asyncio.Future | None = None
        self._consumer: asyncio.Task | None = None
        self._over = False
        # neither the worker nor the consumer's callback holds the stream: dropping it must free it
        self._stop_at_consumer_end = lambda _task, stop=self._stop: stop.set()

    def _start(self) -> None:
        loop = asyncio.get_running_loop()
        self._items = asyncio.Queue()
        # the consuming task may end (cancelled, or raising) in its loop body, where no
        # cancellation reaches this stream, and its traceback may keep the stream alive
        self._consumer = asyncio.current_task()
        if self._consumer is not None:
            self._consumer.add_done_callback(self._stop_at_consumer_end)
        self._worker = loop.run_in_executor(None, _produce, self._make, self._stop, loop, self._items)

    def _end(self) -> None:
        self._over = True
        if self._consumer is not None:
            self._consumer.remove_done_callback(self._stop_at_consumer_end)
            self._consumer = None

    def __aiter__(self) -> ThreadedStream[T]:
        return self

    async def __anext__(self) -> T:
        if self._over:
            raise StopAsyncIteration
        if self._worker is None:
            self._start()
        try:
            kind, value = await self._items.get()
        except asyncio.CancelledError:
            await self.aclose()  # the decode has stopped (within one token) when the cancellation completes
            raise
        if kind == _PIECE:
            return value
        self._end()
        if kind == _ERROR:
            raise value
        raise StopAsyncIteration

    async def aclose(self) -> None:
        """Stops the iteration within one item and waits for the worker to return."""
        self._stop.set()
        self._end()
        if self._worker is not None:
            await asyncio.shield(self._worker)

    def __del__(self) -> None:
        self._stop.set()
