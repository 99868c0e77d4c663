"""The runtime on an asyncio event loop: the same text as the sync API, a cancelled task stops
the decode within one token and leaves the session usable, errors reach the awaiting task."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from edgeroute.errors import InputError

PROMPT = "Navigate to 12 Baker Street in London."


def test_astream_gives_the_text_the_sync_stream_gives(tiny_engine):
    want = "".join(tiny_engine.stream(PROMPT, max_new_tokens=12))

    async def collect():
        return [piece async for piece in tiny_engine.astream(PROMPT, max_new_tokens=12)]

    pieces = asyncio.run(collect())
    assert len(pieces) > 1 and "".join(pieces) == want
    assert asyncio.run(tiny_engine.agenerate(PROMPT, max_new_tokens=12)).text == want


def test_cancelling_the_awaiting_task_stops_the_decode_within_a_token_and_the_chat_goes_on(tiny_engine):
    chat = tiny_engine.chat(max_new_tokens=400)
    seen: list[str] = []
    decoded: list[int] = []  # tokens the worker has decoded (on_token runs on it)
    at_cancel: list[int] = []

    def decode_slowly(trace):  # a token every 10 ms at least, as on a board: the cancel comes mid-answer
        decoded.append(trace.token)
        time.sleep(0.01)

    async def barge_in():
        async def speak():
            async for piece in chat.astream(PROMPT, on_token=decode_slowly):
                seen.append(piece)
                if len(seen) == 3:
                    await asyncio.sleep(10)  # still speaking when the driver cuts in

        task = asyncio.create_task(speak())
        while len(seen) < 3:
            await asyncio.sleep(0.001)
        at_cancel.append(len(decoded))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(barge_in())
    cut = chat.last
    # the worker decodes ahead of the speech; after the cancel it stops within a token (one more
    # may have begun between reading the count and cancelling)
    assert cut.finish_reason == "cancelled" and len(cut.tokens) <= at_cancel[0] + 2 and len(cut.tokens) < 400
    assert not chat._busy  # idle when the cancellation completed: the next turn runs now
    assert chat.generate("And then?", max_new_tokens=4).finish_reason in ("length", "eos")


def test_leaving_the_async_loop_early_stops_the_decode(tiny_engine):
    session = tiny_engine.session(max_new_tokens=400)

    async def first_two():
        stream = session.astream(PROMPT, on_token=lambda trace: time.sleep(0.01))  # decoding as slowly as a board
        pieces = [await anext(stream), await anext(stream)]
        await stream.aclose()
        return pieces

    assert len(asyncio.run(first_two())) == 2
    assert session.last.finish_reason == "cancelled" and len(session.last.tokens) < 400


def test_a_bad_option_raises_in_the_awaiting_task(tiny_engine):
    async def bad():
        async for _ in tiny_engine.session().astream(PROMPT, temperature=float("nan")):
            pass

    with pytest.raises(InputError, match="temperature"):
        asyncio.run(bad())


def test_a_task_cancelled_while_speaking_a_piece_stops_the_decode_and_the_chat_goes_on_in_the_same_loop(tiny_engine):
    """The voice app's loop body awaits the speech (``await tts.say(piece)``): a cancel lands
    there, outside the async generator, which stays suspended until Python closes it as garbage.
    The decode stops anyway, and the chat's next calls run on the same loop."""
    chat = tiny_engine.chat(max_new_tokens=400)
    seen: list[str] = []

    async def speak():
        async for piece in chat.astream(PROMPT, on_token=lambda trace: time.sleep(0.01)):
            seen.append(piece)
            await asyncio.sleep(10)  # saying the piece when the driver cuts in

    async def barge_in():
        task = asyncio.create_task(speak())
        while not seen:
            await asyncio.sleep(0.001)
        task.cancel()
        kept = await asyncio.gather(task, return_exceptions=True)  # the exception kept
        chat.barge_in(seen[0])  # at once: no SessionBusy
        answer = await chat.agenerate("And then?", max_new_tokens=4)
        return kept, answer

    kept, answer = asyncio.run(barge_in())
    assert isinstance(kept[0], asyncio.CancelledError)
    assert chat.messages[1]["role"] == "assistant" and len(chat.messages) == 4
    assert answer.finish_reason in ("length", "eos")


def test_a_stream_left_with_break_stops_its_decode_at_once_and_the_next_call_runs(tiny_engine):
    """``break`` drops the stream: its generation's stop is set then, not when the garbage
    collector and the loop get to close it, so the session's next call waits for that last
    token instead of raising SessionBusy."""
    session = tiny_engine.session(max_new_tokens=100)

    async def main():
        finishes = []
        for _ in range(5):
            async for _piece in session.astream(PROMPT, on_token=lambda trace: time.sleep(0.005)):
                break
            cut = session.last
            answer = await session.agenerate("And then?", max_new_tokens=2)
            finishes.append((cut.finish_reason, answer.finish_reason))
        return finishes

    for cut, answer in asyncio.run(main()):
        assert cut == "cancelled" and answer in ("length", "eos")


def test_a_stream_stopped_before_its_decode_began_stops_no_other_call_on_the_session(tiny_engine):
    """Each stream stops its own generation: a task cancelled before its worker reached the
    session leaves the generation the session runs by then alone."""
    session = tiny_engine.session(max_new_tokens=24)

    async def main():
        async def collect(stream):
            return [piece async for piece in stream]

        running = asyncio.create_task(collect(session.astream(PROMPT, on_token=lambda trace: time.sleep(0.01))))
        while not session._busy:
            await asyncio.sleep(0.001)
        late = asyncio.create_task(anext(session.astream(PROMPT)))
        await asyncio.sleep(0)  # its worker may or may not have started (and been refused as busy)
        late.cancel()
        await asyncio.gather(late, return_exceptions=True)
        await running
        return session.last

    finished = asyncio.run(main())
    assert finished.finish_reason in ("length", "eos") and len(finished.tokens) >= 1


def test_a_threaded_stream_sets_its_own_stop_when_dropped_and_no_other():
    from edgeroute.runtime.aio import ThreadedStream

    stops, release = [], threading.Event()

    def make(stop):
        stops.append(stop)
        yield "piece"
        release.wait(5)  # the worker still inside its generation
        yield "late"

    async def main():
        async for _ in ThreadedStream(make):
            break
        assert stops[0].is_set()  # at the break, before the loop ran anything else
        kept = ThreadedStream(make)
        assert await anext(kept) == "piece"
        assert not stops[1].is_set()
        release.set()
        assert [piece async for piece in kept] == ["late"]
        assert not stops[1].is_set()  # ended by itself

    asyncio.run(main())
