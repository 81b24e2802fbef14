"""benchmarks/gguf_kernels.py: a short run prints a row per (type, shape, rows) it can take, the
many-row kernel and crossover per type and one SUMMARY line; bad arguments are clear errors (no timed assertions)."""
from __future__ import annotations

import re

import pytest

from benchmarks import gguf_kernels
from tests.kernels.test_cpu_kernels import needs_kernels


def test_shapes_are_parsed_and_bad_ones_named():
    assert gguf_kernels.parse_shape("1536x576") == (1536, 576)
    for bad in ("1536", "0x256", "64x100", "axb"):
        with pytest.raises(ValueError, match=bad):
            gguf_kernels.parse_shape(bad)


@needs_kernels
def test_short_run_prints_rows_crossovers_and_summary(capsys):
    assert gguf_kernels.main(["--types", "Q4_1", "Q4_K", "--shapes", "32x576", "32x512",
                              "--rows", "1", "3", "--reps", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    # type | shape | rows | integer | panels | tiles | best many-row / integer
    rows = re.findall(r"^(Q4_1|Q4_K) \|\s+(\d+x\d+) \|\s+(\d+) \|\s+([\d.]+) \|\s+([\d.]+) \|"
                      r"\s+([\d.]+) \|", out, re.M)
    # Q4_K takes only the 512-wide input (whole super-blocks of 256)
    assert sorted({(t, s) for t, s, *_ in rows}) == [("Q4_1", "32x512"), ("Q4_1", "32x576"),
                                                     ("Q4_K", "32x512")]
    assert len(rows) == 6 and all(float(g) > 0 for *_, g in rows)
    summary = re.search(r"^SUMMARY gguf_kernels: crossover Q4_1 (\w+) (\d+), Q4_K (\w+) (\d+) "
                        r"(\| integer \w+ / maddubs [\d.]+-[\d.]+x, outputs identical )?"
                        r"\| hardware", out, re.M)
    assert summary is not None
    # on a VNNI CPU the maddubs kernels are timed beside them, every output the same bits
    from kvforge.kernels.ops import INT8_DOTS, int8_dot
    assert (summary.group(5) is not None) == (int8_dot() != INT8_DOTS["maddubs"])
    from kvforge.kernels.gguf_tiles import CANDIDATE_ROWS, KERNELS
    kernels, crossovers = summary.groups()[0:4:2], summary.groups()[1:4:2]
    assert set(kernels) <= set(KERNELS)
    assert {int(v) for v in crossovers} <= {0, *CANDIDATE_ROWS}
    with pytest.raises(SystemExit):
        gguf_kernels.main(["--types", "IQ2_XS"])
