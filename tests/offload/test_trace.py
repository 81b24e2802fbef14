"""Chrome trace output and the overlap fraction."""
import json

import pytest

from kvforge.offload.trace import TraceRecorder


def test_overlap_fraction_counts_load_time_under_compute():
    t = TraceRecorder()
    t.add("load", "layer 1", 0.0, 1.0)
    t.add("compute", "layer 0", 0.5, 2.0)      # covers the second half of the load
    t.add("load", "layer 2", 3.0, 4.0)         # nothing computes meanwhile
    assert t.overlap_fraction() == pytest.approx(0.25)
    t.add("compute", "layer 1", 3.0, 3.5)
    assert t.overlap_fraction() == pytest.approx(0.5)


def test_trace_json_has_a_lane_per_activity(tmp_path):
    t = TraceRecorder()
    s = t.now()
    t.add("load", "layer 0", s, s + 0.001)
    t.add("compute", "layer 0", s + 0.001, s + 0.002)
    t.add("store", "kv 0/0", s + 0.002, s + 0.003)
    path = tmp_path / "trace.json"
    t.write(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    lanes = {e["args"]["name"]: e["tid"] for e in events if e["ph"] == "M"}
    assert set(lanes) == {"load", "compute", "store"}
    complete = [e for e in events if e["ph"] == "X"]
    assert [e["tid"] for e in complete] == [lanes["load"], lanes["compute"], lanes["store"]]
    assert all(e["dur"] > 0 for e in complete)
    with pytest.raises(ValueError, match="lane"):
        t.add("gpu", "x", 0, 1)
