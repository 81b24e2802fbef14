// Python bindings of the kvforge CPU kernels (loaded by kvforge/kernels/__init__.py).
//
// Unity build: this is the only translation unit; the kernel files are included below. The
// torch headers dominate compile time, so one unit builds ~3x faster than one per file.
#include "kernels.h"

#include "argmax.cpp"
#include "kv_fp8.cpp"
#include "attention.cpp"
#include "elementwise.cpp"
#include "gguf_blocks.cpp"
#include "gguf_dot.cpp"
#include "gguf_gemm.cpp"
#include "gguf_weight.cpp"
#include "linear.cpp"
#include "linear_plan.cpp"
#include "quest.cpp"
#include "w8a8_gemm.cpp"
#include "sparse_gemv.cpp"    // after w8a8_gemm.cpp: a rotated projection's x Q is a W8A8 product
#include "decode_stack.cpp"   // last: its projections run the kernels above

// Every op releases the GIL while it runs, so other Python threads (swap copies) overlap it.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using release_gil = pybind11::call_guard<pybind11::gil_scoped_release>;
  m.def("add_rms_norm", &kvforge::add_rms_norm, "residual add + RMSNorm (fp32)", release_gil());
  m.def("silu_and_mul", &kvforge::silu_and_mul, "SwiGLU activation (fp32)", release_gil());
  m.def("rotary_neox", &kvforge::rotary_neox, "NeoX rotary embedding (fp32)", release_gil());
  m.def("argmax_rows", &kvforge::argmax_rows, "first index of each row's maximum (fp32)",
        release_gil());
  m.def("linear_rows", &kvforge::linear_rows_op, "x @ W^T, register-tiled (fp32)",
        release_gil());
  // rows linear_rows serves with one pass over W (one register tile of all rows): up to here
  // extra rows cost little on top of reading the weights (spec/decoder.py's row budget)
  m.attr("linear_few_rows_max") = kvforge::kFewRowsMax;
  m.def("linear_packed", &kvforge::linear_packed_op,
        "x @ W^T over a packed weight [ceil(out / pack_rows), in / lanes, pack_rows, lanes]",
        release_gil());
  m.def("packed_rows", &kvforge::packed_rows, "rows of a packed weight (an embedding lookup)",
        release_gil());
  m.attr("linear_lanes") = kvforge::kLanes;          // vector width
  m.attr("linear_pack_lanes") = kvforge::kPackLanes;  // the packed layout's geometry
  m.attr("linear_pack_rows") = kvforge::kPackRows;
  m.attr("linear_packing_pays") = kvforge::kPackingPays;   // whether layers should be packed
  m.def("store_kv", &kvforge::store_kv_op,
        "src (fp32) into dst (fp32 or fp8) as the decode stack writes K/V: fp8 saturated, "
        "rounded to nearest even", pybind11::arg("dst"), pybind11::arg("src"), release_gil());
  m.def("paged_decode_attention", &kvforge::paged_decode_attention,
        "decode attention over paged KV (fp32 or fp8 caches, fp32 q); window > 0: the last "
        "`window` keys of each row, and its first `sinks` keys (scored with q_sink if given)",
        pybind11::arg("q"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("scale"),
        pybind11::arg("window") = 0, pybind11::arg("sinks") = 0,
        pybind11::arg("q_sink") = pybind11::none(), release_gil());
  m.def("quest_decode", &kvforge::quest_decode,
        "QUEST sparse decode: block bounds, top-k, attention over the chosen blocks (fp32)",
        release_gil());
  m.def("quest_write", &kvforge::quest_write,
        "QUEST: write K/V and recompute written blocks' key min/max (fp32)", release_gil());
  m.def("gguf_linear", &kvforge::gguf_linear,
        "x @ W^T (+ bias) over GGUF block-quantized shards (raw uint8 rows, ggml type ids)",
        release_gil());
  m.def("gguf_dequantize", &kvforge::gguf_dequantize,
        "rows (all, or ids) of a raw GGUF tensor dequantized to fp32", release_gil());
  m.attr("gguf_dot_rows_max") = kvforge::kGgufDotRowsMax;   // integer dots up to here
  m.def("int8_dot_supported", &kvforge::int8_dot_supported,
        "whether this CPU and build have the int8 dot (0 maddubs, 1 AVX-VNNI, 2 AVX512-VNNI)");
  kvforge::bind_gguf_weight(m);
  kvforge::bind_sparse_gemv(m);
  kvforge::bind_w8a8_gemm(m);
  kvforge::bind_decode_stack(m);
  kvforge::bind_linear_plan(m);
}
