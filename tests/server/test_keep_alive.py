"""Kept-alive engines (kvforge/keep_alive.py): ``kvforge generate --keep-alive`` answers like
the in-process command, later calls reuse the running engine, other engine flags get an engine
of their own, ``kvforge stop`` and the idle timeout end them, and a bad model is a clean error."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time

import pytest

from kvforge.cli import main
from kvforge.keep_alive import parse_duration, run_dir, running_engines
from kvforge.server.idle_exit import IdleTracker, exit_when_idle


@pytest.fixture
def engines_dir(monkeypatch):
    # a short path: a unix socket's path must fit sun_path (108 bytes)
    path = tempfile.mkdtemp(prefix="kvf")
    monkeypatch.setenv("KVFORGE_RUN_DIR", path)
    monkeypatch.delenv("KVFORGE_KEEP_ALIVE", raising=False)
    yield path
    main(["stop"])
    _wait_for(lambda: not running_engines(), 60)
    shutil.rmtree(path, ignore_errors=True)


def _wait_for(condition, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_parse_duration():
    assert parse_duration(None) is None
    assert parse_duration("0") is None
    assert parse_duration("300") == 300
    assert parse_duration("30s") == 30
    assert parse_duration("5m") == 300
    assert parse_duration("1.5h") == 5400
    assert parse_duration("-1") == float("inf")
    for bad in ("5x", "m", "", "1e3"):
        with pytest.raises(ValueError, match="--keep-alive"):
            parse_duration(bad)


def test_kept_alive_generate_answers_like_in_process_and_reuses_its_engine(
        tiny_model_factory, engines_dir, capsys, monkeypatch):
    path, _ = tiny_model_factory("llama")
    base = ["--model", path, "--max-tokens", "7", "--num-kv-blocks", "64"]
    # a server key in the environment is not the kept-alive engine's (its socket is private)
    monkeypatch.setenv("KVFORGE_API_KEY", "secret")
    for wrap in ([], ["--no-chat-template"]):
        assert main(["generate", "Hello there", *base, *wrap]) == 0
        expected = capsys.readouterr().out
        assert expected.strip()
        assert main(["generate", "Hello there", *base, *wrap, "--keep-alive", "60s"]) == 0
        assert capsys.readouterr().out == expected
    engines = running_engines()
    assert len(engines) == 1                  # both calls used one engine
    first = engines[0]["pid"]
    assert main(["generate", "Hello there", *base, "--keep-alive", "60s"]) == 0
    capsys.readouterr()
    assert [e["pid"] for e in running_engines()] == [first]
    # other engine flags: an engine of their own, the first one untouched
    assert main(["generate", "Hello there", *base, "--max-num-seqs", "2", "--keep-alive",
                 "60s"]) == 0
    capsys.readouterr()
    engines = running_engines()
    assert len(engines) == 2 and first in [e["pid"] for e in engines]
    assert main(["ps"]) == 0
    assert capsys.readouterr().out.count("keep-alive 60 s") == 2
    assert main(["stop"]) == 0
    assert "stopped 2" in capsys.readouterr().out
    assert _wait_for(lambda: not running_engines(), 60)
    assert not list(run_dir().glob("*.sock"))     # the engines removed their sockets


def test_kept_alive_chat_replies_like_in_process(tiny_model_factory, engines_dir, capsys,
                                                monkeypatch):
    """The conversation travels with each request: every reply equals the in-process chat's."""
    import io
    path, _ = tiny_model_factory("llama")
    flags = ["chat", "--model", path, "--system", "Be brief.", "--max-tokens", "6",
             "--num-kv-blocks", "64"]
    turns = "Hello there\nAnd then?\n\nnever read\n"
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    assert main(flags) == 0
    expected = capsys.readouterr().out
    assert expected.count("> ") == 3
    monkeypatch.setattr("sys.stdin", io.StringIO(turns))
    assert main([*flags, "--keep-alive", "30s"]) == 0
    assert capsys.readouterr().out == expected
    assert len(running_engines()) == 1


def test_a_kept_alive_engine_killed_mid_answer_is_a_clean_error(tiny_model_factory, engines_dir,
                                                                capsys, monkeypatch):
    """The engine dies while a client waits on it: exit 2 and a message, not a traceback; the
    next call starts a new engine."""
    import signal

    from kvforge import keep_alive
    path, _ = tiny_model_factory("llama")
    flags = ["generate", "Hi", "--model", path, "--max-tokens", "3", "--num-kv-blocks", "64",
             "--keep-alive", "60s"]
    assert main(flags) == 0
    capsys.readouterr()
    pid = running_engines()[0]["pid"]

    def dying_stream(*args, **kwargs):
        os.kill(pid, signal.SIGKILL)
        assert _wait_for(lambda: not running_engines(), 10)     # a zombie counts as gone
        return keep_alive._get_json(args[0], "/v1/models")
    monkeypatch.setattr(keep_alive, "_has_chat_template", dying_stream)
    assert main(flags) == 2
    assert "stopped answering" in capsys.readouterr().err
    monkeypatch.undo()
    monkeypatch.setenv("KVFORGE_RUN_DIR", engines_dir)
    assert main(flags) == 0
    assert [e["pid"] for e in running_engines()] != [pid]


