"""``kvforge serve``: engine + OpenAI API on uvicorn, with graceful shutdown.

SIGTERM / SIGINT: uvicorn stops accepting connections, lets in-flight requests finish for up to
``--shutdown-timeout`` seconds, then cancels the rest (each cancelled stream aborts its engine
request); the lifespan hook then stops the engine thread and the process exits 0.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
from typing import Any

API_KEY_ENV = "KVFORGE_API_KEY"


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set)")
    g.add_argument("--served-model-name", default=None,
                   help="model id clients use (default: the model file's name)")
    g.add_argument("--max-waiting-requests", type=int, default=512,
                   help="admitted requests without a first token before new ones get 429")
    g.add_argument("--max-n", type=int, default=16, help="largest n a request may ask for")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may run on after SIGTERM")
    g.add_argument("--uds", default=None, metavar="PATH",
                   help="listen on this unix socket instead of --host / --port")
    g.add_argument("--idle-timeout", type=float, default=None, metavar="SECONDS",
                   help="exit after this many seconds without a request (kept-alive engines)")
    g.add_argument("--log-level", default="info")
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine replicas behind this endpoint (processes with "
                        "--distributed-executor-backend mp, Ray actors with ray), requests "
                        "routed to the replica caching their longest prefix, else the least loaded")
    g.add_argument("--router-cache-threshold", type=float, default=0.5,
                   help="data parallel: the cached prefix must exceed this fraction of a "
                        "request's text to route by cache")


def build_server(engine_kwargs: dict[str, Any], args: argparse.Namespace):
    """(uvicorn.Server, AsyncLLMEngine) ready to run."""
    import uvicorn

    from kvforge.config import EngineConfig
    from kvforge.engine.async_engine import AsyncLLMEngine
    from kvforge.engine.factory import create_engine
    from kvforge.server.idle_exit import IdleExitServer, IdleTracker
    from kvforge.server.metrics import ServerMetrics
    from kvforge.server.openai_api import ServerConfig, create_app

    idle_timeout = getattr(args, "idle_timeout", None)
    if idle_timeout is not None and idle_timeout <= 0:
        raise ValueError(f"--idle-timeout must be > 0 seconds, got {idle_timeout}")
    # LLMEngine, or DiffusionEngine for a masked-diffusion model (same request interface)
    engine = create_engine(EngineConfig.from_kwargs(**engine_kwargs))
    name = args.served_model_name or _model_name(engine_kwargs.get("model"))
    config = ServerConfig(served_model_name=name,
                          api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                          max_waiting_requests=args.max_waiting_requests, max_n=args.max_n)
    metrics = ServerMetrics(name)
    async_engine = AsyncLLMEngine(engine, step_callback=metrics.on_step)
    app = create_app(async_engine, config, metrics)
    if idle_timeout is not None:
        app = IdleTracker(app)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, uds=getattr(args, "uds", None),
        log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout)
    server = (uvicorn.Server(uvicorn_config) if idle_timeout is None
              else IdleExitServer(uvicorn_config, app, idle_timeout))
    return server, async_engine


def run(engine_kwargs: dict[str, Any], args: argparse.Namespace) -> int:
    if getattr(args, "data_parallel_size", 1) != 1:
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        from kvforge.distributed.dp_server import run as run_data_parallel
        return run_data_parallel(engine_kwargs, args)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    server, async_engine = build_server(engine_kwargs, args)
    # uvicorn handles SIGTERM/SIGINT itself, then re-raises the signal to whatever handler was
    # installed before it; a no-op one lets a graceful shutdown end with exit status 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    try:
        server.run()
    finally:
        async_engine.shutdown()
    return 0


def _model_name(model: str | None) -> str:
    if model is None:
        from kvforge.loader.default_model import DEFAULT_MODEL_FILE
        model = DEFAULT_MODEL_FILE
    base = os.path.basename(os.path.normpath(model))
    return base[:-5] if base.endswith(".gguf") else base
