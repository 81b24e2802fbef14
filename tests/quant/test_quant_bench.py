"""benchmarks/quant.py method specs: group sizes and extra quantization arguments."""
from benchmarks.quant import BUILTIN, parse_method


def test_method_specs_parse_to_labels_and_arguments():
    assert parse_method("none") == ("fp32", "none", {})
    assert parse_method("awq:g128") == ("awq-g128", "awq", {"group_size": 128})
    assert parse_method("int4:g32:lm_head=int4") == (
        "int4-g32-lm_head=int4", "int4", {"group_size": 32, "lm_head": "int4"})
    assert parse_method("smoothquant:alpha=0.6") == ("smoothquant-alpha=0.6", "smoothquant",
                                                     {"alpha": 0.6})


def test_default_rows_compare_awq_and_rtn_at_every_group_size():
    for group in (32, 64, 128):
        assert f"int4:g{group}" in BUILTIN and f"awq:g{group}" in BUILTIN
