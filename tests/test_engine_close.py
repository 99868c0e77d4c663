"""Engine.close(): an app that swaps bundles frees the old engine's memory when it says so, not
when the garbage collector gets to it. Every session's caches, the shared prefixes and both
models go (the library's model is unmapped, ONNX Runtime's sessions and host caches are
collected, TensorRT's device buffers are freed); generations in flight end "cancelled" first,
whichever thread or event loop runs them; every later call that would run a model is an
EngineClosed; nothing crashes the process.

Each test runs on the native backend (the SmolLM2 demo bundle's GGUF blocks) and on ONNX
Runtime (the tiny Llama bundle with its SLM), the TensorRT one on the stand-ins."""

from __future__ import annotations

import asyncio
import gc
import random
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest

from edgeroute.errors import EngineClosed, InputError, NativeBackendUnavailable
from edgeroute.runtime import Engine

SYSTEM = "You are the assistant of a car. Answer briefly."
PROMPT = "Write a long story about a car that drives across Europe at night."
WAIT_S = 30  # what a test waits for a thread or an event at most (a hang fails it instead of stalling the run)
SKIPPING = dict(mode="skip", scorer="random", importance_threshold=0.6, skip_ratio=0.5, protected_first=1,
                protected_last=0, max_free_layers=1, re_eval_interval=1, fallback=None)  # layer by layer


@pytest.fixture(params=["native", "onnxruntime"])
def open_engine(request):
    """A function opening a fresh engine on the backend (each test closes its own); ``.bundle``:
    the bundle's directory."""
    if request.param == "native":
        bundle = request.getfixturevalue("smollm2_bundles")["int4"][0]
        settings = dict(backend="native", verify=False)
        try:
            Engine(bundle, **settings).close()
        except NativeBackendUnavailable as err:
            pytest.skip(str(err))
    else:
        bundle, settings = request.getfixturevalue("tiny_slm_bundle"), dict(backend="onnxruntime")

    def open_(**more):
        return Engine(bundle, **settings, **more)

    open_.bundle = Path(bundle)
    return open_


def mappings(directory: Path) -> int:
    """How many of this process's memory mappings are of files in ``directory`` (the library maps
    a model's weight file while the model lives, and unmaps it when its last holder is freed)."""
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps to see the library's mappings in")
    inside = str(directory.resolve()) + "/"
    return sum(line.split(maxsplit=5)[-1].startswith(inside) for line in maps.read_text().splitlines()
               if len(line.split(maxsplit=5)) == 6)


def wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"waited {WAIT_S} s for {what}"
        time.sleep(0.001)


def held_until_closed(engine) -> tuple[Callable, threading.Event]:
    """An on_token callback that holds the decode at its first token until the engine is closing,
    then lets it run a token every 10 ms (as on a board), so the close lands mid-answer; and the
    event it sets at that first token."""
    started = threading.Event()

    def hold(trace) -> None:
        started.set()
        wait_until(lambda: engine.closed, "close()")
        time.sleep(0.01)
    return hold, started


def assert_freed(engine) -> None:
    """The models are closed: the native handle is dropped, ONNX Runtime's sessions let go."""
    for model in (engine.llm, engine._slm):
        if model is None:
            continue
        if model.flavour == "native":
            assert model.handle is None
        else:
            assert model.head_session is None and not any(model.layer_sessions)


