"""Kept-alive engines: ``kvforge generate --keep-alive 10m`` leaves its engine loaded in a
background server, and the next ``generate`` with the same engine flags talks to it instead of
loading the model again (ollama's ``keep_alive``). A process that runs an engine pays for
importing torch and loading the model (seconds); one that asks a running engine pays for
starting Python and one request over a unix socket.

    first call:  /health fails -> lock -> still no engine -> spawn ``python -m
                 kvforge.server.resident`` (the OpenAI server on ``<run dir>/<key>.sock``,
                 exiting after the keep-alive of idleness) -> /health answers -> unlock
                 -> stream the answer
    later calls: /health answers -> stream the answer

``<key>`` hashes the engine's arguments (and kvforge's version and location), so a call with
other engine flags gets an engine of its own; sampling flags travel with each request. The run
directory (``$KVFORGE_RUN_DIR``, else ``$XDG_RUNTIME_DIR/kvforge``, else
``~/.cache/kvforge/run``) is private to the user (0700): the sockets are the engines' only door.
``kvforge chat --keep-alive`` does the same for a conversation; ``kvforge ps`` lists the
kept-alive engines, ``kvforge stop`` ends them.

This module runs before anything imports torch (the CLI's fast path) and so uses only the
standard library: ``http.client`` over an AF_UNIX socket and the server's server-sent events
read line by line (importing httpx alone costs ~0.3 s, the openai client ~1.3 s, against the
~0.1 s this path takes in all)."""
from __future__ import annotations

import contextlib
import hashlib
import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from kvforge.file_lock import exclusive
from kvforge.processes import is_zombie, pid_exists

