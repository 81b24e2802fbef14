"""``kvforge serve --data-parallel-size N``: N replicas behind one OpenAI endpoint.

    client ─► router (this app) ─► CacheAwareRouter.route(text of the request) ─► replica i
              POST /v1/completions, /v1/chat/completions: the body is passed on as it came;
              the answer (a stream: chunk by chunk) comes back as the replica sent it, with
              header x-kvforge-replica: i
              GET /metrics: every replica's metrics with a label replica="i", plus the router's
              GET /health: 200 when every replica answers its own /health
              a replica that refuses connections is routed around (the request goes to
              another), until /health finds it answering again
              GET /v1/models, POST /tokenize, /detokenize: replica 0 (all serve one model)
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import signal
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvforge.distributed.router import CacheAwareRouter, RouterConfig, routing_text
from kvforge.server.errors import OpenAIError, install_error_handlers

logger = logging.getLogger(__name__)
REPLICA_HEADER = "x-kvforge-replica"
_PASSED_HEADERS = ("authorization", "content-type", "accept")


class _Families:
    """A collector yielding parsed metric families as they are."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families


def merge_replica_metrics(texts: list[str]) -> list[Metric]:
    """Each replica's exposition text -> one family per metric, every sample labelled with
    its replica's index."""
    merged: dict[str, Metric] = {}
    for i, text in enumerate(texts):
        for fam in text_string_to_metric_families(text):
            out = merged.get(fam.name)
            if out is None:
                out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            out.samples.extend(s._replace(labels={**s.labels, "replica": str(i)})
                               for s in fam.samples)
    return list(merged.values())


class RouterMetrics:
    def __init__(self, num_replicas: int) -> None:
        self.registry = r = CollectorRegistry()
        self.routed = Counter("kvforge:router_requests", "Requests routed, by replica and reason "
                              "(cache: longest cached prefix; load: least loaded; balance: loads "
                              "too uneven for the cache to matter)", ["replica", "reason"],
                              registry=r)
        self.load = Gauge("kvforge:router_replica_load", "Requests a replica is serving now",
                          ["replica"], registry=r)
        for i in range(num_replicas):
            self.load.labels(str(i)).set(0)