def test_close_frees_the_models_the_sessions_caches_and_the_shared_prefixes(open_engine):
    gc.collect()  # engines of earlier tests that are garbage already
    before = mappings(open_engine.bundle)
    engine = open_engine()
    engine.share_prefix(SYSTEM)
    chat = engine.chat(system=SYSTEM, mode="speculate", light="slm", max_new_tokens=4)
    chat.generate("Hi!")  # the SLM opened, its cache and the prefix's SLM K/V made
    other = engine.session(max_new_tokens=2)
    other.generate("One two three")
    models = [engine.llm, engine.slm]
    caches = [chat.state.llm_cache, chat.state.slm_drafter.cache, other.state.llm_cache,
              *(cache for caches in engine._prefixes.values() for cache in caches.values())]
    assert len(caches) == 5, "the shared prefix has no SLM K/V: the test would not see it freed"
    if engine.llm.flavour == "native":
        assert models[1].flavour == "native" and mappings(open_engine.bundle) >= before + 2  # both models' weights
        engine.close()
        assert all(cache.handle is None for cache in caches)
        # a closed cache holds nothing, and running on it says why (the library's -1 and "null session" before)
        assert all(cache.length == 0 for cache in caches)
        with pytest.raises(InputError, match="cache was closed"):
            caches[0].truncate(0)
        with pytest.raises(InputError, match="cache was closed"):
            caches[0].copy_from(caches[1])
        # the library unmaps a model's weights when its last holder (handle, session) is freed: one
        # cache left open (a session's, a prefix's) would keep its model mapped
        assert mappings(open_engine.bundle) == before, "the library still maps weights: a model or a cache lives"
    else:
        alive = [weakref.ref(x) for m in models for x in (m.embed_session, m.head_session, *m.layer_sessions)]
        alive += [weakref.ref(cache.keys) for cache in caches]
        del models, caches
        engine.close()
        gc.collect()
        assert not [ref for ref in alive if ref() is not None], "ONNX Runtime sessions or KV caches outlived close()"
    assert_freed(engine)
    assert chat.state is None and other.state is None and not engine._prefixes
    assert chat.messages[-1]["role"] == "assistant" and chat.last.tokens  # what the chat recorded stays


def test_every_call_that_would_run_a_model_after_close_is_engine_closed_and_the_tokenizer_still_works(open_engine):
    engine = open_engine()
    chat = engine.chat(max_new_tokens=2)
    answer = chat.generate("Hi!")
    engine.close()
    assert isinstance(EngineClosed("x"), InputError)
    path = str(engine.bundle.path)

    async def drain(stream):
        return [piece async for piece in stream]

    calls = {
        "engine.generate": lambda: engine.generate("Hi"),
        "engine.stream": lambda: list(engine.stream("Hi")),
        "engine.agenerate": lambda: asyncio.run(engine.agenerate("Hi")),
        "engine.astream": lambda: asyncio.run(drain(engine.astream("Hi"))),
        "engine.chat": lambda: engine.chat(),
        "engine.session": lambda: engine.session(),
        "engine.share_prefix": lambda: engine.share_prefix(SYSTEM),
        "engine.slm": lambda: engine.slm,
        "chat.generate": lambda: chat.generate("And then?"),
        "chat.stream": lambda: list(chat.stream("And then?")),
        "chat.generate_tokens": lambda: list(chat.generate_tokens("And then?")),
        "chat.agenerate": lambda: asyncio.run(chat.agenerate("And then?")),
        "chat.astream": lambda: asyncio.run(drain(chat.astream("And then?"))),
        "chat.listen": lambda: chat.listen("And th"),
        "chat.barge_in": lambda: chat.barge_in(None),
        "chat.reset": lambda: chat.reset(),
    }
    for name, call in calls.items():
        with pytest.raises(EngineClosed, match=r"was closed.*open the bundle again: Engine\(") as raised:
            call()
        assert path in str(raised.value), name
    ids = engine.encode("Navigate home")
    assert engine.decode(ids) == "Navigate home" and engine.decode(answer.tokens) == answer.text
    assert engine.encode_prompt([{"role": "user", "content": "Hi"}])


def test_close_from_another_thread_during_a_stream_ends_it_cancelled_and_returns(open_engine):
    engine = open_engine()
    chat = engine.chat(max_new_tokens=200)
    pieces: list[str] = []
    failed: list[BaseException] = []

    hold, started = held_until_closed(engine)

    def speak() -> None:
        try:
            pieces.extend(chat.stream(PROMPT, on_token=hold))
        except BaseException as err:  # noqa: BLE001 - the main thread's to see
            failed.append(err)

    speaker = threading.Thread(target=speak)
    speaker.start()
    assert started.wait(WAIT_S), "the stream decoded no token"
    engine.close()  # returns once the stream has stopped: its session's caches and the models are freed
    assert not chat._busy and chat.state is None
    assert_freed(engine)
    speaker.join(WAIT_S)
    assert not speaker.is_alive() and not failed, failed
    assert chat.last.finish_reason == "cancelled" and 0 < len(chat.last.tokens) < 200
    assert "".join(pieces) == chat.last.text


