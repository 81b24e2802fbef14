"""The installed package stands alone: no kvforge module imports the repository's benchmarks/
scripts (an installed kvforge has no ``benchmarks`` package beside it, so such an import works
from a checkout's root and fails everywhere else: ``kvforge eval perplexity --corpus sharegpt``
did)."""
from __future__ import annotations

import ast
from pathlib import Path

import kvforge


def _imported_modules(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_no_package_module_imports_the_benchmark_scripts():
    root = Path(kvforge.__file__).parent
    offenders = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                       if any(m == "benchmarks" or m.startswith("benchmarks.")
                              for m in _imported_modules(p)))
    assert offenders == []


def test_sharegpt_text_reads_through_the_package(monkeypatch, tmp_path):
    """The corpus reader finds the ShareGPT json through kvforge.bench.sharegpt (here a small
    truncated array, as the shipped file is)."""
    import kvforge.bench.sharegpt as sharegpt
    from kvforge.eval.corpus import load_corpus
    data = tmp_path / "sharegpt.json"
    data.write_text('[{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", '
                    '"value": "Hello there."}]}, {"conversations": [{"from": "human", "value": '
                    '"q"}, {"from": "gpt", "value": "An answer."}]}, {"conversa')
    monkeypatch.setattr(sharegpt, "sharegpt_json_path", lambda: data)
    assert load_corpus("sharegpt") == "Hello there.\n\nAn answer."
