"""The OpenAI-compatible HTTP API (FastAPI), in front of one `EngineThread`.

Owns: routes, request validation into OpenAI's error shape, response and
Server-Sent-Event framing, the API key, and the metrics. Does not own: any
tensor (handlers only tokenize and hand token ids to the engine thread), or the
step loop (engine_thread.py).

    POST /v1/chat/completions   POST /v1/completions   GET /v1/models
    POST /tokenize   POST /detokenize   GET /health   GET /version   GET /metrics

Errors are `{"error": {"message", "type", "param", "code"}}`: 400 for a bad
parameter or a request too long for the context, 401 for a wrong or missing
API key (on /v1/* only), 404 for an unknown model, 413 for a body over the
limit, 503 while the engine is not serving. Nothing a client sends is a 500.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import __version__
from pagedllm.engine.llm_engine import StepOutput
from pagedllm.scheduler import RequestRejected
from pagedllm.server.engine_thread import EngineDead, EngineThread
from pagedllm.server.metrics import Metrics
from pagedllm.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

DEFAULT_MAX_BODY_BYTES = 4 << 20
DEFAULT_MAX_QUEUED = 1024  # requests waiting or running; past it, a 503 (not unbounded memory)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str, param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param


def _error(status: int, message: str, type_: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": status}}
    return JSONResponse(body, status_code=status)


class Guard:
    """What is refused before a handler runs: a body over the limit (413, from
    its Content-Length, or while it is read when it has none) and a missing or
    wrong API key on /v1/* (401, compared in constant time).

    Pure ASGI, like AccessLog: Starlette's `@app.middleware("http")` would pipe
    every streamed chunk of every reply through an extra task and memory
    stream, which at a few thousand chunks a second is most of the server's CPU.
    """

    def __init__(self, app: Any, max_body_bytes: int, api_key: str | None) -> None:
        self.app, self.max_body_bytes = app, max_body_bytes
        self.want = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])  # lower-case byte names
        length = headers.get(b"content-length")
        limit = self.max_body_bytes
        if length is not None and (not length.isdigit() or int(length) > limit):
            reply = _error(413, f"the body is over {limit} bytes", "invalid_request_error")
            await reply(scope, receive, send)
            return
        if self.want is not None and scope["path"].startswith("/v1/"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.want):
                reply = _error(401, "a missing or wrong API key", "authentication_error")
                await reply(scope, receive, send)
                return
        seen = 0

        async def limited_receive() -> dict:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:  # a chunked body has no Content-Length to refuse early
                    raise StarletteHTTPException(413, f"the body is over {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


class AccessLog:
    """One line per HTTP request once its reply is over (or its client gone):

        127.0.0.1:50412 "POST /v1/chat/completions" 200 in=27 out=64 1.204s cmpl-3f2a...

    `in`/`out` are the prompt and completion tokens the handler recorded in
    `request.state.usage` (so far, for a stream its client closed: then the line
    ends in "client closed"). Never the prompt's text: that is --log-requests.
    A pure ASGI middleware, so that a streamed reply is timed to its last byte.
    """

    def __init__(self, app: Any, log: Callable[[str], None]) -> None:
        self.app, self.log = app, log

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
            if not reply["done"]:
                line += " client closed"
            self.log(line)


def build_app(
    engine_thread: EngineThread,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_queued_requests: int = DEFAULT_MAX_QUEUED,
    access_log: Callable[[str], None] | None = None,
    log_requests: bool = False,
) -> FastAPI:
    """The app. `access_log`: where AccessLog's lines go (None: no access log);
    `log_requests`: also log each completion request's body, prompt included."""
    engine = engine_thread.engine
    tokenizer = engine.tokenizer
    metrics = Metrics(engine)
    app = FastAPI(title="pagedllm", version=__version__)
    app.state.engine_thread = engine_thread

    # ------------------------------------------------------------ errors
    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return _error(e.status, e.message, e.type, e.param)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return _error(400, "the body is not valid JSON", "invalid_request_error")
        msg = first.get("msg", "invalid request")
        return _error(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> JSONResponse:
        # Our bug, not the client's: still OpenAI's shape, and the server goes on.
        return _error(500, f"internal error: {type(e).__name__}: {e}", "server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        return _error(e.status_code, str(e.detail), "invalid_request_error")

    # ------------------------------------------------------------ plain routes
    @app.get("/health")
    async def health() -> Any:
        if not engine_thread.alive:
            why = engine_thread.error or "not serving"
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
            "max_model_len": engine.max_model_len,
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
            ids = _encode_chat(tok, body.messages)
        else:
            ids = tok.encode(body.prompt or "", add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

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
        return {"prompt": tok.decode(body.tokens)}

    # ------------------------------------------------------------ completions
    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Any:
        _check_model(body.model)
        prompt_ids = _encode_chat(_need_tokenizer(), body.messages)
        return await _complete(request, body, [prompt_ids], chat=True)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model)
        prompts = _completion_prompts(body.prompt)
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
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "invalid_request_error",
                "model",
            )

    def _completion_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            return [_need_tokenizer().encode(prompt, add_special_tokens=True)]
        if not prompt:
            raise APIError(400, "prompt is empty", "invalid_request_error", "prompt")
        if all(isinstance(p, str) for p in prompt):
            tok = _need_tokenizer()
            return [tok.encode(p, add_special_tokens=True) for p in prompt]
        if all(isinstance(p, int) for p in prompt):
            return [list(prompt)]
        return [list(p) for p in prompt]

    async def _complete(request: Request, body: Any, prompts: list[list[int]], chat: bool) -> Any:
        if not engine_thread.alive:
            raise APIError(503, "the engine is not serving", "server_error")
        scheduler = engine.scheduler
        queued = scheduler.num_waiting + scheduler.num_running
        if queued + len(prompts) * body.n > max_queued_requests:
            raise APIError(
                503,
                f"the server is at capacity ({queued} requests waiting or running, "
                f"at most {max_queued_requests}); retry later",
                "server_error",
            )
        logprobs = body.wanted_logprobs()
        jobs = []  # (choice index, prompt ids, params)
        for p_index, ids in enumerate(prompts):
            if not ids:
                raise APIError(400, "a prompt is empty", "invalid_request_error", "prompt")
            room = engine.max_model_len - len(ids)
            max_tokens = body.wanted_max_tokens() or max(room, 1)
            for i in range(body.n):
                try:
                    params = body.sampling_params(max_tokens, logprobs, i)
                except ValueError as e:
                    raise APIError(400, str(e), "invalid_request_error") from None
                jobs.append((p_index * body.n + i, ids, params))
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        created = int(time.time())
        request.state.request_id = rid
        # [prompt tokens, completion tokens so far], for the access log
        usage = request.state.usage = [sum(len(ids) for ids in prompts), 0]
        if log_requests and access_log is not None:
            fields = body.model_dump_json(exclude_none=True, exclude_defaults=True)
            access_log(f"{rid} {request.url.path} {_clip(fields)}")
        streams = [_choice_stream(index, ids, params) for index, ids, params in jobs]
        # Start each request now, so a prompt too long for the context is a 400
        # before any streaming starts.
        firsts = await _start_all(streams)
        if body.stream:
            sse = _sse(body, rid, created, jobs, streams, firsts, chat, usage)
            return StreamingResponse(sse, media_type="text/event-stream")
        return await _collect(request, body, rid, created, jobs, streams, firsts, chat, usage)

    async def _choice_stream(index: int, ids: list[int], params: Any) -> AsyncIterator[StepOutput]:
        t0 = time.perf_counter()
        last = None
        async for out in engine_thread.generate(ids, params):
            now = time.perf_counter()
            metrics.on_output(out, t0, last, now)
            last = now
            yield out

    async def _start_all(streams: list[AsyncIterator[StepOutput]]) -> list[StepOutput]:
        firsts = []
        try:
            for s in streams:
                firsts.append(await anext(s))
        except RequestRejected as e:
            await _close(streams)
            raise APIError(400, str(e), "invalid_request_error") from None
        except EngineDead as e:
            await _close(streams)
            raise APIError(503, str(e), "server_error") from None
        except BaseException:
            await _close(streams)
            raise
        return firsts

    async def _close(streams: list[AsyncIterator[StepOutput]]) -> None:
        for s in streams:
            await s.aclose()

    async def _collect(request, body, rid, created, jobs, streams, firsts, chat, usage) -> Any:
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
                await asyncio.wait(tasks, timeout=0.5)
                if await request.is_disconnected():
                    break
            if not all(t.done() for t in tasks):
                raise APIError(499, "the client closed the request", "invalid_request_error")
            finals = [t.result() for t in tasks]
        finally:
            for t in tasks:
                t.cancel()
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
                choices.append(
                    {
                        "index": index,
                        "message": {"role": "assistant", "content": text},
                        "logprobs": _chat_logprobs(req.output_token_ids, lp),
                        "finish_reason": _finish(out),
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

    async def _sse(body, rid, created, jobs, streams, firsts, chat, usage) -> AsyncIterator[str]:
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

        def piece(index: int, out: StepOutput) -> dict[str, Any]:
            lp = None
            if out.state is not None and out.state.logprobs is not None and out.new_token_ids:
                entries = out.state.logprobs[-len(out.new_token_ids) :]
                lp = (_chat_logprobs if chat else _completion_logprobs)(out.new_token_ids, entries)
            finish = _finish(out) if out.finished else None
            if chat:
                delta = {"content": out.new_text} if out.new_text else {}
                return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
            return {"index": index, "text": out.new_text, "logprobs": lp, "finish_reason": finish}

        completion_tokens = 0
        try:
            if chat:  # OpenAI's first chunk of each choice: the role, no content
                for index, _, _ in jobs:
                    yield role_chunk(index)
            async for index, out in _interleave([j[0] for j in jobs], streams, firsts):
                completion_tokens += len(out.new_token_ids)
                usage[1] = completion_tokens
                if out.new_text or out.finished:
                    yield chunk([piece(index, out)])
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

    app.add_middleware(Guard, max_body_bytes=max_body_bytes, api_key=api_key)
    if access_log is not None:  # added last: the outermost layer, so it sees every reply
        app.add_middleware(AccessLog, log=access_log)
    return app


async def _interleave(
    indices: list[int], streams: list[AsyncIterator[StepOutput]], firsts: list[StepOutput]
) -> AsyncIterator[tuple[int, StepOutput]]:
    """(choice index, output) of every stream, in the order they come, each stream
    to its final output. One stream (n = 1, the usual case) is read directly:
    no task and no queue between it and the client."""
    if len(streams) == 1:
        out = firsts[0]
        yield indices[0], out
        while not out.finished:
            out = await anext(streams[0])
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
            index, out = await merged.get()
            if out is None:
                open_streams -= 1
            else:
                yield index, out
    finally:
        for t in tasks:
            t.cancel()


def _clip(text: str, limit: int = 4096) -> str:
    return text if len(text) <= limit else text[:limit] + f"... ({len(text)} characters)"


def _encode_chat(tokenizer: Any, messages: list[Any]) -> list[int]:
    """The chat template's token ids; a conversation it refuses is the client's error."""
    try:
        return tokenizer.encode_chat(_messages(messages))
    except ValueError as e:
        raise APIError(400, str(e), "invalid_request_error", "messages") from None


def _messages(messages: list[Any]) -> list[dict[str, str]]:
    return [
        {"role": m.role if m.role != "developer" else "system", "content": m.text()}
        for m in messages
    ]


def _finish(out: StepOutput) -> str:
    reason = out.request.finish_reason
    return str(reason) if reason is not None else "stop"