def test_concurrent_first_calls_share_one_engine(tiny_model_factory, engines_dir):
    """Two `kvforge generate --keep-alive` processes started together: one starts the engine
    (under the key's lock), the other waits for it; both get the same answer."""
    import subprocess
    import sys
    path, _ = tiny_model_factory("llama")
    cmd = [sys.executable, "-m", "kvforge.cli", "generate", "Hello there", "--model", path,
           "--max-tokens", "5", "--num-kv-blocks", "64", "--keep-alive", "60s"]
    env = dict(os.environ, KVFORGE_RUN_DIR=engines_dir)
    procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
             for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [e.decode()[-2000:] for _, e in outs]
    assert outs[0][0] == outs[1][0] and outs[0][0].strip()
    assert len(running_engines()) == 1
    assert len(_resident_processes(engines_dir)) == 1     # not two, one overwriting the other


def _resident_processes(run_dir_path: str) -> list[int]:
    """Pids of kept-alive engine processes serving sockets in ``run_dir_path``."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
        except OSError:
            continue
        if "kvforge.server.resident" in cmdline and run_dir_path in cmdline:
            pids.append(int(entry))
    return pids


def test_kept_alive_engine_exits_when_idle(tiny_model_factory, engines_dir, capsys):
    path, _ = tiny_model_factory("llama")
    assert main(["generate", "Hi", "--model", path, "--max-tokens", "3", "--num-kv-blocks", "64",
                 "--keep-alive", "1s"]) == 0
    assert capsys.readouterr().out.strip()
    assert _wait_for(lambda: not running_engines(), 30)
    assert not list(run_dir().glob("*.sock"))


def test_kept_alive_engine_that_cannot_start_is_a_clean_error(engines_dir, capsys, tmp_path):
    rc = main(["generate", "x", "--model", str(tmp_path / "missing"), "--keep-alive", "10s"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "did not start" in err and "missing" in err
    assert not running_engines()
    assert main(["generate", "x", "--keep-alive", "5x"]) == 2
    assert "--keep-alive must be a duration" in capsys.readouterr().err


def test_idle_tracker_counts_a_streaming_response_until_its_last_chunk():
    """A response still streaming is not idle time, however long its handler has returned."""
    seen = []

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for _ in range(3):
            seen.append(tracker.idle_for())
            await asyncio.sleep(0.05)
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    tracker = IdleTracker(app)

    class Server:
        should_exit = False

    async def scenario():
        async def send(message):
            pass
        await tracker({"type": "http"}, None, send)
        assert tracker.in_flight == 0 and seen == [0.0, 0.0, 0.0]
        server = Server()
        start = time.monotonic()
        await exit_when_idle(server, tracker, 0.2)
        assert server.should_exit and time.monotonic() - start >= 0.15
        with pytest.raises(ValueError, match="idle timeout"):
            await exit_when_idle(Server(), tracker, 0)

    asyncio.run(scenario())


def test_run_directory_must_be_private(monkeypatch, tmp_path, capsys):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    monkeypatch.setenv("KVFORGE_RUN_DIR", str(shared))
    with pytest.raises(ValueError, match="private run directory"):
        run_dir()
    assert main(["generate", "x", "--keep-alive", "1m"]) == 2
    assert "private run directory" in capsys.readouterr().err
    assert oct(shared.stat().st_mode & 0o777) == "0o755"      # left as the user made it


def test_relative_paths_name_the_same_files_from_any_directory(tmp_path, monkeypatch):
    from kvforge.keep_alive import absolute_paths, engine_key
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    for d in ("a", "b"):
        (tmp_path / d / "m.gguf").write_bytes(b"x")
    keys = []
    for d in ("a", "b"):
        monkeypatch.chdir(tmp_path / d)
        kw = absolute_paths({"model": "m.gguf", "offload_trace": "t.json",
                             "speculative_draft_model": "qwen2.5-coder-0.5b-instruct"})
        assert kw["model"] == str(tmp_path / d / "m.gguf")
        assert kw["offload_trace"] == str(tmp_path / d / "t.json")
        assert kw["speculative_draft_model"] == "qwen2.5-coder-0.5b-instruct"  # a name
        keys.append(engine_key(kw))
    assert keys[0] != keys[1]          # two files, two engines
    kw = absolute_paths({"model": "m.gguf"})
    before = engine_key(kw)
    os.utime("m.gguf", ns=(1, 1))      # the file replaced in place
    assert engine_key(kw) != before


def test_kept_alive_state_files_of_dead_engines_are_dropped(engines_dir):
    stale = os.path.join(engines_dir, "0123456789abcdef.json")
    with open(stale, "w") as f:
        json.dump({"pid": 2 ** 22 + 12345, "socket": "x", "started": 0}, f)
    assert running_engines() == []
    assert not os.path.exists(stale)