KEEP_ALIVE_ENV = "KVFORGE_KEEP_ALIVE"
RUN_DIR_ENV = "KVFORGE_RUN_DIR"
START_TIMEOUT_S = 900.0         # a first load may pull a catalogue model or build an offload store
POLL_S = 0.05

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | None) -> float | None:
    """Seconds an engine stays loaded after its last request: '300', '30s', '5m', '1h'; 0: no
    keep-alive (None is returned); negative: until ``kvforge stop`` (returned as inf)."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*(-?\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text).lower())
    if m is None:
        raise ValueError(f"--keep-alive must be a duration like 300, 30s, 5m or 1h (0: off, "
                         f"negative: until `kvforge stop`), got {text!r}")
    seconds = float(m.group(1)) * _UNITS[m.group(2)]
    if seconds == 0:
        return None
    return float("inf") if seconds < 0 else seconds


def run_dir() -> Path:
    base = os.environ.get(RUN_DIR_ENV)
    if not base:
        xdg = os.environ.get("XDG_RUNTIME_DIR")
        base = os.path.join(xdg, "kvforge") if xdg else os.path.expanduser("~/.cache/kvforge/run")
    path = Path(base)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    # whoever can reach a socket here can use (and stop) the engine behind it: refuse a
    # directory others can enter rather than change the mode of one the user named
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ValueError(f"kept-alive engines need a private run directory (owned by you, mode "
                         f"0700); {path} is not: set ${RUN_DIR_ENV} to one")
    return path


# engine arguments naming files: a relative path means a different file from another directory
_INPUT_PATHS = ("model", "speculative_draft_model")      # files, or catalogue names
_OUTPUT_PATHS = ("offload_dir", "offload_trace")


def engine_key(engine_kwargs: dict[str, Any]) -> str:
    """One engine per set of engine arguments (and the size and mtime of the model files they
    name), kvforge version and installation."""
    import kvforge
    files = {}                   # a model file replaced in place: the old engine no longer fits
    for name in _INPUT_PATHS:
        value = engine_kwargs.get(name)
        if isinstance(value, str) and os.path.exists(value):
            st = os.stat(value)
            files[name] = [st.st_size, st.st_mtime_ns]
    ident = {"engine": engine_kwargs, "files": files, "version": getattr(kvforge, "__version__", ""),
             "package": os.path.dirname(os.path.abspath(kvforge.__file__))}
    blob = json.dumps(ident, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def _get_json(path: str, url: str, timeout: float = 5.0) -> tuple[int, Any]:
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", url)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"null")
    finally:
        conn.close()


def _alive(path: str) -> bool:
    try:
        status, _ = _get_json(path, "/health")
    except (OSError, http.client.HTTPException, ValueError):
        return False
    return status == 200


def _log_tail(log: Path, lines: int = 20) -> str:
    try:
        text = log.read_text(errors="replace").strip().splitlines()
    except OSError:
        return "(no log)"
    prefix = "kvforge: error: "
    errors = [t[len(prefix):] for t in text if t.startswith(prefix)]
    return errors[-1] if errors else "\n".join(text[-lines:])


def _start(key: str, engine_kwargs: dict[str, Any], keep_alive_s: float, directory: Path) -> None:
    sock, log = directory / f"{key}.sock", directory / f"{key}.log"
    with contextlib.suppress(FileNotFoundError):
        sock.unlink()                                      # a dead engine's socket
    cmd = [sys.executable, "-m", "kvforge.server.resident", "--uds", str(sock),
           "--engine-kwargs", json.dumps(engine_kwargs, default=str),
           "--state", str(directory / f"{key}.json")]
    if keep_alive_s != float("inf"):
        cmd += ["--idle-timeout", repr(keep_alive_s)]
    # the socket is the engine's only door and the run directory private: no API key on it
    env = {k: v for k, v in os.environ.items() if k != "KVFORGE_API_KEY"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, close_fds=True, env=env)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not _alive(str(sock)):
        if proc.poll() is not None:
            raise RuntimeError(f"the kept-alive engine did not start: {_log_tail(log)} "
                               f"(log {log})")
        if time.monotonic() > deadline:
            proc.terminate()
            raise RuntimeError(f"the kept-alive engine did not answer within "
                               f"{START_TIMEOUT_S:.0f} s (log {log})")
        time.sleep(POLL_S)


def absolute_paths(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """``engine_kwargs`` with its paths absolute (the engine's key and its process's cwd must
    not decide which file a relative path names)."""
    out = dict(engine_kwargs)
    for name in _INPUT_PATHS:
        value = out.get(name)
        if isinstance(value, str) and os.path.exists(value):
            out[name] = os.path.abspath(value)
    for name in _OUTPUT_PATHS:
        if isinstance(out.get(name), str):
            out[name] = os.path.abspath(out[name])
    return out


def ensure_engine(engine_kwargs: dict[str, Any], keep_alive_s: float) -> str:
    """The socket of a running engine for ``engine_kwargs``, started if there is none (one
    start at a time per key: concurrent calls wait for the first one's engine)."""
    engine_kwargs = absolute_paths(engine_kwargs)
    directory = run_dir()
    key = engine_key(engine_kwargs)
    sock = str(directory / f"{key}.sock")
    if _alive(sock):
        return sock
    with exclusive(str(directory / f"{key}.lock")):
        if not _alive(sock):
            _start(key, engine_kwargs, keep_alive_s, directory)
    return sock


def _events(resp) -> Iterator[dict]:
    """The JSON payloads of a server-sent event stream, up to ``[DONE]``."""
    for raw in resp:
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _error_message(body: bytes, status: int) -> str:
    try:
        return json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200]!r}"


def _has_chat_template(sock: str) -> bool:
    status, models = _get_json(sock, "/v1/models")
    return bool(models["data"][0].get("chat_template")) if status == 200 else False


