"""benchmarks/offload_contention.py: CPU shares from /proc/stat, and a tiny run end to end."""
from __future__ import annotations

import os

import pytest

from benchmarks import offload_contention as oc


def test_shares_split_the_interval_by_kind():
    before = [100, 0, 10, 500, 0, 0, 0, 5]
    after = [160, 0, 20, 520, 10, 0, 0, 35]      # +60 user +10 system +20 idle +10 iowait +30 steal
    got = oc.shares(before, after)
    assert set(got) == set(oc.CPU_FIELDS)
    assert got["user"] == pytest.approx(60 / 130) and got["steal"] == pytest.approx(30 / 130)
    assert sum(got.values()) == pytest.approx(1.0)


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="needs /proc/stat")
def test_a_tiny_run_prints_every_row_and_the_summary(tmp_path, capsys):
    assert oc.main(["--offload-dir", str(tmp_path), "--sizes", "256KiB", "1MiB",
                    "--threads", "1", "--probe", "2MiB", "--seconds", "0.05"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("1 ")]
    assert [int(r.split("|")[1]) for r in rows] == [256, 1024]
    for r in rows:
        cells = [float(c.replace(",", "")) for c in r.split("|")[2:]]
        assert cells[0] > 0 and cells[2] > 0            # both read rates measured
        assert cells[3] > 0                              # the GEMM ran beside the reads
        assert all(0 <= c <= 100 for c in cells[4:7])    # shares in percent
    assert "SUMMARY offload_contention" in out
    assert list(tmp_path.iterdir()) == []                # the probes are gone


def test_a_request_size_that_does_not_tile_the_probe_is_refused(tmp_path):
    with pytest.raises(ValueError, match="3KiB"):
        oc.main(["--offload-dir", str(tmp_path), "--sizes", "3KiB", "--probe", "2MiB"])
