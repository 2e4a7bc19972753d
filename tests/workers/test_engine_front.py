"""The asyncio engine streams each request's tokens as they come, serves many at once, and a
caller that goes away gets its request aborted and its pages back."""

import asyncio

import pytest
import torch

from cairn.workers import EngineFront, Engine, EngineError, SamplingParams

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def path(hf_checkpoint):
    return hf_checkpoint("dense")


def prompts(n, length=9):
    g = torch.Generator().manual_seed(n)
    return [torch.randint(0, 211, (length + i,), generator=g).tolist() for i in range(n)]


async def collect(engine, prompt, params=PARAMS):
    return [out async for out in engine.generate(prompt, params)]


def test_concurrent_streams_equal_the_batch_engine(path):
    ps = prompts(4)
    expected = [o.token_ids for o in Engine.from_pretrained(path, num_pages=64).generate(ps, PARAMS)]

    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        streams = await asyncio.gather(*(collect(engine, p) for p in ps))
        await engine.close()
        return streams

    for stream, want in zip(asyncio.run(main()), expected):
        assert [t for out in stream for t in out.new_token_ids] == want  # one token per chunk, in order
        assert stream[-1].finished and not any(o.finished for o in stream[:-1])
        assert stream[-1].token_ids == want


def test_a_caller_that_stops_reading_aborts_its_request_and_frees_its_pages(path):
    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        agen = engine.generate(prompts(1, 40)[0], SamplingParams(max_tokens=200, ignore_eos=True))
        await agen.__anext__()
        assert engine.engine.cache.pages.num_held > 0
        await agen.aclose()  # what a disconnecting HTTP client does
        free = engine.engine.cache.pages.num_held
        still = await collect(engine, prompts(1)[0])  # the engine keeps serving
        await engine.close()
        return free, still

    held, still = asyncio.run(main())
    assert held == 0  # nothing held; its whole pages stay cached for reuse
    assert still[-1].finished


def test_abort_ends_the_stream_with_finish_reason_abort(path):
    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        outs = []
        async for out in engine.generate(prompts(1)[0], SamplingParams(max_tokens=500, ignore_eos=True),
                                         request_id="r1"):
            outs.append(out)
            if len(outs) == 2:
                assert await engine.abort("r1")
        await engine.close()
        return outs, engine.engine.cache.pages.num_held

    outs, free = asyncio.run(main())
    assert outs[-1].finish_reason == "abort" and free == 0


def test_a_refused_request_raises_at_once_and_others_continue(path):
    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        with pytest.raises(ValueError, match="at least one token"):
            await collect(engine, [])
        good = await collect(engine, prompts(1)[0])
        await engine.close()
        return good

    assert asyncio.run(main())[-1].finished


def test_an_engine_fault_fails_requests_in_flight_but_not_the_loop(path, monkeypatch):
    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        real_step = engine.engine.step
        calls = {"n": 0}

        def flaky_step():
            calls["n"] += 1
            if calls["n"] == 2:
                raise RuntimeError("simulated kernel fault")
            return real_step()

        engine.engine.step = flaky_step
        with pytest.raises(EngineError, match="internal error"):
            await collect(engine, prompts(1)[0])
        after = await collect(engine, prompts(1)[0])
        await engine.close()
        return after, engine.engine.cache.pages.num_held

    after, free = asyncio.run(main())
    assert after[-1].finished and free == 0


def test_a_reader_that_falls_behind_pauses_its_request_and_the_others_go_on(path):
    """A caller that takes nothing: its request computes `MAX_BUFFERED` outputs and then waits,
    holding its slot, while another request runs to its end; read again, it resumes and ends with
    the tokens it computes alone."""
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    alone = Engine.from_pretrained(path, num_pages=64).generate([prompts(1, 20)[0]], long)[0].token_ids

    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        behind = engine.generate(prompts(1, 20)[0], long, "behind")
        first = await behind.__anext__()
        other = await collect(engine, prompts(2)[1], SamplingParams(max_tokens=60, temperature=0, ignore_eos=True))
        seq = engine.engine._requests["behind"]
        computed, paused = len(seq.output_token_ids), seq.paused
        rest = [out async for out in behind]
        await engine.close()
        return first, computed, paused, other, rest

    first, computed, paused, other, rest = asyncio.run(main())
    assert other[-1].finished and len(other[-1].token_ids) == 60
    assert paused and computed <= EngineFront.MAX_BUFFERED + 2, f"{computed} tokens computed for nobody"
    assert [t for out in [first, *rest] for t in out.new_token_ids] == alone and rest[-1].finished


def test_the_engine_is_loaded_on_the_thread_that_steps_it(path, monkeypatch):
    """Model loading and steps share one thread: on a CPU each thread that runs torch's parallel
    ops gets an OpenMP team of its own, and two teams on few cores slow every step (module doc)."""
    import threading

    seen: dict[str, set[int]] = {"load": set(), "step": set()}
    load, step = Engine.from_pretrained.__func__, Engine.step

    def loading(cls, *args, **kwargs):
        seen["load"].add(threading.get_ident())
        return load(cls, *args, **kwargs)

    def stepping(self):
        seen["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(Engine, "from_pretrained", classmethod(loading))
    monkeypatch.setattr(Engine, "step", stepping)

    async def main():
        engine = EngineFront.from_pretrained(path, num_pages=64)
        await collect(engine, prompts(1)[0])
        await engine.close()

    asyncio.run(main())
    assert len(seen["load"]) == 1 and seen["load"] == seen["step"] and threading.get_ident() not in seen["load"]