def test_close_from_the_thread_iterating_a_stream_frees_everything_once_the_stream_ends(open_engine):
    """This thread's own stream cannot end while close() waits: close cancels it and returns;
    the stream ends at its next piece and frees its caches and the models as it ends."""
    engine = open_engine()
    chat = engine.chat(max_new_tokens=200)
    stream = chat.stream(PROMPT)
    first = next(stream)
    engine.close()
    assert engine.closed and chat.state is not None  # the stream still holds its caches and the models
    rest = list(stream)
    assert chat.last.finish_reason == "cancelled" and chat.last.text == first + "".join(rest)
    assert chat.state is None
    assert_freed(engine)


def test_closing_again_from_any_thread_does_nothing_more(open_engine):
    engine = open_engine()
    chat = engine.chat(max_new_tokens=2)
    chat.generate("Hi!")
    closers = [threading.Thread(target=engine.close) for _ in range(3)]
    for closer in closers:
        closer.start()
    engine.close()
    for closer in closers:
        closer.join(WAIT_S)
    engine.close()
    assert engine.closed and chat.state is None
    assert_freed(engine)
    with engine:  # a with block after close closes nothing twice either
        pass


def test_a_with_block_closes_the_engine_also_when_its_body_raises(open_engine):
    with open_engine() as engine:
        chat = engine.chat(max_new_tokens=2)
        assert chat.generate("Hi!").tokens
    assert engine.closed and chat.state is None
    assert_freed(engine)
    with pytest.raises(EngineClosed):
        chat.generate("And then?")
    with pytest.raises(ValueError, match="the app's own"), open_engine() as raising:
        raising.generate("Hi!", max_new_tokens=2)
        raise ValueError("the app's own error")
    assert raising.closed
    assert_freed(raising)


def test_an_async_stream_in_flight_during_close_ends_cleanly(open_engine):
    engine = open_engine()
    chat = engine.chat(max_new_tokens=200)

    async def main():
        hold, started = held_until_closed(engine)  # on the stream's worker thread

        async def speak():
            return [piece async for piece in chat.astream(PROMPT, on_token=hold)]

        task = asyncio.create_task(speak())
        assert await asyncio.to_thread(started.wait, WAIT_S)
        engine.close()  # on the loop's thread: the decode runs on the worker, which stops within a token
        return await asyncio.wait_for(task, WAIT_S)

    pieces = asyncio.run(main())
    assert chat.last.finish_reason == "cancelled" and 0 < len(chat.last.tokens) < 200
    assert "".join(pieces) == chat.last.text
    assert chat.state is None
    assert_freed(engine)


def close_while_generating(engine, delay: float) -> list[object]:
    """Close ``engine`` ``delay`` seconds after three threads began generating on it; what each
    call gave: a Generation, an EngineClosed, or ("failed", the exception)."""
    outcomes: list[object] = []

    def run(call) -> None:
        try:
            outcomes.append(call())
        except EngineClosed as err:
            outcomes.append(err)
        except BaseException as err:  # noqa: BLE001 - the main thread's to see
            outcomes.append(("failed", err))

    calls = [lambda: engine.chat(**SKIPPING).generate(PROMPT, max_new_tokens=48),
             lambda: engine.chat(mode="speculate", light="slm").generate(PROMPT, max_new_tokens=48),
             lambda: [engine.generate(PROMPT, max_new_tokens=4) for _ in range(8)][-1]]
    threads = [threading.Thread(target=run, args=(call,)) for call in calls]
    for thread in threads:
        thread.start()
    time.sleep(delay)
    engine.close()
    for thread in threads:
        thread.join(WAIT_S)
    assert not any(thread.is_alive() for thread in threads)
    return outcomes


