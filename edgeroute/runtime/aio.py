"""The runtime on an asyncio event loop: a generation's text pieces as an async iterator, the
decode on a worker thread, so a voice pipeline built on asyncio awaits tokens without a
thread of its own and without blocking its loop (audio in and out keeps flowing).

Cancelling the task that consumes the pieces (a barge-in), or closing the iterator early,
stops the decode within one token: the session's ``cancel()`` is called and the worker is
awaited. A task cancelled while its ``async for`` body awaits (``await tts.say(piece)``) leaves
the async generator suspended at a ``yield``, where no cancellation reaches it: Python closes
an abandoned async generator only when it is garbage, later. So the task's end stops the decode
(once: the late close must not stop the session's next call), and the session's next call
waits for that last token (``Session._exclusive``).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_PIECE, _END, _ERROR = range(3)


async def iterate_in_thread(make: Callable[[], Iterator[T]], cancel: Callable[[], None]) -> AsyncIterator[T]:
    """The items of ``make()``, iterated on a worker thread, delivered on the running loop.
    ``cancel``: stops the iteration in progress within one item (``Session.cancel``)."""
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    stop = threading.Event()  # a stop before the worker began: its first item ends it
    # the iteration is over: a cancel() from here on (an abandoned generator closed late) would
    # stop whatever call the session runs by then
    over = threading.Event()

    def produce() -> None:
        try:
            for item in make():
                loop.call_soon_threadsafe(items.put_nowait, (_PIECE, item))
                if stop.is_set():
                    break
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting task as it is
            loop.call_soon_threadsafe(items.put_nowait, (_ERROR, err))
        else:
            loop.call_soon_threadsafe(items.put_nowait, (_END, None))
        finally:
            over.set()

    def halt(_task: asyncio.Task | None = None) -> None:
        # once: the consumer's end halts first, and the generator it abandoned is closed later
        # (when it is garbage), by which time the session may run its next call
        if stop.is_set():
            return
        stop.set()
        if not over.is_set():
            cancel()

    # the consuming task may end (cancelled, or raising) outside the generator's frame, in its loop body
    consumer = asyncio.current_task()
    if consumer is not None:
        consumer.add_done_callback(halt)
    worker = loop.run_in_executor(None, produce)
    try:
        while True:
            kind, value = await items.get()
            if kind == _END:
                return
            if kind == _ERROR:
                raise value
            yield value
    finally:
        if consumer is not None:
            consumer.remove_done_callback(halt)
        halt()
        await asyncio.shield(worker)  # the decode has stopped (within one token) when this returns
