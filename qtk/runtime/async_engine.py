"""AsyncLLM: the engine for an asyncio server (vLLM's AsyncLLM API).

    engine = AsyncLLM(LLM("smollm2-135m"))
    async for out in engine.generate(prompt, SamplingParams(max_tokens=64), request_id="r1"):
        out.outputs[0].text            # the text so far; out.finished on the last one
    engine.abort("r1")                 # or leave the loop: closing the stream aborts the request

The engine steps in a thread of its own, so the event loop stays free to accept requests and
write responses while a step computes (torch releases the GIL in its kernels). The loop thread
never touches the engine: requests and aborts go through an inbox the engine thread drains
between steps, and each step's outputs come back to each request's asyncio queue through
call_soon_threadsafe. A request the engine rejects (InputError: empty prompt, too long, bad
parameters) raises that error from its own stream and nothing else is affected; a server checks
it first with process() (the engine's InputProcessor, once) and gives generate() the result.
A server asks the engine what it needs through the public methods below (limits, token ids,
stats), never through the LLM's parts.

From then on only the engine thread computes, and the thread that built the model gives up its
OpenMP team (release_openmp_team): OpenMP keeps one team of worker threads per thread that ran a
parallel region, and libgomp, counting more of its threads than cores, stops spinning between
regions, so each torch op then wakes its workers through the kernel. On 2 cores that made every
matmul of the engine thread ~30% slower (a 16x576x1536 one: 310 -> 400 us) and the served model
~30% slower than the same engine in the main thread.
"""
from __future__ import annotations

import asyncio
import ctypes
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator

from .engine import LLM, EngineStats
from .input_processor import EngineRequest
from .output_processor import RequestOutput
from .sampling_params import SamplingParams

log = logging.getLogger(__name__)


def release_openmp_team() -> bool:
    """Free the calling thread's OpenMP worker threads (OpenMP 5's omp_pause_resource_all, in
    libgomp and LLVM's libomp alike); the next parallel region this thread runs makes a new team.
    True if an OpenMP runtime was found and released them."""
    try:
        with open("/proc/self/maps") as maps:
            libs = {line.split()[-1] for line in maps if "omp" in line.rsplit("/", 1)[-1]}
    except OSError:  # not Linux: leave the runtime as it is
        return False
    for path in sorted(libs):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        # omp_pause_soft: libgomp frees the calling thread's team for either kind, where LLVM's
        # hard pause would shut its whole runtime down under any other thread's parallel region
        return pause(1) == 0
    return False


class EngineDeadError(RuntimeError):
    """The engine thread failed: no request can be served any more."""


class RequestFailedError(RuntimeError):
    """One request failed inside the engine; the engine and the other requests go on."""


class AsyncLLM:
    def __init__(self, llm: LLM, metrics=None):
        """metrics: told of each output as it reaches its request's stream: `metrics.observer()`
        is called once per request and returns a callable that takes each RequestOutput (a
        server's /metrics: entrypoints/openai/metrics.py)."""
        self.llm = llm
        self.metrics = metrics
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._wake = threading.Event()
        self._ids = itertools.count()
        self._stopped = False
        self.dead: BaseException | None = None
        release_openmp_team()  # the engine thread's team is to be the only one (module docstring)
        self._thread = threading.Thread(target=self._run, name="qtk-engine", daemon=True)
        self._thread.start()

    # -- what a server asks of the engine -----------------------------------------------------------
    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.vocab_size

    def prompt_ids(self, prompt: str | list[int] | dict) -> list[int]:
        """The prompt's token ids, checked against the vocabulary (RequestError)."""
        return self.llm.processor.prompt_ids(prompt)

    def process(self, prompt: str | list[int] | dict, params: SamplingParams | None = None) -> EngineRequest:
        """The request checked and made ready (input_processor.py), in the caller's thread: a bad
        one raises RequestError here, before any stream starts; give the result to generate()."""
        return self.llm.processor.process(prompt, params)

    def load_grammar_tokenizer(self) -> None:
        """Build the grammar engine's view of the tokenizer now (~0.4 s) rather than on a request;
        InputError where structured outputs are unavailable."""
        self.llm.grammars.tokenizer

    def num_waiting_requests(self) -> int:
        return self.llm.num_waiting_requests()

    def stats(self) -> EngineStats:
        return self.llm.stats()

    async def generate(self, prompt: str | list[int] | dict | EngineRequest, params: SamplingParams | None = None,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output after each step that gave it tokens, the last one finished.
        prompt: as LLM.add_request takes it (an EngineRequest from process() is not checked again)."""
        if self.dead is not None:
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if self.dead is not None:  # it died after the check above, before this stream was there to be told
            self._streams.pop(request_id, None)
            raise EngineDeadError(f"the engine stopped: {self.dead!r}")
        self._post(("add", request_id, prompt, params))
        finished = False
        observe = self.metrics.observer() if self.metrics is not None else None
        try:
            while not finished:
                item = await stream.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None:
                    finished = True
                    raise RequestFailedError(item.error)
                finished = item.finished
                if observe is not None:
                    observe(item)
                yield item
        finally:
            self._streams.pop(request_id, None)
            if not finished:  # the caller left early (client gone, cancelled): free the blocks
                self._post(("abort", request_id))

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id))

    def shutdown(self) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout=30)

    # -- the engine thread -------------------------------------------------------------------------
    def _post(self, message: tuple) -> None:
        self._inbox.put(message)
        self._wake.set()

    def _deliver(self, request_id: str, item) -> None:
        self._deliver_all([(request_id, item)])

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """(request id, output or error) pairs to their streams, with one call_soon_threadsafe per event
        loop: each call writes to the loop's self-pipe, a system call that wakes the loop's thread, and a
        16-sequence step made 16 of them."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for request_id, item in items:
            target = self._streams.get(request_id)
            if target is not None:
                loop, stream = target
                by_loop.setdefault(loop, []).append((stream, item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_each, puts)

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, request_id, *rest = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.llm.abort(request_id)
                continue
            try:
                self.llm.add_request(rest[0], rest[1], request_id=request_id)
            except Exception as e:  # this request's error (bad input): its stream raises it
                self._deliver(request_id, e)

    def _run(self) -> None:
        try:
            while not self._stopped:
                self._drain_inbox()
                if not self.llm.has_unfinished_requests():
                    self._wake.wait()
                    self._wake.clear()
                    continue
                self._deliver_all([(out.request_id, out) for out in self.llm.step()])
        except BaseException as e:  # a bug or an out-of-memory: fail every stream, loudly
            log.exception("the engine thread failed")
            self.dead = e
            self._deliver_all([(request_id, EngineDeadError(f"the engine stopped: {e!r}"))
                               for request_id in list(self._streams)])


def _put_each(puts: list[tuple[asyncio.Queue, object]]) -> None:
    """In the event loop: a step's outputs into their streams' queues, in the engine's order."""
    for stream, item in puts:
        stream.put_nowait(item)