@pytest.mark.filterwarnings("ignore::edgeroute.errors.UnmeasuredQualityWarning")
def test_generations_racing_with_close_end_cancelled_or_refused_and_never_crash(open_engine):
    """Close at a random moment while three threads generate, one skipping layers (a pass layer
    by layer: the library's embedding and head on the model's own handle), one drafting with the
    SLM (opened while close may run), one starting sessions on the engine: each generation ends
    (cancelled, or done before the close) or is refused with EngineClosed, never another error
    and never a crash."""
    rng = random.Random(0)
    for round_ in range(4):
        engine = open_engine()
        outcomes = close_while_generating(engine, rng.uniform(0, 0.05) * round_)
        assert len(outcomes) == 3 and not [o for o in outcomes if isinstance(o, tuple)], outcomes
        for outcome in outcomes:
            if not isinstance(outcome, EngineClosed):
                assert outcome.finish_reason in ("cancelled", "length", "eos")
        assert_freed(engine)


# -- TensorRT, on the stand-ins (tests/test_tensorrt_backend.py) ---------------------------------

@pytest.fixture
def fake_gpu(tiny_models, tmp_path_factory, monkeypatch):
    """A tiny tensorrt-target bundle with its SLM, the stand-ins installed (host memory as the
    device's) and its engines "built"; the stand-in CUDA runtime, which counts what is allocated."""
    from edgeroute.bundle import Bundle
    from edgeroute.runtime.backends import tensorrt as trt_backend
    from edgeroute.runtime.backends.tensorrt_engines import EngineLimits
    from edgeroute.runtime.backends.tensorrt_standins import (
        STANDIN_GPU,
        HostCudaRuntime,
        StandinTensorRT,
        build_standin_engines,
    )
    from tests.conftest import export_tiny

    out = tmp_path_factory.mktemp("close-trt") / "llama"
    export_tiny(tiny_models["llama"][0], out, quant="int4-rtn", target="tensorrt", slm=str(tiny_models["llama"][0]),
                slm_layers=1)
    bundle = Bundle.open(out)
    cudart = HostCudaRuntime()
    monkeypatch.setattr(trt_backend, "gpu_modules", lambda: (StandinTensorRT(bundle, cudart), cudart))
    monkeypatch.setattr(trt_backend, "gpu_identity", lambda: STANDIN_GPU)
    build_standin_engines(bundle, out.parent / "engines", EngineLimits(256, 64, 16, 1 << 30))
    return bundle, out.parent / "engines", cudart


def test_close_frees_every_device_buffer_of_the_tensorrt_backend(fake_gpu):
    bundle, engines, cudart = fake_gpu
    engine = Engine(bundle, backend="tensorrt", engine_cache=str(engines))
    engine.share_prefix(SYSTEM)
    chat = engine.chat(system=SYSTEM, mode="speculate", light="slm", max_new_tokens=4)
    chat.generate("Hi!")
    assert engine.slm.flavour == "tensorrt" and cudart.buffers
    engine.close()
    assert not cudart.buffers, f"{len(cudart.buffers)} device buffers outlived close()"
    with pytest.raises(InputError, match="closed"):
        engine.llm.embed([1, 2])
    with pytest.raises(EngineClosed):
        chat.generate("And then?")


def test_an_engine_that_fails_to_open_after_its_model_loaded_frees_the_model_at_once(fake_gpu, tmp_path):
    from edgeroute.runtime.backends.tensorrt_engines import EngineLimits
    from edgeroute.runtime.backends.tensorrt_standins import build_standin_engines

    bundle, _, cudart = fake_gpu
    build_standin_engines(bundle, tmp_path, EngineLimits(128, 64, 16, 1 << 30))  # fewer positions than exported
    with pytest.raises(InputError, match="exceeds the 128 positions") as failed:
        Engine(bundle, backend="tensorrt", engine_cache=str(tmp_path), context_length=129)
    assert failed.value.__traceback__ is not None  # it holds the engine half-made: its model must not wait for it
    assert not cudart.buffers, f"{len(cudart.buffers)} device buffers of an engine that failed to open"