def _stream(sock: str, url: str, body: dict[str, Any], chat: bool, out) -> tuple[int, str]:
    """POST a streamed completion, printing its text as it comes: (0, text), or (2, "") with
    the server's error message on stderr."""
    conn = _UnixConnection(sock)
    text = []
    try:
        conn.request("POST", url, json.dumps(dict(body, stream=True)),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            print(f"kvforge: error: {_error_message(resp.read(), resp.status)}", file=sys.stderr)
            return 2, ""
        for event in _events(resp):
            if "error" in event:
                print(f"kvforge: error: {event['error'].get('message')}", file=sys.stderr)
                return 2, ""
            choice = (event.get("choices") or [{}])[0]
            piece = choice.get("delta", {}).get("content") if chat else choice.get("text")
            if piece:
                text.append(piece)
                out.write(piece)
                out.flush()
    finally:
        conn.close()
    out.write("\n")
    return 0, "".join(text)


def stream_generate(sock: str, prompt: str, wrap: bool | None, sampling: dict[str, Any],
                    out=None) -> int:
    """``kvforge generate`` against a running engine: the prompt as a user turn of the chat
    template when ``wrap`` (None: when the model has one), else as it is; text printed as it
    streams. 0, or 2 with the server's error message on stderr."""
    out = out or sys.stdout
    if wrap is False:                 # the prompt as it is: the model card is not needed
        return _stream(sock, "/v1/completions", dict(sampling, prompt=prompt), False, out)[0]
    has_template = _has_chat_template(sock)
    if wrap is None:
        wrap = has_template
    if wrap and not has_template:
        print("kvforge: error: --chat-template: the model has no chat template (a base model?): "
              "use --no-chat-template", file=sys.stderr)
        return 2
    if wrap:
        body = dict(sampling, messages=[{"role": "user", "content": prompt}])
        return _stream(sock, "/v1/chat/completions", body, True, out)[0]
    return _stream(sock, "/v1/completions", dict(sampling, prompt=prompt), False, out)[0]


def serve_chat(sock: str, system: str | None, sampling: dict[str, Any], out=None) -> int:
    """``kvforge chat`` against a running engine: the CLI's loop, each reply a streamed request
    with the conversation so far."""
    from kvforge.cli import chat_loop, no_chat_template_error
    out = out or sys.stdout
    if not _has_chat_template(sock):
        print(f"kvforge: error: {no_chat_template_error('this one')}", file=sys.stderr)
        return 2

    def reply(messages: list[dict[str, str]]) -> str | None:
        rc, text = _stream(sock, "/v1/chat/completions", dict(sampling, messages=messages), True,
                           out)
        return None if rc else text

    return chat_loop(system, reply)


def sampling_fields(args) -> dict[str, Any]:
    """The CLI's sampling flags as the server's request fields (the same SamplingParams)."""
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p,
            "repetition_penalty": args.repetition_penalty, "seed": args.seed, "stop": args.stop,
            "diffusion_steps": args.diffusion_steps,
            "diffusion_block_length": args.diffusion_block_length, "remasking": args.remasking,
            "parallel_threshold": args.parallel_threshold, "diffusion_cache": args.diffusion_cache}


# ------------------------------------------------------------------ kvforge ps / stop
def running_engines() -> list[dict[str, Any]]:
    """The state files of kept-alive engines whose process is alive (stale ones removed)."""
    out = []
    for state in sorted(run_dir().glob("*.json")):
        try:
            info = json.loads(state.read_text())
            pid = int(info["pid"])
            if not pid_exists(pid) or is_zombie(pid):      # killed, not yet reaped: gone
                raise ProcessLookupError(info["pid"])
        except (OSError, ValueError, KeyError):
            with contextlib.suppress(OSError):
                state.unlink()
            continue
        out.append(info)
    return out


def cmd_ps(args) -> int:
    engines = running_engines()
    if not engines:
        print("no kept-alive engines")
        return 0
    now = time.time()
    for e in engines:
        timeout = e.get("idle_timeout")
        print(f"pid {e['pid']}  model {e.get('model') or '(default)'}  up {now - e['started']:.0f} s"
              f"  keep-alive {'forever' if timeout is None else f'{timeout:g} s'}  {e['socket']}")
    return 0


def cmd_stop(args) -> int:
    """SIGTERM every kept-alive engine (or those of ``args.model``): a graceful shutdown."""
    stopped = 0
    for e in running_engines():
        if args.model is not None and e.get("model") != args.model:
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(e["pid"]), signal.SIGTERM)
            stopped += 1
    print(f"stopped {stopped} kept-alive engine(s)")
    return 0


def add_commands(sub) -> None:
    p = sub.add_parser("ps", help="list kept-alive engines (generate --keep-alive)")
    p.set_defaults(func=cmd_ps)
    p = sub.add_parser("stop", help="stop kept-alive engines")
    p.add_argument("model", nargs="?", default=None,
                   help="only the engines of this --model value (default: all)")
    p.set_defaults(func=cmd_stop)
