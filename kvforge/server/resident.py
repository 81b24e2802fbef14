"""The kept-alive engine's process (kvforge/keep_alive.py starts it): ``kvforge serve`` on a
unix socket, exiting after ``--idle-timeout`` seconds without a request, with a state file
(pid, model, socket) for ``kvforge ps`` / ``kvforge stop`` that it removes, with its socket,
when it ends.

    python -m kvforge.server.resident --uds PATH --engine-kwargs JSON --state FILE
        [--idle-timeout SECONDS]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvforge.server.resident")
    p.add_argument("--engine-kwargs", required=True, help="EngineConfig keyword arguments, JSON")
    p.add_argument("--state", required=True)
    from kvforge.server.serve import add_server_args
    add_server_args(p)
    p.set_defaults(log_level="warning")      # a background engine's log: its problems only
    args = p.parse_args(argv)
    if args.uds is None:
        p.error("--uds is required")
    engine_kwargs = json.loads(args.engine_kwargs)
    state = {"pid": os.getpid(), "model": engine_kwargs.get("model"), "socket": args.uds,
             "started": time.time(), "idle_timeout": args.idle_timeout}
    from kvforge.torch_import import import_torch_frozen
    import_torch_frozen()
    from kvforge.server.serve import run
    try:
        with open(args.state, "w") as f:
            json.dump(state, f)
        return run(engine_kwargs, args)
    except (ValueError, FileNotFoundError) as e:
        print(f"kvforge: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        # the files go with this process, unless a newer engine of the same key took them
        # over (this one stopped answering while shutting down, and a client started another)
        with contextlib.suppress(OSError, ValueError, KeyError):
            with open(args.state) as f:
                if json.load(f)["pid"] == os.getpid():
                    os.unlink(args.state)
                    os.unlink(args.uds)


if __name__ == "__main__":
    sys.exit(main())