def create_router_app(urls: list[str], router_config: RouterConfig | None = None,
                      request_timeout: float | None = None) -> FastAPI:
    router = CacheAwareRouter(len(urls), router_config)
    metrics = RouterMetrics(len(urls))
    state: dict[str, httpx.AsyncClient] = {}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state["client"] = httpx.AsyncClient(
            timeout=httpx.Timeout(request_timeout, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        yield
        await state["client"].aclose()

    app = FastAPI(title="kvforge data-parallel router", lifespan=lifespan)
    app.state.router = router
    install_error_handlers(app)

    def headers_of(request: Request) -> dict[str, str]:
        return {k: v for k, v in request.headers.items() if k.lower() in _PASSED_HEADERS}

    async def send(replica: int, method: str, path: str, request: Request, content: bytes | None,
                   stream: bool) -> httpx.Response:
        """The replica's response; httpx.ConnectError when it cannot be reached (nothing was
        sent: safe to send elsewhere), OpenAIError 503 when it failed later."""
        client = state["client"]
        try:
            req = client.build_request(method, urls[replica] + path, content=content,
                                       headers=headers_of(request))
            return await client.send(req, stream=stream)
        except httpx.ConnectError:
            raise
        except httpx.HTTPError as e:
            raise OpenAIError(503, f"replica {replica} ({urls[replica]}) is unreachable: "
                                   f"{type(e).__name__}: {e}") from e

    def finished(replica: int) -> None:
        router.finished(replica)
        metrics.load.labels(str(replica)).dec()

    async def generate(path: str, request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = None                          # the replica answers with the 400
        text = routing_text(path, body) if isinstance(body, dict) else ""
        while True:
            try:
                replica, reason = router.route(text)
            except RuntimeError as e:
                raise OpenAIError(503, str(e)) from e
            metrics.routed.labels(str(replica), reason).inc()
            metrics.load.labels(str(replica)).inc()
            done = functools.partial(finished, replica)
            try:
                resp = await send(replica, "POST", path, request, raw, stream=True)
                break
            except httpx.ConnectError as e:
                # the replica is gone: route around it from now on (GET /health brings it
                # back once it answers)
                logger.warning("replica %d (%s) is unreachable: %s", replica, urls[replica], e)
                router.mark_down(replica)
                done()
            except BaseException:
                done()
                raise
        headers = {REPLICA_HEADER: str(replica)}
        if not (isinstance(body, dict) and body.get("stream")):
            try:
                content = await resp.aread()
            finally:
                await resp.aclose()
                done()
            return Response(content, status_code=resp.status_code, headers=headers,
                            media_type=resp.headers.get("content-type"))

        async def relay():
            # closed early (the client left): closing the upstream stream tells the replica,
            # which aborts the request
            try:
                async for chunk in resp.aiter_raw():
                    yield chunk
            finally:
                await resp.aclose()
                done()
        return StreamingResponse(relay(), status_code=resp.status_code, headers=headers,
                                 media_type=resp.headers.get("content-type"))

    async def forward_to_first(method: str, path: str, request: Request) -> Response:
        content = await request.body() if method == "POST" else None
        try:
            resp = await send(0, method, path, request, content, stream=False)
        except httpx.ConnectError as e:
            raise OpenAIError(503, f"replica 0 ({urls[0]}) is unreachable: {e}") from e
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await generate("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models(request: Request):
        return await forward_to_first("GET", "/v1/models", request)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await forward_to_first("POST", "/tokenize", request)

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await forward_to_first("POST", "/detokenize", request)

    async def each_replica(path: str) -> list[httpx.Response | Exception]:
        client = state["client"]
        return await asyncio.gather(*(client.get(u + path, timeout=10.0) for u in urls),
                                    return_exceptions=True)

    @app.get("/health")
    async def health():
        bad = []
        for i, r in enumerate(await each_replica("/health")):
            if isinstance(r, Exception) or r.status_code != 200:
                bad.append(f"replica {i}: {r if isinstance(r, Exception) else r.status_code}")
            else:
                router.mark_up(i)
        if bad:
            raise OpenAIError(503, "unhealthy replicas: " + "; ".join(bad))
        return {"status": "ok", "replicas": len(urls)}

    @app.get("/metrics")
    async def metrics_endpoint():
        answers = await each_replica("/metrics")
        texts = [r.text if isinstance(r, httpx.Response) and r.status_code == 200 else ""
                 for r in answers]
        registry = CollectorRegistry(auto_describe=False)
        registry.register(_Families(merge_replica_metrics(texts)))
        return Response(generate_latest(registry) + generate_latest(metrics.registry),
                        media_type=CONTENT_TYPE_LATEST)

    return app


def replica_engine_kwargs(engine_kwargs: dict[str, Any], num_replicas: int) -> dict[str, Any]:
    """Each replica's engine options: the cores shared out among replicas and their ranks."""
    from kvforge.engine.threads import default_num_threads
    ranks = num_replicas * engine_kwargs.get("tensor_parallel_size", 1)
    return {**engine_kwargs,
            "num_threads": engine_kwargs.get("num_threads") or max(1, default_num_threads() // ranks)}


def run(engine_kwargs: dict[str, Any], args) -> int:
    """``kvforge serve --data-parallel-size N``: start the replicas, then the router."""
    import uvicorn

    from kvforge.config import EngineConfig
    from kvforge.distributed.replicas import REPLICA_SERVER_OPTIONS, launch_replicas
    from kvforge.server.serve import API_KEY_ENV, _model_name

    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    n = args.data_parallel_size
    kwargs = replica_engine_kwargs(engine_kwargs, n)
    EngineConfig.from_kwargs(**kwargs)            # bad options fail here, not in N replicas
    options = {k: getattr(args, k) for k in REPLICA_SERVER_OPTIONS}
    options["api_key"] = options["api_key"] or os.environ.get(API_KEY_ENV) or None
    options["served_model_name"] = options["served_model_name"] or _model_name(kwargs.get("model"))
    backend = kwargs.get("distributed_executor_backend", "mp")
    replicas = launch_replicas(backend, kwargs, options, n)
    try:
        replicas.wait_ready()
        logger.info("data parallel: %d replicas (%s) at %s", n, backend, ", ".join(replicas.urls))
        app = create_router_app(replicas.urls, RouterConfig(
            cache_threshold=args.router_cache_threshold))
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port,
                                               log_level=args.log_level,
                                               timeout_graceful_shutdown=args.shutdown_timeout))
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        server.run()
    finally:
        replicas.stop(timeout=args.shutdown_timeout)
    return 0
