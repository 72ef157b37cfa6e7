"""The OpenAI-compatible HTTP API (FastAPI), in front of the engine-core process.

Owns: routes, request validation into OpenAI's error shape, response and
Server-Sent-Event framing, the API key, the count of requests in flight (what
--max-queued-requests caps) and their end at shutdown, the body-read deadline,
and the metrics. The text work is this process's too: the engine core sends
token ids, and its client (core_client.py) detokenizes them and matches stop
strings. Does not own: any tensor, or the step loop (engine/core_process.py,
in a process of its own: this process's Python never holds up a step).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize   POST /detokenize   GET /health   GET /version   GET /metrics

Chat completions take `tools` and `tool_choice` (tool_calls.py: the call format,
the constraint that forces a call, the parser that finds calls); a choice
whose output holds calls answers `message.tool_calls` and finish_reason
"tool_calls", and a stream holds back text that may be a call until it ends.

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
parameter or a request too long for the context (`param` names the field),
401 for a wrong or missing API key (on /v1/*, /tokenize and /detokenize), 404
for an unknown model, 408 for a body that does not arrive in time, 413 for a
body over the limit, 503 while the engine is not serving, at capacity (with
Retry-After) or shutting down. Nothing a client sends is a 500.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hmac
import json
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.engine.llm_engine import StepOutput
from pagedllm.scheduler import RequestRejected
from pagedllm.server.core_client import EngineCoreClient, EngineDead
from pagedllm.server.metrics import Metrics
from pagedllm.server.protocol import (
    MAX_STOP_STRINGS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    TokenizeRequest,
    check_tools,
)
from pagedllm.server.tokenize_pool import POOL_MIN_CHARS, TokenizePool
from pagedllm.server.tool_calls import ToolPlan, output_stream, template_messages

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_QUEUED = 1024  # requests waiting or running; past it, a 503 (not unbounded memory)
DEFAULT_BODY_TIMEOUT_S = 30.0  # a request's whole body, from its headers on
RETRY_AFTER_S = 1  # what a 503 at capacity asks a client to wait
# Texts longer than this are tokenized on a thread, not on the event loop (where
# 4 MB of text would stall every stream for a second); shorter ones take ~2 ms or less.
TOKENIZE_INLINE_CHARS = 8192
# Routes outside /v1/ that the API key guards too: they tokenize, which costs.
GUARDED_PATHS = ("/tokenize", "/detokenize")
# A reply before the body was read whole: the rest of the body cannot be told
# from a next request, so the connection closes with the reply.
CLOSE = {"connection": "close"}
SHUTDOWN_MESSAGE = "the server is shutting down; send the request again (to another server)"


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers


def _error_body(status: int, message: str, type_: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


def _error(
    status: int,
    message: str,
    type_: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = _error_body(status, message, type_, param)
    return JSONResponse(body, status_code=status, headers=headers)


class ServerEnding(Exception):
    """The shutdown's grace is over: a handler ends its request now (a stream
    with an error event and `[DONE]`, any other with a 503)."""


class InFlight:
    """The requests handed to the engine and not yet finished, and their end at
    shutdown.

    The count is the app's own (not the scheduler's): a request counts from
    the moment its handler passes the --max-queued-requests check, so a burst
    cannot slip past the cap while its requests wait to reach the stepping
    thread. Check and count happen with no await between them.

    Shutdown (`drain`, from the server's shutdown): no new requests (503);
    those in flight get `timeout` seconds to finish; then `end` cancels every
    handler that waits on the engine (each waits through `wait`), which turns
    that cancellation into ServerEnding, and a handler busy elsewhere (sending)
    meets ServerEnding at its next wait.
    """

    def __init__(self) -> None:
        self.count = 0
        self.stopping = False  # shutdown began: new requests get a 503
        self.ended = False  # the grace is over: requests in flight end now
        self._waiting: set[asyncio.Task] = set()
        self._ending: set[asyncio.Task] = set()  # cancelled by end(), not by anyone else

    async def wait(self, awaitable: Awaitable[Any]) -> Any:
        """`await awaitable` (engine outputs), or ServerEnding once `end` is called."""
        if self.ended:
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()  # never awaited: no warning
            raise ServerEnding
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        try:
            return await awaitable
        except asyncio.CancelledError:
            if task not in self._ending:
                raise
            self._ending.discard(task)
            uncancel = getattr(task, "uncancel", None)  # Python 3.11+
            if uncancel is not None:
                uncancel()  # the cancellation is handled here, not owed to the task
            raise ServerEnding from None
        finally:
            self._waiting.discard(task)

    def end(self) -> None:
        """End every request in flight now (see the class docstring)."""
        self.ended = True
        for task in self._waiting:
            self._ending.add(task)
            task.cancel()

    async def drain(self, timeout: float) -> None:
        """Refuse new requests, give those in flight `timeout` seconds, end the rest."""
        self.stopping = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.count and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.count:
            self.end()


class Guard:
    """What is refused before a handler runs, or while its body is read: a body
    over the limit (413, from its Content-Length, or while it is read when it
    has none), a body that has not arrived `body_timeout` seconds after the
    headers (408: a client that never finishes its body would otherwise hold
    its connection and handler forever), and a missing or wrong API key on
    /v1/*, /tokenize and /detokenize (401, compared in constant time; the
    scheme `Bearer` in any case, RFC 7235).

    Pure ASGI, like AccessLog: Starlette's `@app.middleware("http")` would pipe
    every streamed chunk of every reply through an extra task and memory
    stream, which at a few thousand chunks a second is most of the server's CPU.
    """

    def __init__(
        self,
        app: Any,
        max_body_bytes: int,
        api_key: str | None,
        body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    ) -> None:
        self.app, self.max_body_bytes, self.body_timeout = app, max_body_bytes, body_timeout
        self.key = None if api_key is None else api_key.encode()

    def _authorized(self, header: bytes) -> bool:
        scheme, _, credentials = header.partition(b" ")
        assert self.key is not None
        # compare_digest even for a wrong scheme: the time says nothing about the key.
        same = hmac.compare_digest(credentials.strip(b" "), self.key)
        return same and scheme.lower() == b"bearer"

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case byte names
        length = headers.get(b"content-length")
        limit = self.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            reply = _error(
                413, f"the body is over {limit} bytes", "invalid_request_error", headers=CLOSE
            )
            await reply(scope, receive, send)
            return
        path = scope["path"]
        if self.key is not None and (path.startswith("/v1/") or path in GUARDED_PATHS):
            if not self._authorized(headers.get(b"authorization", b"")):
                reply = _error(
                    401,
                    "a missing or wrong API key: send 'Authorization: Bearer KEY'",
                    "authentication_error",
                    headers=CLOSE,
                )
                await reply(scope, receive, send)
                return
        seen = 0
        body_done = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.body_timeout

        async def limited_receive() -> dict:
            nonlocal seen, body_done
            if body_done:  # the body is in: what is left is the disconnect, untimed
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
            except asyncio.TimeoutError:
                raise StarletteHTTPException(
                    408,
                    f"the body did not arrive within {self.body_timeout:g} s",
                    headers=CLOSE,
                ) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body has no Content-Length to refuse early
                    raise StarletteHTTPException(
                        413, f"the body is over {limit} bytes", headers=CLOSE
                    )
                body_done = not message.get("more_body", False)
            else:
                body_done = True
            return message

        await self.app(scope, limited_receive, send)


class AccessLog:
    """One line per HTTP request once its reply is over (or its client gone):

        127.0.0.1:50412 "POST /v1/chat/completions" 200 in=27 out=64 1.204s cmpl-3f2a...

    `in`/`out` are the prompt and completion tokens the handler recorded in
    `request.state.usage` (so far, for a request that did not finish). A line
    ends in "client closed" when the client went away, "ended at shutdown"
    when the server ended the request cleanly at shutdown (an error event and
    [DONE], or a 503), and "cut at shutdown" when not even that could be sent.
    Never the prompt's text: that is --log-requests. A pure ASGI middleware,
    so that a streamed reply is timed to its last byte.
    """

    def __init__(self, app: Any, log: Callable[[str], None], in_flight: InFlight) -> None:
        self.app, self.log, self.in_flight = app, log, in_flight

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        reply = {"status": None, "done": False}

        async def watched_send(message: dict) -> None:
            if message["type"] == "http.response.start":
                reply["status"] = message["status"]
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                reply["done"] = True
            await send(message)

        try:
            await self.app(scope, receive, watched_send)
        finally:
            state = scope.get("state") or {}
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            line = f'{who} "{scope["method"]} {scope["path"]}" {reply["status"] or "-"}'
            usage = state.get("usage")
            if usage is not None:
                line += f" in={usage[0]} out={usage[1]}"
            line += f" {time.perf_counter() - t0:.3f}s"
            if state.get("request_id"):
                line += f" {state['request_id']}"
            # Who ended it, as the handler knew; else a reply that never finished.
            ended = state.get("ended")
            if ended is None and not reply["done"]:
                ended = "cut at shutdown" if self.in_flight.ended else "client closed"
            if ended is not None:
                line += f" {ended}"
            self.log(line)


def build_app(
    engine: EngineCoreClient,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queued_requests: int = DEFAULT_MAX_QUEUED,
    access_log: Callable[[str], None] | None = None,
    log_requests: bool = False,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    tokenize_workers: TokenizePool | None = None,
) -> FastAPI:
    """The app. `access_log`: where AccessLog's lines go (None: no access log);
    `log_requests`: also log each completion request's body, prompt included;
    `body_timeout`: seconds a request's body may take to arrive (then a 408).
    `app.state.in_flight.drain(seconds)` ends the requests in flight at shutdown.
    `engine`: a started EngineCoreClient (its core is ready); the app's
    lifespan attaches it to the serving event loop. `tokenize_workers`: prompts
    over POOL_MIN_CHARS characters are tokenized in its processes (started;
    its owner shuts it down)."""
    tokenizer = engine.tokenizer
    max_model_len = engine.max_model_len
    # The most tokens one request can ever hold in the KV cache (its prompt and
    # all its output but the last token): the whole pool.
    pool_tokens = engine.pool_tokens
    metrics = Metrics(lambda: engine.gauges)
    in_flight = InFlight()
    # One thread: large texts queue for it rather than many threads each taking
    # the GIL from the event loop.
    tokenize_pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="pagedllm-tokenize")

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await engine.attach()  # read the core's messages on this loop
        try:
            yield
        finally:
            await engine.detach()
            tokenize_pool.shutdown(wait=False)

    app = FastAPI(title="pagedllm", version=__version__, lifespan=lifespan)
    app.state.engine = engine
    app.state.in_flight = in_flight

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.param, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(e.errors())
        return _error(400, message, "invalid_request_error", param)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        # Our bug, not the client's: still OpenAI's shape, and the server goes on.
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error", headers=e.headers)

    # ------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Any:
        if not engine.alive:
            why = engine.error or "not serving"
            return _error(503, f"the engine is not serving: {why}", "server_error")
        return {"status": "ok"}

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "pagedllm",
            "max_model_len": max_model_len,
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        body, content_type = metrics.render()
        return PlainTextResponse(body, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        tok = _need_tokenizer()
        if body.messages is not None:
            try:
                plan = check_tools(body.tools, None, tok.chat_template)
            except FieldError as e:
                raise APIError(400, str(e), "invalid_request_error", e.param) from None
            ids = await _chat_ids(tok, body.messages, plan)
        else:
            ids = (await _encode_texts([body.prompt or ""], body.add_special_tokens))[0]
        return {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        tok = _need_tokenizer()
        bad = [t for t in body.tokens if t >= tok.vocab_size]
        if bad:
            raise APIError(
                400,
                f"token ids {bad[:5]} are not in the vocabulary",
                "invalid_request_error",
                "tokens",
            )
        return {"prompt": await _off_loop(len(body.tokens), tok.decode, body.tokens)}

    # ------------------------------------------------------------ completions
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model)
        tok = _need_tokenizer()
        try:
            plan = body.tool_plan(tok.chat_template)
        except FieldError as e:
            raise APIError(400, str(e), "invalid_request_error", e.param) from None
        prompt_ids = await _chat_ids(tok, body.messages, plan)
        return await _complete(request, body, [prompt_ids], chat=True, tools=plan)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model)
        prompts = await _completion_prompts(body.prompt)
        if body.n > 1 and len(prompts) > 1:
            raise APIError(400, "n > 1 needs a single prompt", "invalid_request_error", "n")
        return await _complete(request, body, prompts, chat=False)

    # ------------------------------------------------------------ helpers
    def _need_tokenizer():
        if tokenizer is None:
            raise APIError(
                400, "this model has no tokenizer: send token ids", "invalid_request_error"
            )
        return tokenizer

    def _check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {_clip(repr(name), 80)} does not exist; this server serves {model_name!r}",
                "invalid_request_error",
                "model",
            )

    async def _off_loop(size: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`fn(*args, **kwargs)`: inline for a small input, else on the tokenizer's thread."""
        if size <= TOKENIZE_INLINE_CHARS:
            return fn(*args, **kwargs)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(tokenize_pool, functools.partial(fn, *args, **kwargs))

    async def _chat_ids(tok: Any, messages: list[Any], plan: ToolPlan | None) -> list[int]:
        size = sum(len(m.text()) for m in messages)
        dicts = [m.template_dict() for m in messages]
        if plan is not None:
            dicts, kwargs = plan.messages(dicts), plan.template_kwargs
        else:
            dicts, kwargs = template_messages(dicts, None, tok.chat_template), {}
        # The workers' encode_chat takes no template keywords: `tools=` is rendered here.
        if tokenize_workers is not None and size > POOL_MIN_CHARS and not kwargs:
            try:
                return await tokenize_workers.encode_chat(dicts)
            except ValueError as e:  # the template refused the conversation
                raise APIError(400, str(e), "invalid_request_error", "messages") from None
        return await _off_loop(size, _encode_chat, tok, dicts, kwargs)

    async def _encode_texts(texts: list[str], add_special_tokens: bool) -> list[list[int]]:
        """Each text's ids: in the worker processes (one text each, in parallel)
        when there are some and the texts are long, else here (large ones on
        the tokenizer's thread)."""
        tok = _need_tokenizer()
        if tokenize_workers is not None and sum(map(len, texts)) > POOL_MIN_CHARS:
            parts = await asyncio.gather(
                *(tokenize_workers.encode_many([t], add_special_tokens) for t in texts)
            )
            return [ids for part in parts for ids in part]

        def encode_all() -> list[list[int]]:
            return [tok.encode(t, add_special_tokens=add_special_tokens) for t in texts]

        return await _off_loop(sum(map(len, texts)), encode_all)

    async def _completion_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
        if all(isinstance(p, str) for p in prompt):
            return await _encode_texts(prompt, True)
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    def _default_max_tokens(prompt_len: int) -> int:
        """Without max_tokens (chat): the room left in the context, as vLLM gives,
        but no more than the KV cache could ever hold with the prompt (a request
        larger than the pool is refused, and the default should always answer)."""
        room = max_model_len - prompt_len
        fits = pool_tokens - prompt_len + 1  # the last token is never written
        return max(min(room, fits), 1)

    async def _complete(
        request: Request,
        body: Any,
        prompts: list[list[int]],
        chat: bool,
        tools: ToolPlan | None = None,
    ) -> Any:
        if not engine.alive:
            raise APIError(503, f"the engine is not serving: {engine.error}", "server_error")
        if in_flight.stopping:
            raise APIError(503, SHUTDOWN_MESSAGE, "server_error")
        logprobs = body.wanted_logprobs()
        jobs = []  # (choice index, prompt ids, params)
        for p_index, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, "a prompt is empty", "invalid_request_error", "prompt")
            max_tokens = body.wanted_max_tokens() or _default_max_tokens(len(ids))
            for i in range(body.n):
                try:
                    params = body.sampling_params(max_tokens, logprobs, i)
                except FieldError as e:
                    raise APIError(400, str(e), "invalid_request_error", e.param) from None
                except ValueError as e:
                    param = _first_field(str(e), body)
                    raise APIError(400, str(e), "invalid_request_error", param) from None
                jobs.append((p_index * body.n + i, ids, params))
        if len(jobs) > max_queued_requests:
            raise APIError(
                400,
                f"this request makes {len(jobs)} requests (n = {body.n} for each of "
                f"{len(prompts)} prompts) and the server takes at most {max_queued_requests} "
                f"at once; send fewer",
                "invalid_request_error",
                "n" if body.n > 1 else "prompt",
            )
        # The check and the count, with no await between: a burst cannot slip past.
        if in_flight.count + len(jobs) > max_queued_requests:
            raise APIError(
                503,
                f"the server is at capacity ({in_flight.count} requests waiting or running, "
                f"at most {max_queued_requests}); retry later",
                "server_error",
                headers={"Retry-After": str(RETRY_AFTER_S)},
            )
        in_flight.count += len(jobs)
        released = [False] * len(jobs)

        def release(k: int) -> None:  # job k's stream ended (or never started)
            if not released[k]:
                released[k] = True
                in_flight.count -= 1

        try:
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
            created = int(time.time())
            request.state.request_id = rid
            # [prompt tokens, completion tokens so far], for the access log
            usage = request.state.usage = [sum(len(ids) for ids in prompts), 0]
            if log_requests and access_log is not None:
                fields = body.model_dump_json(exclude_none=True, exclude_defaults=True)
                access_log(f"{rid} {request.url.path} {_clip(fields)}")
            streams = [
                _choice_stream(ids, params, functools.partial(release, k))
                for k, (_, ids, params) in enumerate(jobs)
            ]
            # Start each request now, so a prompt too long for the context is a 400
            # before any streaming starts.
            firsts = await _start_all(request, streams, jobs, body, chat)
        except BaseException:
            for k in range(len(jobs)):
                release(k)
            raise
        if body.stream:
            sse = _sse(request, body, rid, created, jobs, streams, firsts, chat, usage, tools)
            return StreamingResponse(sse, media_type="text/event-stream")
        return await _collect(
            request, body, rid, created, jobs, streams, firsts, chat, usage, tools
        )

    async def _choice_stream(
        ids: list[int], params: Any, release: Callable[[], None]
    ) -> AsyncIterator[StepOutput]:
        t0 = time.perf_counter()
        last = None
        try:
            async for out in engine.generate(ids, params):
                now = time.perf_counter()
                metrics.on_output(out, t0, last, now)
                last = now
                yield out
        finally:
            release()

    async def _start_all(request, streams, jobs, body, chat: bool) -> list[StepOutput]:
        firsts = []
        try:
            for s in streams:
                firsts.append(await in_flight.wait(anext(s)))
        except RequestRejected as e:
            await _close(streams)
            prompt_len = len(jobs[len(firsts)][1])
            message, param = _rejection(str(e), body, chat, prompt_len, max_model_len, pool_tokens)
            raise APIError(400, message, "invalid_request_error", param) from None
        except EngineDead as e:
            await _close(streams)
            raise APIError(503, str(e), "server_error") from None
        except ServerEnding:
            await _close(streams)
            request.state.ended = "ended at shutdown"
            raise APIError(503, SHUTDOWN_MESSAGE, "server_error") from None
        except BaseException:
            await _close(streams)
            raise
        return firsts

    async def _collect(
        request, body, rid, created, jobs, streams, firsts, chat, usage, tools
    ) -> Any:
        async def finish(stream, first) -> StepOutput:
            out = first
            text = [first.new_text]
            while not out.finished:
                out = await anext(stream)
                text.append(out.new_text)
            out.full_text = "".join(text)  # type: ignore[attr-defined]
            return out

        tasks = [asyncio.ensure_future(finish(s, f)) for s, f in zip(streams, firsts)]
        try:
            while not all(t.done() for t in tasks):
                await in_flight.wait(asyncio.wait(tasks, timeout=0.5))
                if await request.is_disconnected():
                    break
            if not all(t.done() for t in tasks):
                request.state.ended = "client closed"
                raise APIError(499, "the client closed the request", "invalid_request_error")
            finals = [t.result() for t in tasks]
        except ServerEnding:
            request.state.ended = "ended at shutdown"
            raise APIError(503, SHUTDOWN_MESSAGE, "server_error") from None
        except EngineDead as e:
            request.state.ended = "engine died"
            raise APIError(503, f"the engine is not serving: {e}", "server_error") from None
        finally:
            # Each task runs its cancellation through its stream (the request's
            # abort) before the streams are closed: closing a stream that a task
            # is still running raises.
            await _cancel(tasks)
            await _close(streams)
        choices = []
        prompt_tokens = completion_tokens = 0
        counted_prompts = set()
        for (index, ids, _), out in zip(jobs, finals):
            req = out.request
            if index // body.n not in counted_prompts:
                counted_prompts.add(index // body.n)
                prompt_tokens += len(ids)
            completion_tokens += len(req.output_token_ids)
            usage[1] = completion_tokens
            text = out.full_text  # type: ignore[attr-defined]
            lp = out.state.logprobs if out.state is not None else None
            if chat:
                message: dict[str, Any] = {"role": "assistant", "content": text}
                finish = _finish(out)
                if tools is not None and tools.parses:
                    reader = output_stream(tools)
                    content = reader.feed(text)[0] + reader.finish()[0]
                    calls = reader.calls
                    if calls:
                        message = {
                            "role": "assistant",
                            "content": content or None,
                            "tool_calls": [c.as_openai() for c in calls],
                        }
                        finish = _tool_finish(finish)
                choices.append(
                    {
                        "index": index,
                        "message": message,
                        "logprobs": _chat_logprobs(req.output_token_ids, lp),
                        "finish_reason": finish,
                    }
                )
            else:
                if body.echo and tokenizer is not None:
                    text = tokenizer.decode(ids) + text
                choices.append(
                    {
                        "index": index,
                        "text": text,
                        "logprobs": _completion_logprobs(req.output_token_ids, lp),
                        "finish_reason": _finish(out),
                    }
                )
        return {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": created,
            "model": model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    async def _sse(
        request, body, rid, created, jobs, streams, firsts, chat, usage, tools
    ) -> AsyncIterator[str]:
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
            payload: dict[str, Any] = {
                "id": rid,
                "object": kind,
                "created": created,
                "model": model_name,
                "choices": choices,
            }
            if usage is not None:
                payload["usage"] = usage
            return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

        def role_chunk(index: int) -> str:
            delta = {"role": "assistant", "content": ""}
            return chunk(
                [{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]
            )

        # "auto", "required" or a named function: each choice's text goes through a
        # reader (tool_calls.output_stream) that holds back what may be a call and
        # turns calls into tool-call deltas.
        held = {j[0]: output_stream(tools) for j in jobs} if tools and tools.parses else {}

        def piece(index: int, out: StepOutput) -> dict[str, Any]:
            lp = None
            if out.state is not None and out.state.logprobs is not None and out.new_token_ids:
                entries = out.state.logprobs[-len(out.new_token_ids) :]
                lp = (_chat_logprobs if chat else _completion_logprobs)(out.new_token_ids, entries)
            finish = _finish(out) if out.finished else None
            if chat:
                if index not in held:
                    delta = {"content": out.new_text} if out.new_text else {}
                    return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                text, calls = held[index].feed(out.new_text)
                # Not a chunk yet: tool_pieces makes the chunks of it.
                return {"index": index, "content": text, "calls": calls, "logprobs": lp}
            return {"index": index, "text": out.new_text, "logprobs": lp, "finish_reason": finish}

        def tool_pieces(index: int, out: StepOutput, p: dict[str, Any]) -> list[dict[str, Any]]:
            """A held choice's chunks for one output: its content (held back where
            it may be a call) and its tool-call deltas as OpenAI streams them (the
            index, id and name first, then fragments of the arguments); at its end,
            what was held and finish_reason "tool_calls" when it called."""
            reader = held[index]
            text, deltas = p["content"], list(p["calls"])
            finish = None
            if out.finished:
                rest, more = reader.finish()
                text, deltas = text + rest, deltas + more
                finish = _finish(out)
                if reader.calls:
                    finish = _tool_finish(finish)
            pieces = []
            if text or p["logprobs"]:
                delta = {"content": text} if text else {}
                pieces.append(
                    {
                        "index": index,
                        "delta": delta,
                        "logprobs": p["logprobs"],
                        "finish_reason": None,
                    }
                )
            for delta in deltas:
                pieces.append(
                    {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                )
            if finish is not None:
                pieces.append(
                    {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}
                )
            return pieces

        completion_tokens = 0
        indices = [j[0] for j in jobs]
        try:
            if chat:  # OpenAI's first chunk of each choice: the role, no content
                for index in indices:
                    yield role_chunk(index)
            async for index, out in _interleave(indices, streams, firsts, in_flight.wait):
                completion_tokens += len(out.new_token_ids)
                usage[1] = completion_tokens
                if out.new_text or out.finished:
                    p = piece(index, out)
                    if chat and index in held:
                        for q in tool_pieces(index, out, p):
                            yield chunk([q])
                    else:
                        yield chunk([p])
            if body.include_usage:
                prompt_tokens = sum(
                    len(ids) for k, (_, ids, _) in enumerate(jobs) if k % body.n == 0
                )
                counts = {
                    "prompt_tokens": prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": prompt_tokens + completion_tokens,
                }
                yield chunk([], counts)
            yield "data: [DONE]\n\n"
        except (ServerEnding, EngineDead) as e:
            # The stream ends as a stream should: an error event (the openai
            # client raises it), then [DONE].
            if isinstance(e, EngineDead):
                request.state.ended = "engine died"
                message = f"the engine is not serving: {e}"
            else:
                request.state.ended = "ended at shutdown"
                message = SHUTDOWN_MESSAGE
            yield f"data: {json.dumps(_error_body(503, message, 'server_error'))}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await _close(streams)

    def _token_text(token_id: int) -> str:
        if tokenizer is None or token_id >= tokenizer.vocab_size:
            return ""
        return tokenizer.decode([token_id])

    def _chat_logprobs(ids: list[int], entries: list[dict[int, float]] | None) -> Any:
        if entries is None:
            return None
        content = []
        for token_id, entry in zip(ids, entries):
            token = _token_text(token_id)
            # The entry holds the top k and the chosen token (k + 1 ids when it is not among them).
            top = [
                {"token": _token_text(t), "logprob": v, "bytes": list(_token_text(t).encode())}
                for t, v in sorted(entry.items(), key=lambda kv: -kv[1])
            ]
            content.append(
                {
                    "token": token,
                    "logprob": entry.get(token_id, float("-inf")),
                    "bytes": list(token.encode()),
                    "top_logprobs": top,
                }
            )
        return {"content": content}

    def _completion_logprobs(ids: list[int], entries: list[dict[int, float]] | None) -> Any:
        if entries is None:
            return None
        tokens = [_token_text(t) for t in ids]
        offsets, pos = [], 0
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.get(t) for t, e in zip(ids, entries)],
            "top_logprobs": [{_token_text(t): v for t, v in e.items()} for e in entries],
            "text_offset": offsets,
        }

    app.add_middleware(
        Guard, max_body_bytes=max_body_bytes, api_key=api_key, body_timeout=body_timeout
    )
    if access_log is not None:  # added last: the outermost layer, so it sees every reply
        app.add_middleware(AccessLog, log=access_log, in_flight=in_flight)
    return app


async def _interleave(
    indices: list[int],
    streams: list[AsyncIterator[StepOutput]],
    firsts: list[StepOutput],
    wait: Callable[[Awaitable[Any]], Awaitable[Any]],
) -> AsyncIterator[tuple[int, StepOutput]]:
    """(choice index, output) of every stream, in the order they come, each stream
    to its final output; every wait for one goes through `wait` (InFlight.wait).
    One stream (n = 1, the usual case) is read directly: no task and no queue
    between it and the client."""
    if len(streams) == 1:
        out = firsts[0]
        yield indices[0], out
        while not out.finished:
            out = await wait(anext(streams[0]))
            yield indices[0], out
        return
    merged: asyncio.Queue[tuple[int, StepOutput | None]] = asyncio.Queue()

    async def pump(index: int, stream, first) -> None:
        try:
            await merged.put((index, first))
            out = first
            while not out.finished:
                out = await anext(stream)
                await merged.put((index, out))
        finally:
            await merged.put((index, None))

    tasks = [asyncio.ensure_future(pump(*a)) for a in zip(indices, streams, firsts)]
    try:
        open_streams = len(tasks)
        while open_streams:
            index, out = await wait(merged.get())
            if out is None:
                open_streams -= 1
            else:
                yield index, out
    finally:
        await _cancel(tasks)


async def _cancel(tasks: list[asyncio.Future]) -> None:
    """Cancel `tasks` and wait until each has run its cancellation through."""
    for t in tasks:
        t.cancel()
    if tasks:
        await asyncio.wait(tasks)


async def _close(streams: list[AsyncIterator[StepOutput]]) -> None:
    for s in streams:
        # A stream still running in a task (cancelled, not yet ended) ends there,
        # aborting its request; closing it here would raise.
        if not getattr(s, "ag_running", False):
            await s.aclose()  # type: ignore[attr-defined]


def _clip(text: str, limit: int = 4096) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _encode_chat(tokenizer: Any, messages: list[dict[str, Any]], kwargs: dict) -> list[int]:
    """The chat template's token ids; a conversation it refuses is the client's error."""
    try:
        return tokenizer.encode_chat(messages, **kwargs)
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", "messages") from None


def _finish(out: StepOutput) -> str:
    reason = out.request.finish_reason
    return str(reason) if reason is not None else "stop"


def _tool_finish(reason: str) -> str:
    """A choice whose output holds calls ends in "tool_calls" (OpenAI's), unless it
    was cut short (length): then the calls are what could be parsed."""
    return "tool_calls" if reason == "stop" else reason


# ------------------------------------------------------------ error messages
# Union fields (a prompt is a text, texts or token ids): what each accepts, for
# an input that is none of them. pydantic reports one error per branch, under
# loc parts that name the branch ("str", "list[int]"), not the field.
_UNION_FIELDS = {
    "prompt": "a string, a list of strings, a list of token ids or a list of token-id lists",
    "stop": f"a string or a list of at most {MAX_STOP_STRINGS} strings",
    "content": "a string or a list of text parts ({'type': 'text', 'text': ...})",
}
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


def _is_field(part: Any) -> bool:
    """A loc part that names a field or an index (else it names a union branch:
    "constrained-str", "list[TextPart]", "function-after[...]")."""
    if isinstance(part, int):
        return True
    return bool(_FIELD_NAME.fullmatch(part)) and part not in _TYPE_NAMES


def _is_shape_error(error: dict) -> bool:
    """The input is not of this kind at all (a branch of a union that does not apply)."""
    kind = error.get("type", "")
    return kind.endswith("_type") or kind.endswith("_parsing")


def _validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one message and the `param` it names. Of a union
    field's errors, the one from the branch the input is shaped like (17 stop
    strings: the list's limit, not "should be a valid string")."""
    if not errors:
        return "invalid request", None
    if any(e.get("type") == "json_invalid" for e in errors):
        return "the body is not valid JSON", None
    specific = [e for e in errors if not _is_shape_error(e)]
    error = specific[0] if specific else errors[0]
    loc = list(error.get("loc", ()))
    if loc[:1] == ["body"]:
        loc = loc[1:]
    if not loc:  # the body as a whole
        if error.get("type") == "missing":
            return "the request has no body: send a JSON object", None
        return "the body must be a JSON object (content-type: application/json)", None
    where = [p for p in loc if _is_field(p)]
    branch = next((i for i, p in enumerate(loc) if not _is_field(p)), None)
    if not specific and branch is not None:  # no branch fits: say what the field takes
        field = [p for p in loc[:branch] if _is_field(p)]
        param = ".".join(map(str, field))
        name = next((p for p in reversed(field) if isinstance(p, str)), "")
        if name in _UNION_FIELDS:
            return f"{param}: must be {_UNION_FIELDS[name]}", param
    param = ".".join(map(str, where))
    message = error.get("msg", "invalid value").removeprefix("Value error, ")
    if error.get("type") == "string_unicode":  # what pydantic says of a lone surrogate
        message = "not valid Unicode text (it has a lone surrogate)"
    if error.get("type") == "literal_error":
        message += f", got {_clip(repr(error.get('input')), 40)}"
    return (f"{param}: {message}" if param else message), (param or None)


_REQUEST_PREFIX = re.compile(r"^request \d+: ")


def _rejection(
    message: str, body: Any, chat: bool, prompt_len: int, max_model_len: int, pool_tokens: int
) -> tuple[str, str | None]:
    """The engine's refusal of a request, as the client's error: without the
    engine's request counter, naming the field to change."""
    message = _REQUEST_PREFIX.sub("", message)
    prompt = "messages" if chat else "prompt"
    max_tokens = "max_tokens"
    if chat and getattr(body, "max_completion_tokens", None) is not None:
        max_tokens = "max_completion_tokens"
    if "exceeds max_model_len" in message:
        return message, prompt if prompt_len >= max_model_len else max_tokens
    if "KV pages" in message:
        return message, prompt if prompt_len > pool_tokens else max_tokens
    if message.startswith(("the prompt", "prompt token ids")):
        return message, prompt
    if message.startswith("stop strings"):
        return message, "stop"
    return message, _first_field(message, body)


def _first_field(message: str, body: Any) -> str | None:
    """The field a SamplingParams message starts with ("top_k must be ..."), if the body has it."""
    word = message.split(" ", 1)[0].rstrip(":,")
    return word if word in type(body).model_fields else None
