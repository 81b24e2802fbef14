"""The OpenAI-compatible HTTP API on FastAPI.

    POST /v1/completions         prompt: str | [str] | [int] | [[int]]; stream as SSE
    POST /v1/chat/completions    messages -> chat template -> token ids; stream as SSE
    GET  /v1/models  /health  /metrics      POST /tokenize  /detokenize

One HTTP request becomes one engine request per prompt (each with the request's n samples).
Choice index = prompt_index * n + sample_index, as in the OpenAI API. Everything the client can
get wrong is a 4xx with the OpenAI error body (errors.py), including prompt + max_tokens beyond
the context (limits.py). The engine is never left holding a request nobody reads: however a
handler or a stream ends (finished, error, client gone: disconnect.py), its job aborts whatever
of its engine requests has not finished.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass, replace
from typing import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvforge.engine.async_engine import AsyncLLMEngine, EngineDeadError
from kvforge.engine.outputs import RequestOutput
from kvforge.sampling_params import SamplingParams
from kvforge.server import responses
from kvforge.server.auth import APIKeyMiddleware
from kvforge.server.disconnect import cancel_on_disconnect
from kvforge.server.errors import OpenAIError, install_error_handlers
from kvforge.server.limits import output_budget
from kvforge.server.metrics import ServerMetrics
from kvforge.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                     TokenizeRequest)
from kvforge.server.tool_calls import (ToolCallStream, forced_call_schema, parse_forced_call,
                                       parse_tagged_calls)
from kvforge.structured.params import StructuredOutputParams

_OPEN_PATHS = {"/health", "/metrics", "/docs", "/openapi.json"}


@dataclass
class ServerConfig:
    served_model_name: str
    api_key: str | None = None
    max_waiting_requests: int = 512     # admitted requests without a first token; more -> 429
    max_n: int = 16                     # largest n one request may ask for

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be non-empty")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be >= 1, got {self.max_n}")


class OpenAIServing:
    def __init__(self, engine: AsyncLLMEngine, config: ServerConfig,
                 metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or ServerMetrics(config.served_model_name)
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.engine.max_model_len
        self.num_unstarted = 0          # admitted, no output yet (the server's view of the queue)
        self._token_text_cache: dict[int, str] = {}

    # ------------------------------------------------------------------ helpers
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.config.served_model_name:
            raise OpenAIError(404, f"the model {name!r} does not exist; this server serves "
                                   f"{self.config.served_model_name!r}", param="model",
                              code="model_not_found")

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """Ids the client gave must be in the vocabulary before anything decodes them."""
        vocab = self.engine.engine.model_config.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise OpenAIError(400, f"token id {bad} is outside the vocabulary [0, {vocab})",
                              param=param, code="invalid_value")

    def token_text(self, token_id: int) -> str:
        text = self._token_text_cache.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text_cache[token_id] = text
        return text

    def _params(self, body, max_tokens: int | None, logprobs: int | None,
                structured: StructuredOutputParams | None = None) -> SamplingParams:
        if body.n > self.config.max_n:
            raise OpenAIError(400, f"n = {body.n} is more than this server allows "
                                   f"({self.config.max_n})", param="n", code="invalid_value")
        if body.logit_bias:
            self.check_token_ids(list(body.logit_bias), "logit_bias")
        try:
            params = body.sampling_params(max_tokens, logprobs, structured)
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_value") from e
        if isinstance(params.prediction, str):
            # tokenized once, as the engine would (no special tokens): the ids go on to the
            # engine and to usage
            params = replace(params, prediction=self.tokenizer.encode(
                params.prediction, add_special_tokens=False))
        return params

    async def structured_output(self, body, forced: StructuredOutputParams | None = None,
                                forced_by: str | None = None) -> StructuredOutputParams | None:
        """What the request's output must match (``forced``: a tool call's schema), checked by
        the grammar engine now: a bad schema or grammar is a 400 with its message."""
        try:
            structured, field = body.structured_output()
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_value") from e
        if forced is not None:
            if structured is not None:
                raise OpenAIError(400, f"tool_choice {forced_by!r} constrains the output to a "
                                       f"tool call; it cannot be combined with {field}",
                                  param=field, code="invalid_value")
            structured, field = forced, "tools"
        if structured is not None:
            # the first use builds the grammar engine's view of the vocabulary (~1 s): off the
            # event loop
            compiler = self.engine.engine.grammar_compiler
            try:
                await asyncio.to_thread(compiler.compile, structured)
            except ValueError as e:
                raise OpenAIError(400, str(e), param=field, code="invalid_value") from e
        return structured

    async def start(self, prompts: list[list[int]], params: SamplingParams, prefix: str,
                    priority: int = 0) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Admit and queue one engine request per prompt; all or nothing (also when cancelled
        half-way: the client left). Returns the engine request ids and their streams."""
        if self.num_unstarted + len(prompts) > self.config.max_waiting_requests:
            self.metrics.on_rejected()
            raise OpenAIError(429, f"the server is busy: {self.num_unstarted} requests are "
                                   f"waiting (limit {self.config.max_waiting_requests}); retry later",
                              code="queue_full")
        arrival = time.monotonic()
        base = f"{prefix}-{uuid.uuid4().hex}"
        streams, ids = [], []
        try:
            for i, ids_ in enumerate(prompts):
                # listed before the add: an add cancelled while the engine thread runs it may
                # still happen, and the abort queued behind it undoes it
                ids.append(f"{base}-{i}")
                streams.append(await self.engine.add_request(ids[-1], ids_, params,
                                                             arrival_time=arrival,
                                                             priority=priority))
        except EngineDeadError as e:
            raise OpenAIError(503, str(e)) from e
        except BaseException as e:
            for rid in ids:
                self.engine.abort(rid)
            if isinstance(e, ValueError):
                raise OpenAIError(400, str(e), param="prompt" if "prompt" in str(e) else None,
                                  code="invalid_value") from e
            raise
        return ids, streams

    async def merge(self, streams: list[AsyncIterator[RequestOutput]], n_params: SamplingParams,
                    prompt_lens: list[int]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from all streams as they come; closing it aborts the rest."""
        out_q: asyncio.Queue = asyncio.Queue()
        self.num_unstarted += len(streams)
        started = [False] * len(streams)

        async def pump(i: int, stream) -> None:
            finished = False
            try:
                async for out in stream:
                    if not started[i]:
                        started[i] = True
                        self.num_unstarted -= 1
                    await out_q.put((i, out))
                    if out.finished:
                        finished = True
                        self._record(out, prompt_lens[i])
            except BaseException as e:      # noqa: BLE001 - forwarded to the reader
                await out_q.put((i, e))
                raise
            finally:
                if not finished:                # the client went away: the stream aborted it
                    self.metrics.on_aborted(n_params.n)
                if not started[i]:
                    started[i] = True
                    self.num_unstarted -= 1
                await out_q.put((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        try:
            done = 0
            while done < len(tasks):
                i, item = await out_q.get()
                if item is None:
                    done += 1
                elif isinstance(item, BaseException):
                    if isinstance(item, EngineDeadError):
                        raise OpenAIError(503, str(item)) from item
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _record(self, out: RequestOutput, prompt_len: int) -> None:
        m = out.metrics
        self.metrics.on_request_done(
            finish_reasons=[c.finish_reason for c in out.outputs], prompt_tokens=prompt_len,
            output_tokens=sum(len(c.token_ids) for c in out.outputs),
            arrival=m.arrival_time, first_token=m.first_token_time,
            first_scheduled=m.first_scheduled_time, end=m.finished_time or time.monotonic())

    # ------------------------------------------------------------------ completions
    async def completions(self, body: CompletionRequest):
        self.check_model(body.model)
        try:
            raw_prompts = body.prompts()
            prompt_ids = [self.tokenizer.encode(p) if isinstance(p, str) else list(p)
                          for p in raw_prompts]
        except ValueError as e:
            raise OpenAIError(400, str(e), param="prompt", code="invalid_value") from e
        for ids in prompt_ids:
            self.check_token_ids(ids, "prompt")
        # absent: the API's default of 16, or fewer if the context is nearly full
        requested = body.max_tokens if "max_tokens" in body.model_fields_set else None
        # max_tokens 0 scores the prompt: the engine makes one token, which the response drops
        score_only = requested == 0
        max_tokens = output_budget(self.max_model_len, [len(p) for p in prompt_ids],
                                   1 if score_only else requested, default=16,
                                   param="max_tokens", prompt_param="prompt")
        params = self._params(body, max_tokens, body.logprobs, await self.structured_output(body))
        if body.echo and body.logprobs is not None:
            params = replace(params, prompt_logprobs=body.logprobs)   # the echoed prompt's own
        echo_texts = [(p if isinstance(p, str) else self.tokenizer.decode(p)) if body.echo else ""
                      for p in raw_prompts]
        job = _Job(self, "cmpl", body, params, prompt_ids, echo_texts)
        job.score_only = score_only
        return await job.respond(job.stream_completion, job.full_completion)

    async def chat(self, body: ChatCompletionRequest):
        self.check_model(body.model)
        try:
            ids = self.tokenizer.apply_chat_template(
                body.chat_messages(), add_generation_prompt=body.add_generation_prompt,
                tools=body.template_tools())
            logprobs = body.num_logprobs()
        except ValueError as e:
            param = "tools" if "tools" in str(e) else "messages"
            raise OpenAIError(400, str(e), param=param, code="invalid_value") from e
        param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
        max_tokens = output_budget(self.max_model_len, [len(ids)],
                                   body.max_completion_tokens or body.max_tokens, default=None,
                                   param=param, prompt_param="messages")
        forced = None
        if body.tool_mode in ("required", "named"):
            named = body.tool_choice.function.name if body.tool_mode == "named" else None
            forced = StructuredOutputParams(json=forced_call_schema(body.tools, named))
        structured = await self.structured_output(body, forced, body.tool_mode)
        params = self._params(body, max_tokens, logprobs, structured)
        job = _Job(self, "chatcmpl", body, params, [ids], [""])
        job.tool_mode = body.tool_mode
        job.tool_names = {t.function.name for t in body.tools or []}
        job.max_tool_calls = None if body.parallel_tool_calls else 1
        return await job.respond(job.stream_chat, job.full_chat)


class _SSEResponse(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends, even if the client left
    before the first event (when the event generator never started and so never cleans up)."""

    def __init__(self, events: AsyncIterator[dict], on_close) -> None:
        async def body():
            async for event in events:
                yield f"data: {json.dumps(event, ensure_ascii=False)}\n\n"
            yield "data: [DONE]\n\n"
        super().__init__(body(), media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _Job:
    """One HTTP generation request: its prompts, choices and the response it builds."""

    def __init__(self, serving: OpenAIServing, prefix: str, body, params: SamplingParams,
                 prompt_ids: list[list[int]], echo_texts: list[str]) -> None:
        self.s = serving
        self.body = body
        self.params = params
        self.prompt_ids = prompt_ids
        self.echo_texts = echo_texts
        self.n = params.n
        self.prefix = prefix
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = serving.config.served_model_name
        self.num_prompt_tokens = sum(len(p) for p in prompt_ids)
        self.request_ids: list[str] = []                # engine requests, one per prompt
        self.finished = [False] * len(prompt_ids)
        self.completion_ids: dict[int, list[int]] = {}  # choice index -> token ids so far
        self.sent_tokens: dict[int, int] = {}           # choice index -> tokens with logprobs sent
        self.text_len: dict[int, int] = {}              # choice index -> chars sent (text_offset)
        self.score_only = False     # completions with max_tokens 0: the generated token dropped
        self.tool_mode = "none"     # chat: "none", "auto", "required", "named" (tool_calls.py)
        self.tool_names: set[str] = set()
        self.max_tool_calls: int | None = None      # 1: parallel_tool_calls false

    async def respond(self, stream_events, full_response):
        """Start the engine requests; the SSE response or the whole one (as JSON). Whatever
        ends it, ``close`` aborts the engine requests not finished."""
        self.request_ids, streams = await self.s.start(self.prompt_ids, self.params, self.prefix,
                                                       self.body.priority)
        if self.body.stream:
            return _SSEResponse(stream_events(streams), on_close=self.close)
        try:
            return JSONResponse(await full_response(streams))
        finally:
            self.close()

    def close(self) -> None:
        for rid, finished in zip(self.request_ids, self.finished):
            if not finished:
                self.s.engine.abort(rid)

    async def _merge(self, streams):
        # aclosing: however this generator ends, the merge's pump tasks end with it
        async with aclosing(self.s.merge(streams, self.params,
                                         [len(p) for p in self.prompt_ids])) as outputs:
            async for i, out in outputs:
                if out.finished:
                    self.finished[i] = True
                yield i, out

    def _count_tokens(self, idx: int, co) -> bool:
        """Record choice ``idx``'s tokens so far (for usage); whether it got new ones."""
        grew = len(co.token_ids) > len(self.completion_ids.get(idx, ()))
        self.completion_ids[idx] = co.token_ids
        return grew

    def _usage(self) -> dict:
        completions = [] if self.score_only else list(self.completion_ids.values())
        return responses.usage(self.num_prompt_tokens, completions, self.params.prediction or [])

    def _echo_logprobs(self, i: int, out: RequestOutput) -> dict | None:
        """Prompt ``i``'s tokens and their logprobs, for an echoed completion with logprobs."""
        if not self.body.echo or self.params.prompt_logprobs is None or out.prompt_logprobs is None:
            return None
        return responses.echo_logprobs(self.prompt_ids[i], out.prompt_logprobs,
                                       self.params.prompt_logprobs, self.s.token_text)

    def _new_logprobs(self, idx: int, co, chat: bool):
        if self.params.logprobs is None or co.logprobs is None:
            return None
        start = self.sent_tokens.get(idx, 0)
        ids, entries = co.token_ids[start:], co.logprobs[start:]
        self.sent_tokens[idx] = start + len(ids)
        k = self.params.logprobs
        if chat:
            return responses.chat_logprobs(ids, entries, k, self.s.token_text)
        off = self.text_len.get(idx, 0)
        lp = responses.completion_logprobs(ids, entries, k, self.s.token_text, off)
        self.text_len[idx] = off + sum(len(t) for t in lp["tokens"])
        return lp

    # ---- completions
    async def full_completion(self, streams) -> dict:
        finals: dict[int, RequestOutput] = {}
        async for i, out in self._merge(streams):
            if out.finished:
                finals[i] = out
        choices = []
        for i in range(len(self.prompt_ids)):
            echoed = self._echo_logprobs(i, finals[i])
            for co in finals[i].outputs:
                idx = i * self.n + co.index
                self.completion_ids[idx] = co.token_ids
                self.text_len[idx] = len(self.echo_texts[i])
                if self.score_only:
                    choices.append({"index": idx, "text": self.echo_texts[i],
                                    "logprobs": echoed if self.params.logprobs is not None
                                    else None, "finish_reason": "length"})
                    continue
                generated = self._new_logprobs(idx, co, chat=False)
                choices.append({"index": idx, "text": self.echo_texts[i] + co.text,
                                "logprobs": responses.join_logprobs(echoed, generated),
                                "finish_reason": co.finish_reason})
        choices.sort(key=lambda c: c["index"])
        return {"id": self.id, "object": "text_completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self._usage()}

    def _echo_chunks(self, i: int, logprobs: dict | None) -> list[dict]:
        text = self.echo_texts[i]
        chunks = []
        for j in range(self.n):
            self.text_len[i * self.n + j] = len(text)
            chunks.append(self._chunk("text_completion", [
                {"index": i * self.n + j, "text": text, "logprobs": logprobs,
                 "finish_reason": None}]))
        return chunks

    def _chunk(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    async def stream_completion(self, streams) -> AsyncIterator[dict]:
        # the echoed prompt goes first; with its logprobs asked for, when the prefill made them
        # (with the prompt's first output)
        echo_waits = self.body.echo and self.params.prompt_logprobs is not None
        if self.body.echo and not echo_waits:
            for i in range(len(self.echo_texts)):
                for chunk in self._echo_chunks(i, None):
                    yield chunk
        echoed: set[int] = set()
        async for i, out in self._merge(streams):
            if echo_waits and i not in echoed:
                echoed.add(i)
                for chunk in self._echo_chunks(i, self._echo_logprobs(i, out)):
                    yield chunk
            if self.score_only:
                if out.finished:
                    for co in out.outputs:
                        self._count_tokens(i * self.n + co.index, co)
                        yield self._chunk("text_completion", [
                            {"index": i * self.n + co.index, "text": "", "logprobs": None,
                             "finish_reason": "length"}])
                continue
            for co, delta in zip(out.outputs, out.deltas):
                idx = i * self.n + co.index
                new_tokens = self._count_tokens(idx, co)
                # a token whose text is held back (a special token, a character's first bytes)
                # still goes out, text "": clients see progress and its logprobs (as vLLM does)
                if not delta and not co.finished and not new_tokens:
                    continue
                yield self._chunk("text_completion", [
                    {"index": idx, "text": delta,
                     "logprobs": self._new_logprobs(idx, co, chat=False),
                     "finish_reason": co.finish_reason}])
        if self.body.include_usage:
            chunk = self._chunk("text_completion", [])
            chunk["usage"] = self._usage()
            yield chunk

    # ---- chat
    async def full_chat(self, streams) -> dict:
        final = None
        async for _, out in self._merge(streams):
            if out.finished:
                final = out
        choices = []
        for co in final.outputs:
            self.completion_ids[co.index] = co.token_ids
            message, finish_reason = self._message(co.text, co.finish_reason)
            choices.append({"index": co.index, "message": message,
                            "logprobs": self._new_logprobs(co.index, co, chat=True),
                            "finish_reason": finish_reason})
        return {"id": self.id, "object": "chat.completion", "created": self.created,
                "model": self.model, "choices": choices, "usage": self._usage()}

    def _message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message of a finished choice, its tool calls parsed; finish_reason
        "tool_calls" when it called tools."""
        if self.tool_mode == "none":
            return {"role": "assistant", "content": text}, finish_reason
        if self.tool_mode == "auto":
            content, calls = parse_tagged_calls(text, self.tool_names)
        else:
            calls = parse_forced_call(text)
            content = None if calls else text
        message = {"role": "assistant", "content": content}
        calls = calls[:self.max_tool_calls]
        if calls:
            message["tool_calls"] = [c.openai() for c in calls]
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return message, finish_reason

    async def stream_chat(self, streams) -> AsyncIterator[dict]:
        for j in range(self.n):
            yield self._chunk("chat.completion.chunk", [
                {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}])
        tool_streams = ({j: ToolCallStream(self.tool_mode != "auto", self.tool_names)
                         for j in range(self.n)} if self.tool_mode != "none" else None)
        done: set[int] = set()      # choices that sent their finish_reason (n > 1: a
        #                              finished choice is in its siblings' later outputs too)
        async for _, out in self._merge(streams):
            for co, delta in zip(out.outputs, out.deltas):
                new_tokens = self._count_tokens(co.index, co)
                if co.index in done:
                    continue
                if co.finished:
                    done.add(co.index)
                finish_reason = co.finish_reason
                calls = []
                if tool_streams is not None:
                    ts = tool_streams[co.index]
                    delta = ts.feed(delta)
                    if co.finished:
                        tail, calls = ts.finish()
                        calls = calls[:self.max_tool_calls]
                        delta += tail
                        if calls and finish_reason == "stop":
                            finish_reason = "tool_calls"
                if not delta and not co.finished and not new_tokens:
                    continue                     # as in stream_completion
                logprobs = self._new_logprobs(co.index, co, chat=True)
                if calls:       # content first, then the calls with the finish reason
                    if delta:
                        yield self._chunk("chat.completion.chunk", [
                            {"index": co.index, "delta": {"content": delta},
                             "logprobs": logprobs, "finish_reason": None}])
                        logprobs = None
                    yield self._chunk("chat.completion.chunk", [
                        {"index": co.index,
                         "delta": {"tool_calls": [c.openai(i) for i, c in enumerate(calls)]},
                         "logprobs": logprobs, "finish_reason": finish_reason}])
                    continue
                yield self._chunk("chat.completion.chunk", [
                    {"index": co.index, "delta": {"content": delta} if delta else {},
                     "logprobs": logprobs, "finish_reason": finish_reason}])
        if self.body.include_usage:
            chunk = self._chunk("chat.completion.chunk", [])
            chunk["usage"] = self._usage()
            yield chunk


def create_app(engine: AsyncLLMEngine, config: ServerConfig,
               metrics: ServerMetrics | None = None) -> FastAPI:
    serving = OpenAIServing(engine, config, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.shutdown()           # uvicorn has drained (or cancelled) the in-flight requests

    app = FastAPI(title="kvforge", lifespan=lifespan)
    app.state.serving = serving
    install_error_handlers(app)

    if config.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=config.api_key, open_paths=_OPEN_PATHS)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            raise OpenAIError(503, "the engine is not running")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics_endpoint():
        return Response(serving.metrics.render(), media_type=serving.metrics.content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": config.served_model_name, "object": "model", "created": int(time.time()),
            "owned_by": "kvforge", "max_model_len": serving.max_model_len,
            "chat_template": getattr(serving.tokenizer, "chat_template", None) is not None}]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await cancel_on_disconnect(request, serving.completions(body))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        return await cancel_on_disconnect(request, serving.chat(body))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        serving.check_model(body.model)
        tok = serving.tokenizer
        try:
            if body.messages is not None:
                ids = tok.apply_chat_template([m.template_dict() for m in body.messages],
                                              add_generation_prompt=body.add_generation_prompt)
            elif body.prompt is not None:
                ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
            else:
                raise ValueError("give either prompt or messages")
        except ValueError as e:
            raise OpenAIError(400, str(e), code="invalid_value") from e
        return {"tokens": ids, "count": len(ids), "max_model_len": serving.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        serving.check_model(body.model)
        serving.check_token_ids(body.tokens, "tokens")
        return {"prompt": serving.tokenizer.decode(body.tokens, skip_special_tokens=False)}

    return app
