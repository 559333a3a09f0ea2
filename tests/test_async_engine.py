"""AsyncLLM: concurrent streams give the offline engine's results, every streamed text is a prefix
of the final one, leaving a stream aborts its request and frees its blocks, and a bad request
fails alone."""
from __future__ import annotations

import asyncio

import pytest

from qtk.errors import InputError
from qtk.runtime.detokenizer import held_back


@pytest.fixture(scope="module")
def engines(tiny_dir):
    from qtk import LLM
    from qtk.runtime.async_engine import AsyncLLM

    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory=2**20, block_size=8)
    engine = AsyncLLM(LLM(str(tiny_dir), **kw))
    yield LLM(str(tiny_dir), **kw), engine
    engine.shutdown()


async def collect(engine, prompt, params, request_id=None):
    return [out async for out in engine.generate(prompt, params, request_id)]


def test_concurrent_streams_match_the_offline_engine(engines):
    from qtk import SamplingParams

    offline, engine = engines
    prompts = [list(range(300, 300 + n)) for n in (5, 17, 9)]
    params = [SamplingParams(max_tokens=m, temperature=0, ignore_eos=True, stop=["e"] if i == 1 else None)
              for i, m in enumerate((12, 7, 20))]
    want = offline.generate(prompts, params)

    async def main():
        return await asyncio.gather(*(collect(engine, p, sp) for p, sp in zip(prompts, params)))

    for stream, ref in zip(asyncio.run(main()), want):
        final = stream[-1].outputs[0]
        assert final.token_ids == ref.outputs[0].token_ids and final.text == ref.outputs[0].text
        assert final.finish_reason == ref.outputs[0].finish_reason and stream[-1].finished
        assert not any(o.finished for o in stream[:-1])
        texts = [o.outputs[0].text for o in stream]
        assert all(final.text.startswith(t) for t in texts)  # never shows text it takes back
        assert [len(o.outputs[0].token_ids) for o in stream] == sorted(len(o.outputs[0].token_ids) for o in stream)


def test_leaving_a_stream_aborts_it_and_a_bad_request_fails_alone(engines):
    from qtk import SamplingParams

    _, engine = engines
    bm = engine.llm.block_manager
    free_before = bm.num_free_blocks

    async def leave_early():
        async for out in engine.generate(list(range(300, 340)), SamplingParams(max_tokens=100, ignore_eos=True)):
            if len(out.outputs[0].token_ids) >= 3:
                return out

    async def main():
        bad = collect(engine, [], SamplingParams(max_tokens=4))
        good = collect(engine, list(range(400, 410)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        return await asyncio.gather(leave_early(), bad, good, return_exceptions=True)

    left, bad, good = asyncio.run(main())
    assert len(left.outputs[0].token_ids) == 3 and not left.finished
    assert isinstance(bad, InputError) and "empty" in str(bad)
    assert good[-1].finished and len(good[-1].outputs[0].token_ids) == 6

    async def settle():  # the abort reaches the engine thread between steps
        for _ in range(100):
            if not engine.llm.has_unfinished_requests():
                return
            await asyncio.sleep(0.05)

    asyncio.run(settle())
    assert not engine.llm.has_unfinished_requests() and bm.num_free_blocks == free_before


def test_a_failed_engine_fails_every_open_stream(tiny_dir):
    """A step that raises (a bug, out of memory) ends every open stream with EngineDeadError, each its
    own error, and later requests are refused the same way."""
    from qtk import LLM, SamplingParams
    from qtk.runtime.async_engine import AsyncLLM, EngineDeadError

    llm = LLM(str(tiny_dir), dtype="float32", max_model_len=128, kv_cache_memory=2**20, block_size=8)
    engine = AsyncLLM(llm)
    step, steps = llm.step, []

    def failing_step():
        steps.append(1)
        if len(steps) == 3:
            raise MemoryError("out of memory in step 3")
        return step()

    llm.step = failing_step
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)

    async def main():
        return await asyncio.gather(*(collect(engine, list(range(300, 300 + n)), params) for n in (5, 9, 13)),
                                    return_exceptions=True)

    try:
        errors = asyncio.run(main())
        assert all(isinstance(e, EngineDeadError) and "out of memory in step 3" in str(e) for e in errors), errors
        assert len({id(e) for e in errors}) == 3
        assert isinstance(engine.dead, MemoryError)
        with pytest.raises(EngineDeadError, match="out of memory in step 3"):
            asyncio.run(collect(engine, [300, 301], params))
    finally:
        engine.shutdown()


def test_held_back_is_the_longest_suffix_that_could_start_a_stop_string():
    assert held_back("Hello wor", ("world",)) == 3
    assert held_back("Hello", ("lo!", "xyz")) == 2
    assert held_back("Hello", ("abc",)) == 0 and held_back("Hello", ()) == 0



RELEASE = """
import os, torch
from qtk.runtime.async_engine import release_openmp_team
torch.set_num_threads(2)
x = torch.randn(512, 512, dtype=torch.float64)
want = x @ x  # a parallel region: this thread's team is up
before = len(os.listdir("/proc/self/task"))
released = release_openmp_team()
print(released, before, len(os.listdir("/proc/self/task")), torch.equal(x @ x, want))
"""


def test_release_openmp_team_frees_this_threads_workers():
    """The thread that built the model gives up its OpenMP workers, so the engine thread's team
    is the only one (two teams on few cores made every op wake its workers through the kernel):
    the calling thread's worker exits, and the next parallel op makes a team again and is right.
    In a process of its own with 2 torch threads (the suite runs with 1)."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("counts threads in Linux's /proc")
    out = subprocess.run([sys.executable, "-c", RELEASE], capture_output=True, text=True, check=True).stdout
    released, before, after, same = out.split()
    assert released == "True" and same == "True"
    assert int(after) == int(before) - 1
