// DecodeStack: a whole Llama-family decode step (every layer + the final norm) in one call.
//
// Per layer, for n sequences with one new token each (x: [n, hidden]):
//
//   residual += x;  h = rms(residual) * ln1             (first layer: residual = x)
//   qkv = h @ Wqkv^T (+ b)        row: [ q (H*D) | k (KVH*D) | v (KVH*D) ]
//   rotate q and k in place (NeoX, cos/sin rows of the step's positions)
//   K/V planes[slot_mapping[t]] = k, v of token t       (plane: [num_blocks*B, KVH, D])
//   a = paged decode attention(q, planes, block_tables, seq_lens)
//   residual += a @ Wo^T (+ b);  h = rms(residual) * ln2
//   x = (silu(h @ Wg^T) * (h @ Wu^T)) @ Wdown^T           (gate|up fused in one weight)
//
// Gemma 3's layers (models/gemma3.py) are the same step with four additions, each optional per
// layer: RMSNorms of every q and k head before the rotation, norms of the attention and MLP
// outputs before they join the residual, gelu-tanh in place of SiLU, and a sliding window
// (keys p - W < k <= p) with its own RoPE base on the local layers:
//
//   q, k heads = rms(head) * q_norm / k_norm        then rotate with this layer's cos/sin
//   a = attention over all keys, or the last W       residual += rms(a @ Wo^T) * post_attn
//   h = rms(residual) * ln2 ... x = rms(mlp(h)) * post_ffn                (the next layer adds x)
//
// (Gemma's norms scale by 1 + w: the caller passes that sum as the weight.)
//
// Windowed layers (set_windows; Gemma 3's local ones through extras): a native sliding window,
// or StreamingLLM's sinks + window with in-cache positions (attention/window.py), each layer its
// own (window, sinks), one attention plan per distinct pair: the window's keys are scored
// with q rotated at the row's position p, the sinks' with q rotated at c(p) = min(p, S + W - 1)
// (the same q before rotation, so every distance stays below S + W):
//
//   q_sink = rotate(q before rotation, sink rows[min(p, S + W - 1)])    q = rotate(q, rows[p])
//   a = attention over keys [0, S) with q_sink and (p - W, p] with q, one softmax
// Weights are the model's own tensors (no copies). Packed fp32 weights (layers/linear.py's
// PackedLinearMethod) run linear_packed at any rows; row-major ones linear_rows (register
// tiles) for kLinearRowsMin..kLinearRowsMax rows, MKL beyond like the Python path; a quantized
// projection is called back as its Python module (its own int8/int4 kernel), and everything
// between the projections still runs here.
#include "kernels.h"

#include <memory>

namespace kvforge {
namespace {

// A projection: an fp32 weight [out, in] (+ optional bias) run by our kernels / MKL, a packed
// fp32 weight (a tuple (packed [ceil(out / 8), in / L, 8, L], out); linear.cpp's layout), GGUF
// blocks (a GgufWeight: gguf_weight.cpp), or any Python callable x -> y (a quantized Linear
// module: int8 / int4 kernels of its own).
struct Projection {
  at::Tensor weight, bias;
  at::Tensor packed;
  int64_t packed_out = 0;
  const GgufWeight* gguf = nullptr;
  pybind11::object module, owner;    // owner keeps the GgufWeight alive

  static Projection from(const pybind11::object& obj, const pybind11::object& bias) {
    Projection p;
    if (pybind11::isinstance<pybind11::tuple>(obj)) {
      auto t = obj.cast<pybind11::tuple>();
      TORCH_CHECK(t.size() == 2, "a packed projection is (packed weight, out_features)");
      p.packed = t[0].cast<at::Tensor>();
      p.packed_out = t[1].cast<int64_t>();
      TORCH_CHECK(p.packed.dim() == 4, "packed weight must be 4-D");
      check_packed_weight(p.packed, p.packed.size(1) * kPackLanes, p.packed_out);
    } else if (pybind11::isinstance<GgufWeight>(obj)) {
      p.gguf = obj.cast<const GgufWeight*>();
      p.owner = obj;
    } else if (THPVariable_Check(obj.ptr())) {
      p.weight = obj.cast<at::Tensor>();
      check_fp32_cpu(p.weight, "weight");
      TORCH_CHECK(p.weight.dim() == 2 && p.weight.is_contiguous(), "weights must be contiguous 2-D");
    } else {
      TORCH_CHECK(PyCallable_Check(obj.ptr()),
                  "a projection is an fp32 weight, a GgufWeight or a callable");
      p.module = obj;
      return p;
    }
    p.set_bias(bias);
    return p;
  }

  void set_bias(const pybind11::object& b) {
    if (b.is_none()) return;
    at::Tensor t = b.cast<at::Tensor>();
    if (t.numel() == 0) return;             // an empty tensor: no bias
    check_fp32_cpu(t, "bias");
    TORCH_CHECK(t.is_contiguous() && t.numel() == out_features(), "bias has ", t.numel(),
                " entries for ", out_features(), " outputs");
    bias = t;
  }

  // our own kernel at `rows` rows, so a team can run it
  bool team_runnable(int64_t rows) const {
    return packed.defined() || (gguf != nullptr && rows <= kGgufDotRowsMax) ||
           (weight.defined() && rows >= kLinearRowsMin && rows <= kLinearRowsMax);
  }
  // this thread's part of y [rows, out] = x @ W^T + b
  void run(const float* x, int64_t xs, float* y, int64_t rows, const Team& team,
           ShareClaim* claims) const {
    const float* b = bias.defined() ? bias.data_ptr<float>() : nullptr;
    if (gguf != nullptr)
      return gguf->run(x, xs, b, y, out_features(), rows, team, claims);
    linear_team(x, xs, packed.defined() ? packed.data_ptr<float>() : weight.data_ptr<float>(),
                packed.defined(), b, y, rows, in_features(), out_features(), team, claims);
  }

  int64_t in_features() const {
    if (gguf != nullptr) return gguf->in_features();
    return packed.defined() ? packed.size(1) * kPackLanes : weight.size(1);
  }
  int64_t out_features() const {
    if (gguf != nullptr) return gguf->out_features();
    return packed.defined() ? packed_out : weight.size(0);
  }
  bool is_module() const { return module.ptr() != nullptr; }
  // whether a row-major weight runs our kernel at `rows` rows outside a team: the tuned
  // choice for its shape (kernels/tune.py), else kLinearRowsMin..kLinearRowsMax
  bool kernel_rows(int64_t rows) const {
    const LinearPlan tuned = tuned_linear_plan(in_features(), out_features(), rows);
    if (tuned.tile_m > 0 || tuned.use_mkl) return !tuned.use_mkl;
    return rows >= kLinearRowsMin && rows <= kLinearRowsMax;
  }

  // row `row` of the weight in fp32 (a token embedding)
  void weight_row(int64_t row, float* out) const {
    const int64_t k = in_features();
    if (gguf != nullptr)
      gguf->dequantize_row(row, out);
    else if (packed.defined())
      packed_row(packed.data_ptr<float>(), k, row, out);
    else
      std::copy(weight.data_ptr<float>() + row * k, weight.data_ptr<float>() + (row + 1) * k,
                out);
  }

  at::Tensor operator()(const at::Tensor& x) const {
    if (module) {       // forward() runs without the GIL (see bindings): take it for Python
      pybind11::gil_scoped_acquire gil;
      return module(x).cast<at::Tensor>().reshape({x.size(0), -1});
    }
    if (gguf != nullptr)
      return gguf->linear(x, bias.defined() ? c10::optional<at::Tensor>(bias) : c10::nullopt,
                          false);
    // the same choices as layers/linear.py: our kernels up to kLinearRowsMax rows, x @ W^T
    // (MKL's packed GEMM) for longer query runs
    at::Tensor y;
    const int64_t rows = x.size(0);
    TORCH_CHECK(x.size(1) == in_features() && x.stride(1) == 1, "projection input width");
    if (packed.defined()) {   // any rows (past kLinearRowsMax: within ~10% of MKL's GEMM)
      y = at::empty({rows, packed_out}, x.options());
      linear_packed(x.data_ptr<float>(), x.stride(0), packed.data_ptr<float>(), y.data_ptr<float>(),
                    rows, x.size(1), packed_out);
    } else if (kernel_rows(rows)) {
      y = at::empty({rows, weight.size(0)}, x.options());
      linear_rows(x.data_ptr<float>(), x.stride(0), weight.data_ptr<float>(), y.data_ptr<float>(),
                  rows, x.size(1), weight.size(0));
    } else {
      y = at::linear(x, weight);
    }
    if (bias.defined()) y.add_(bias);
    return y;
  }
};

struct LayerWeights {
  at::Tensor ln1, ln2;
  Projection qkv, o, gate_up, down;
  // Gemma 3 (undefined / 0 for Llama): q and k head norms [head_dim], output norms [hidden],
  // the attention window (0: every key) and which cos/sin the layer rotates with
  at::Tensor q_norm, k_norm, post_attn, post_ffn;
  int64_t window = 0;
  int rope = 0;
  int64_t sinks = 0;              // StreamingLLM sinks beside the window (set_windows)
  int plan = 0;                   // its step's attention plan: 0 every key, 1 + its window kind
  bool quest_sparse = false;      // QUEST selects this layer's blocks (set_quest)
};

// The MLP's gate activation.
enum class Activation : int64_t { kSilu = 0, kGeluTanh = 1 };

// A layer's activation-sparse twins (sparse_gemv.cpp), used for steps of <= sparse_rows_max_
// rows: TEAL gives any of the four projections one, CATS the MLP as a whole; nullptr: dense.
struct SparseLayer {
  const SparseProjection *qkv = nullptr, *o = nullptr, *gate_up = nullptr, *down = nullptr;
  const CatsMlp* cats = nullptr;
};

}  // namespace

class DecodeStack {
 public:
  // extras: empty (Llama) or per layer [q_norm, k_norm, post_attn_norm, post_ffn_norm, window,
  // rope] (Gemma 3: norms as tensors, window 0 or W, rope 0 or 1: which of forward's two
  // cos/sin the layer takes); activation 0 = SiLU, 1 = gelu-tanh
  DecodeStack(std::vector<std::vector<pybind11::object>> layers, at::Tensor final_norm,
              double eps, int64_t heads, int64_t kv_heads, int64_t head_dim, double scale,
              int64_t activation, std::vector<std::vector<pybind11::object>> extras)
      : final_norm_(std::move(final_norm)), eps_(static_cast<float>(eps)), heads_(heads),
        kv_heads_(kv_heads), head_dim_(head_dim), scale_(static_cast<float>(scale)) {
    TORCH_CHECK(heads % kv_heads == 0 && head_dim % 2 == 0, "bad head configuration");
    TORCH_CHECK(activation == 0 || activation == 1, "activation must be 0 (SiLU) or 1 "
                "(gelu-tanh), got ", activation);
    activation_ = static_cast<Activation>(activation);
    TORCH_CHECK(extras.empty() || extras.size() == layers.size(),
                "extras: none, or one entry per layer");
    check_fp32_cpu(final_norm_, "final_norm");
    hidden_ = final_norm_.numel();
    const int64_t qkv_out = (heads + 2 * kv_heads) * head_dim;
    for (auto& t : layers) {
      TORCH_CHECK(t.size() == 8, "each layer: ln1, qkv, qkv_bias, o, o_bias, ln2, gate_up, down");
      const pybind11::object none_bias = pybind11::none();
      LayerWeights w{t[0].cast<at::Tensor>(), t[5].cast<at::Tensor>(),
                     Projection::from(t[1], t[2]), Projection::from(t[3], t[4]),
                     Projection::from(t[6], none_bias), Projection::from(t[7], none_bias)};
      for (const at::Tensor* p : {&w.ln1, &w.ln2}) {
        check_fp32_cpu(*p, "norm weight");
        TORCH_CHECK(p->is_contiguous() && p->numel() == hidden_, "norm weight size");
      }
      TORCH_CHECK(w.qkv.is_module() ||
                      (w.qkv.out_features() == qkv_out && w.qkv.in_features() == hidden_),
                  "qkv weight shape");
      TORCH_CHECK(w.o.is_module() ||
                      (w.o.out_features() == hidden_ && w.o.in_features() == heads * head_dim),
                  "o weight shape");
      TORCH_CHECK(w.gate_up.is_module() || w.gate_up.in_features() == hidden_, "gate_up shape");
      TORCH_CHECK(w.down.is_module() || w.down.out_features() == hidden_, "down shape");
      TORCH_CHECK(w.gate_up.is_module() || w.down.is_module() ||
                      w.gate_up.out_features() == 2 * w.down.in_features(),
                  "gate_up must be [gate | up] of down's input width");
      if (!extras.empty()) set_extras(w, extras[layers_.size()]);
      layers_.push_back(std::move(w));
    }
    index_windows();
  }

  // the widest window of the windowed layers (0: none)
  int64_t window() const { return max_window_; }
  bool quest() const { return quest_; }

  // QUEST (attention/quest.py): every layer's cache is QUEST's head-major layout with its key
  // bounds ([2, num_blocks, KVH * (B + 1), D], fp32; quest.cpp has the map); the stack writes
  // K/V and the written blocks' bounds there, and a layer in `sparse_layers` attends over its
  // top token_budget / B blocks (QuestDecodePlan) in a step whose longest row is past
  // token_budget -- the rule of QuestAttentionBackend.forward, whose kernels these are. Steps
  // of one query token per sequence only (a verification row's keys would be chosen for it
  // alone, where the Python backend attends densely; kernels/decode_stack.py keeps those off).
  void set_quest(std::vector<bool> sparse_layers, int64_t token_budget) {
    TORCH_CHECK(sparse_layers.size() == layers_.size(), "set_quest: one flag per layer, got ",
                sparse_layers.size(), " for ", layers_.size(), " layers");
    TORCH_CHECK(token_budget >= 1, "token_budget must be >= 1, got ", token_budget);
    for (size_t l = 0; l < layers_.size(); ++l) layers_[l].quest_sparse = sparse_layers[l];
    quest_ = true;
    quest_budget_ = token_budget;
  }

  // The layers' attention windows (attention/window.py): per layer its window (0: every key)
  // and its StreamingLLM sinks (0: none; only beside a window). The layers with sinks share one
  // (window, sinks); sink_rope [sinks + window, 2, head_dim] (cos, sin of positions 0 .. S + W
  // - 1, in the rotation those layers use) when their sinks are scored at in-cache positions,
  // none when at true ones.
  void set_windows(std::vector<int64_t> windows, std::vector<int64_t> sinks,
                   c10::optional<at::Tensor> sink_rope) {
    TORCH_CHECK(windows.size() == layers_.size() && sinks.size() == layers_.size(),
                "set_windows: one window and one sinks count per layer");
    int64_t sink_window = 0, sink_count = 0;
    for (size_t l = 0; l < windows.size(); ++l) {
      TORCH_CHECK(windows[l] >= 0 && sinks[l] >= 0 && (sinks[l] == 0 || windows[l] > 0),
                  "layer ", l, ": window ", windows[l], ", sinks ", sinks[l],
                  " (both >= 0, sinks only beside a window)");
      if (sinks[l] == 0) continue;
      TORCH_CHECK(sink_count == 0 || (sinks[l] == sink_count && windows[l] == sink_window),
                  "the layers with sinks must share one window and sinks count");
      sink_count = sinks[l], sink_window = windows[l];
    }
    const bool shifted = sink_rope.has_value() && sink_rope->defined();
    if (shifted) {
      check_fp32_cpu(*sink_rope, "sink_rope");
      TORCH_CHECK(sink_count > 0 && sink_rope->dim() == 3 &&
                      sink_rope->size(0) == sink_count + sink_window &&
                      sink_rope->size(1) == 2 && sink_rope->size(2) == head_dim_ &&
                      sink_rope->is_contiguous(),
                  "sink_rope must be [sinks + window, 2, head_dim] (and some layer has sinks)");
    }
    for (size_t l = 0; l < layers_.size(); ++l) {
      layers_[l].window = windows[l];
      layers_[l].sinks = sinks[l];
    }
    sink_rope_ = shifted ? *sink_rope : at::Tensor();
    index_windows();
  }

  // hidden [n, hidden] (token embeddings) -> final-normed hidden [n, hidden]
  // cos_local / sin_local: the second RoPE's rows (Gemma's local layers), when layers use it
  at::Tensor forward(at::Tensor hidden, std::vector<at::Tensor> kv_caches, at::Tensor slot_mapping,
                     at::Tensor block_tables, at::Tensor seq_lens, at::Tensor cos, at::Tensor sin,
                     c10::optional<at::Tensor> cos_local, c10::optional<at::Tensor> sin_local) {
    const int64_t n = hidden.size(0);
    check_fp32_cpu(hidden, "hidden");
    TORCH_CHECK(hidden.dim() == 2 && hidden.size(1) == hidden_ && hidden.is_contiguous(), "hidden");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one kv cache per layer");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                    slot_mapping.numel() == n, "slot_mapping must be int64 [n]");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                    block_tables.stride(1) == 1 && block_tables.size(0) == n &&
                    seq_lens.scalar_type() == at::kLong && seq_lens.is_contiguous() &&
                    seq_lens.numel() == n, "block_tables [n, m] / seq_lens [n] int64");
    TORCH_CHECK(cos.dim() == 2 && sin.dim() == 2 && cos.size(0) == n && sin.size(0) == n &&
                    cos.size(1) == head_dim_ && sin.size(1) == head_dim_ && cos.stride(1) == 1 &&
                    sin.stride(1) == 1, "cos/sin must be [n, head_dim]");
    check_fp32_cpu(cos, "cos");
    check_fp32_cpu(sin, "sin");
    const bool two_ropes = cos_local.has_value() && cos_local->defined();
    TORCH_CHECK(two_ropes == (sin_local.has_value() && sin_local->defined()),
                "cos_local and sin_local go together");
    TORCH_CHECK(two_ropes || ropes_ == 1, "the layers rotate with two RoPEs: pass cos_local / "
                "sin_local");
    if (two_ropes) {
      check_fp32_cpu(*cos_local, "cos_local");
      check_fp32_cpu(*sin_local, "sin_local");
      TORCH_CHECK(cos_local->sizes() == cos.sizes() && sin_local->sizes() == sin.sizes() &&
                      cos_local->stride(1) == 1 && sin_local->stride(1) == 1,
                  "cos_local / sin_local must be [n, head_dim] like cos / sin");
    }
    const auto [num_slots, block_size, format] = check_caches(kv_caches);
    // bounds, once per step: every slot and every attended block must exist
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t* lens = seq_lens.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t table_stride = block_tables.stride(0);
    for (int64_t t = 0; t < n; ++t)
      check_row(slots[t], lens[t], tables + t * table_stride, block_tables.size(1), num_slots,
                block_size);

    const Rope global{cos.data_ptr<float>(), cos.stride(0), sin.data_ptr<float>(), sin.stride(0)};
    const Rope local = two_ropes ? Rope{cos_local->data_ptr<float>(), cos_local->stride(0),
                                        sin_local->data_ptr<float>(), sin_local->stride(0)}
                                 : global;
    const auto quest = quest_plan(lens, n, tables, table_stride, num_slots, block_size);
    std::vector<float> sink_rows;
    const Rope sink = sink_rows_of(lens, n, sink_rows);
    const Step step{kv_caches, slots, tables, table_stride, lens, {global, local}, num_slots,
                    block_size, n, format, quest.get(), sink};
    return team_runs_all(n) ? forward_team(hidden, step) : forward_ops(hidden, step);
  }

  // Whether generate() can run n rows: every projection is one of our fp32 kernels.
  bool can_generate(int64_t n) const { return team_runs_all(n); }

  // Activation sparsity for steps of up to rows_max rows (kvforge/sparsity/): per layer
  // [qkv, o, gate_up, down, cats], each a SparseProjection / CatsMlp or None; an empty list
  // (or rows_max 0) turns it off. The objects are kept alive here.
  void set_sparsity(pybind11::list layers, int64_t rows_max) {
    TORCH_CHECK(rows_max >= 0 && rows_max <= kSparseRowsMax, "sparse rows_max must be in [0, ",
                kSparseRowsMax, "], got ", rows_max);
    std::vector<SparseLayer> parsed;
    if (layers.size() > 0) {
      TORCH_CHECK(layers.size() == layers_.size(), "one sparsity entry per layer");
      for (size_t l = 0; l < layers_.size(); ++l) {
        auto t = layers[l].cast<pybind11::list>();
        TORCH_CHECK(t.size() == 5, "each layer: qkv, o, gate_up, down, cats");
        auto proj = [&](int i, const Projection& dense) -> const SparseProjection* {
          if (t[i].is_none()) return nullptr;
          const auto* p = t[i].cast<const SparseProjection*>();
          TORCH_CHECK(dense.is_module() || (p->in_features() == dense.in_features() &&
                                            p->out_features() == dense.out_features()),
                      "sparse projection shape differs from layer ", l, "'s weight");
          return p;
        };
        const LayerWeights& w = layers_[l];
        SparseLayer s{proj(0, w.qkv), proj(1, w.o), proj(2, w.gate_up), proj(3, w.down)};
        if (!t[4].is_none()) {
          s.cats = t[4].cast<const CatsMlp*>();
          TORCH_CHECK(s.cats->hidden() == hidden_, "CATS MLP width differs from layer ", l, "'s");
        }
        parsed.push_back(s);
      }
    }
    sparse_ = std::move(parsed);
    sparse_keep_ = layers;
    sparse_rows_max_ = sparse_.empty() ? 0 : rows_max;
  }

  // `steps` greedy decode steps of n sequences in one call (multi-step decoding: the engine's
  // Python runs once per call, not once per token). Sequence t starts with token ids[t] at
  // position positions[t]; its block table already holds slots up to positions[t] + steps - 1.
  // Each step embeds the rows' tokens, runs every layer (team_layers), the final norm, the LM
  // head and an argmax; the argmax is the next step's token:
  //
  //   step s:   ids --embed--> x --layers--> norm --head--> logits --argmax--> out[:, s] = ids
  //             K/V of position positions[t] + s written, attention over positions[t] + s + 1 keys
  //
  // The argmax is torch.argmax's (argmax_row), and the logits are the same kernel's as the
  // one-step path's, so the tokens equal `steps` one-step greedy samples. One team region for
  // all steps (no fork/join between them); the head's columns are claimed like any projection
  // and each thread argmaxes an even part of the vocabulary; the parts combine in column order.
  //
  // embedding, head: [vocab, hidden] weights as projections take them (an fp32 tensor, a
  // packed tuple, a GgufWeight; a tied model passes the same one twice); cos_sin: rotary table
  // [positions, 2, head_dim] whose row i is position position_base + i (cos_sin_local: the
  // second RoPE's, the same rows); embed_scale multiplies the embedded rows (Gemma: sqrt of
  // the width). Called with the GIL held: it reads the Python objects, then releases the GIL
  // for the steps.
  //
  // stop (optional int32 [1], another thread may set it while the call runs): read after
  // each step but the last; nonzero ends the call there, so a request arriving mid-call waits
  // one step instead of the rest of the call. Returns [n, steps run]; the slots of the steps
  // not run stay unwritten (the engine gives them back like any unused lookahead slot).
  at::Tensor generate(at::Tensor ids, at::Tensor positions, int64_t steps,
                      std::vector<at::Tensor> kv_caches, at::Tensor block_tables,
                      at::Tensor cos_sin, pybind11::object embedding, pybind11::object head,
                      int64_t vocab, c10::optional<at::Tensor> stop,
                      c10::optional<at::Tensor> cos_sin_local, int64_t position_base,
                      double embed_scale) {
    const pybind11::object no_bias = pybind11::none();
    const Projection table = Projection::from(embedding, no_bias);
    const Projection lm_head = Projection::from(head, no_bias);
    // declared after the projections: the GIL is back before their Python references drop
    pybind11::gil_scoped_release release;
    const int64_t n = ids.numel();
    TORCH_CHECK(steps >= 1, "steps must be >= 1, got ", steps);
    TORCH_CHECK(n >= 1 && ids.scalar_type() == at::kLong && ids.dim() == 1 && ids.is_contiguous() &&
                    positions.scalar_type() == at::kLong && positions.is_contiguous() &&
                    positions.numel() == n, "ids / positions must be int64 [n]");
    TORCH_CHECK(team_runs_all(n), "generate needs projections our kernels run at ", n, " rows");
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one kv cache per layer");
    TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 &&
                    block_tables.stride(1) == 1 && block_tables.size(0) == n,
                "block_tables must be int64 [n, m]");
    check_fp32_cpu(cos_sin, "cos_sin table");
    TORCH_CHECK(cos_sin.dim() == 3 && cos_sin.size(1) == 2 && cos_sin.size(2) == head_dim_ &&
                    cos_sin.is_contiguous(), "cos_sin table must be [positions, 2, head_dim]");
    std::vector<const at::Tensor*> rope_tables{&cos_sin};
    if (cos_sin_local.has_value() && cos_sin_local->defined()) {
      check_fp32_cpu(*cos_sin_local, "cos_sin_local table");
      TORCH_CHECK(cos_sin_local->sizes() == cos_sin.sizes() && cos_sin_local->is_contiguous(),
                  "cos_sin_local must be shaped like cos_sin");
      rope_tables.push_back(&*cos_sin_local);
    }
    TORCH_CHECK(static_cast<int64_t>(rope_tables.size()) >= ropes_,
                "the layers rotate with two RoPEs: pass cos_sin_local");
    TORCH_CHECK(position_base >= 0, "position_base must be >= 0, got ", position_base);
    const float scale_rows = static_cast<float>(embed_scale);
    for (const Projection* p : {&table, &lm_head})
      TORCH_CHECK(!p->is_module() && p->in_features() == hidden_ && p->out_features() == vocab,
                  "embedding and head must be [vocab = ", vocab, ", hidden = ", hidden_,
                  "] weights our kernels read");
    TORCH_CHECK(lm_head.team_runnable(n), "the LM head cannot run ", n, " rows in a team");
    const int32_t* stop_flag = nullptr;
    if (stop.has_value() && stop->defined()) {
      TORCH_CHECK(stop->device().is_cpu() && stop->scalar_type() == at::kInt &&
                      stop->numel() == 1, "stop must be an int32 [1] CPU tensor");
      stop_flag = stop->data_ptr<int32_t>();
    }
    const auto [num_slots, block_size, format] = check_caches(kv_caches);
    const int64_t* id0 = ids.data_ptr<int64_t>();
    const int64_t* pos0 = positions.data_ptr<int64_t>();
    const int64_t* tables = block_tables.data_ptr<int64_t>();
    const int64_t table_stride = block_tables.stride(0);
    // every step's slots, lengths and rotary rows, checked before anything runs
    std::vector<int64_t> slots(steps * n), lens(steps * n);
    for (int64_t t = 0; t < n; ++t) {
      TORCH_CHECK(id0[t] >= 0 && id0[t] < vocab, "token id ", id0[t], " out of range");
      TORCH_CHECK(pos0[t] >= position_base && pos0[t] + steps - position_base <= cos_sin.size(0),
                  "positions ", pos0[t], "..", pos0[t] + steps - 1, " outside the rotary table (",
                  position_base, "..", position_base + cos_sin.size(0) - 1, ")");
      for (int64_t s = 0; s < steps; ++s) {
        const int64_t pos = pos0[t] + s;
        const int64_t b = pos / block_size;
        TORCH_CHECK(b < block_tables.size(1), "block table too short for position ", pos);
        slots[s * n + t] = tables[t * table_stride + b] * block_size + pos % block_size;
        lens[s * n + t] = pos + 1;
        check_row(slots[s * n + t], lens[s * n + t], tables + t * table_stride,
                  block_tables.size(1), num_slots, block_size);
      }
    }
    const auto opts = cos_sin.options();
    const int64_t inter = widest_mlp();
    SharedBuffers sh(n, hidden_, (heads_ + 2 * kv_heads_) * head_dim_, heads_ * head_dim_, inter,
                     opts, sink_rope_.defined());
    at::Tensor logits = at::empty({n, vocab}, opts), out = at::empty({n, steps}, ids.options());
    // per table: cos, sin [steps, n, head_dim] gathered from the table's rows
    std::vector<at::Tensor> cos, sin;
    for (const at::Tensor* table : rope_tables) {
      cos.push_back(at::empty({steps, n, head_dim_}, opts));
      sin.push_back(at::empty({steps, n, head_dim_}, opts));
      for (int64_t s = 0; s < steps; ++s)
        for (int64_t t = 0; t < n; ++t) {
          const float* row =
              table->data_ptr<float>() + (pos0[t] + s - position_base) * 2 * head_dim_;
          std::copy(row, row + head_dim_, cos.back().data_ptr<float>() + (s * n + t) * head_dim_);
          std::copy(row + head_dim_, row + 2 * head_dim_,
                    sin.back().data_ptr<float>() + (s * n + t) * head_dim_);
        }
    }
    auto rope_at = [&](size_t table, int64_t s) {
      const size_t i = std::min(table, cos.size() - 1);
      return Rope{cos[i].data_ptr<float>() + s * n * head_dim_, head_dim_,
                  sin[i].data_ptr<float>() + s * n * head_dim_, head_dim_};
    };
    const int threads = at::get_num_threads();
    TORCH_CHECK(vocab >= threads, "vocab ", vocab, " smaller than the team");   // argmax parts
    // per step: the plan over every key, and over the window's keys (windowed layers)
    std::vector<std::vector<DecodeAttentionPlan>> plans;              // per step
    std::vector<std::unique_ptr<QuestDecodePlan>> quest_plans;     // null: dense this step
    std::vector<std::vector<float>> sink_rows(steps);               // per step [cos | sin]
    std::vector<Rope> sinks_at;
    for (int64_t s = 0; s < steps; ++s)
      sinks_at.push_back(sink_rows_of(lens.data() + s * n, n, sink_rows[s]));
    plans.reserve(steps);
    for (int64_t s = 0; s < steps; ++s) {
      quest_plans.push_back(quest_plan(lens.data() + s * n, n, tables, table_stride, num_slots,
                                       block_size));
      plans.push_back(step_plans(lens.data() + s * n, n, threads));
    }
    // per step: the layers' claims, then the head's
    const int64_t step_claims = (layers_.size() * kWorks + 1) * threads;
    std::vector<ShareClaim> claims(steps * step_claims);
    // each thread's argmax over its part of the vocabulary, per row: [thread][row]
    std::vector<int64_t> part_best(threads * n);
    float* logits_p = logits.data_ptr<float>();
    int64_t* out_p = out.data_ptr<int64_t>();
    // steps run; rank 0 reads the flag once a step and every thread follows that one reading
    // (threads reading it themselves could disagree and wait at different barriers)
    int64_t steps_run = steps;
    run_team([&](const Team& team) {
      PrivateBuffers pv(n, hidden_, inter);
      std::vector<float> x(n * hidden_), normed(n * hidden_);
      std::vector<int64_t> tokens(id0, id0 + n);
      const int64_t v0 = Team::split(vocab, team.rank(), team.size()),
                    v1 = Team::split(vocab, team.rank() + 1, team.size());
      for (int64_t s = 0; s < steps; ++s) {
        for (int64_t t = 0; t < n; ++t) {           // every thread embeds every row
          float* row = x.data() + t * hidden_;
          table.weight_row(tokens[t], row);
          if (scale_rows != 1.f)
            for (int64_t c = 0; c < hidden_; ++c) row[c] *= scale_rows;
        }
        const Step st{kv_caches, slots.data() + s * n, tables, table_stride,
                      lens.data() + s * n, {rope_at(0, s), rope_at(1, s)}, num_slots,
                      block_size, n, format, quest_plans[s].get(), sinks_at[s]};
        ShareClaim* claim = claims.data() + s * step_claims;
        const float* last = team_layers(team, st, x.data(), plans[s], claim, sh, pv);
        add_rms_norm_rows(last, hidden_, pv.residual.data(), hidden_,
                          final_norm_.data_ptr<float>(), normed.data(), pv.residual.data(), n,
                          hidden_, eps_);
        lm_head.run(normed.data(), hidden_, logits_p, n, team,
                    claim + layers_.size() * kWorks * threads);
        team.barrier();
        for (int64_t t = 0; t < n; ++t)
          part_best[team.rank() * n + t] =
              v0 + argmax_row(logits_p + t * vocab + v0, v1 - v0);
        team.barrier();
        for (int64_t t = 0; t < n; ++t) {   // the parts in column order: torch.argmax's choice
          int64_t best = part_best[t];
          for (int r = 1; r < team.size() && logits_p[t * vocab + best] ==
                                                 logits_p[t * vocab + best]; ++r) {
            const int64_t i = part_best[r * n + t];
            const float v = logits_p[t * vocab + i];
            if (v != v || v > logits_p[t * vocab + best]) best = i;   // first NaN, first max
          }
          tokens[t] = best;
        }
        if (team.rank() == 0) {
          for (int64_t t = 0; t < n; ++t) out_p[t * steps + s] = tokens[t];
          if (stop_flag != nullptr && s + 1 < steps &&
              __atomic_load_n(stop_flag, __ATOMIC_RELAXED) != 0)
            steps_run = s + 1;
        }
        // the parts are read before the next step's head overwrites them; steps_run is
        // written before it and read after it (rank 0 writes again only a step later, past
        // barriers every thread must reach first)
        team.barrier();
        if (steps_run == s + 1) break;
      }
    });
    return steps_run == steps ? out : out.narrow(1, 0, steps_run);
  }

 private:
  struct Rope {              // one RoPE's rows of a step: cos, sin [n, head_dim]
    const float* cos;
    int64_t cos_stride;
    const float* sin;
    int64_t sin_stride;
  };
  struct Step {              // one step's inputs besides the embedded rows, checked
    const std::vector<at::Tensor>& kv_caches;
    const int64_t *slots, *tables;
    int64_t table_stride;
    const int64_t* lens;
    Rope rope[2];                  // a layer's LayerWeights::rope picks one
    int64_t num_slots, block_size;
    int64_t n;                     // rows (sequences) this step
    KVFormat format;               // the caches' K/V elements
    QuestDecodePlan* quest;        // QUEST's selection this step (sparse layers), or null
    Rope sink;                     // the sinks' query rows (cos null: no shifted sinks)
  };

  // The rows the sinks' queries rotate with, position min(p, S + W - 1) of sink_rope_ for each
  // row (p = len - 1), into `buffer` as [n cos rows | n sin rows] (the Rope points into it);
  // no shifted sinks: nulls.
  Rope sink_rows_of(const int64_t* lens, int64_t n, std::vector<float>& buffer) const {
    if (!sink_rope_.defined()) return Rope{nullptr, 0, nullptr, 0};
    const int64_t d = head_dim_, last = sink_rope_.size(0) - 1;
    buffer.resize(2 * n * d);
    const float* table = sink_rope_.data_ptr<float>();
    for (int64_t t = 0; t < n; ++t) {
      const float* row = table + std::min(lens[t] - 1, last) * 2 * d;
      std::copy(row, row + d, buffer.data() + t * d);
      std::copy(row + d, row + 2 * d, buffer.data() + (n + t) * d);
    }
    return Rope{buffer.data(), d, buffer.data() + n * d, d};
  }

  // The step's QUEST plan when its longest row is past the budget (quest_), else null.
  std::unique_ptr<QuestDecodePlan> quest_plan(const int64_t* lens, int64_t n,
                                              const int64_t* tables, int64_t table_stride,
                                              int64_t num_slots, int64_t block_size) const {
    if (!quest_ || n == 0 || *std::max_element(lens, lens + n) <= quest_budget_) return nullptr;
    return std::make_unique<QuestDecodePlan>(
        lens, n, tables, table_stride, heads_, kv_heads_, head_dim_, block_size,
        num_slots / block_size, std::max<int64_t>(1, quest_budget_ / block_size));
  }

  // One layer's K and V planes as the attention kernels read them: the token-major paged
  // layout [2, num_blocks, B, KVH, D] (attention.cpp), or QUEST's head-major one (quest.cpp)
  std::pair<PagedKV, PagedKV> kv_planes(char* cache, const Step& st) const {
    if (quest_) {
      const QuestLayout q(st.num_slots / st.block_size, kv_heads_, st.block_size, head_dim_);
      const float* f = reinterpret_cast<const float*>(cache);
      return {PagedKV{f, q.block_stride, head_dim_, q.head_stride, st.block_size, head_dim_},
              PagedKV{f + q.plane, q.block_stride, head_dim_, q.head_stride, st.block_size,
                      head_dim_}};
    }
    const int64_t kv_row = kv_heads_ * head_dim_, plane = st.num_slots * kv_row;
    return {PagedKV{cache, st.block_size * kv_row, kv_row, head_dim_, st.block_size, head_dim_,
                    st.format},
            PagedKV{cache + plane * kv_element_bytes(st.format), st.block_size * kv_row, kv_row,
                    head_dim_, st.block_size, head_dim_, st.format}};
  }

  // Row t's K/V of KV heads [h0, h1) into its slot (k: head h0's K; its V heads kv_row floats
  // on); QUEST: then the slot's block bounds of those heads over slots 0 .. this one
  void store_row(char* cache, const Step& st, int64_t t, const float* k, int64_t h0,
                 int64_t h1) const {
    const int64_t kv_row = kv_heads_ * head_dim_;
    if (quest_) {
      float* f = reinterpret_cast<float*>(cache);
      const QuestLayout q(st.num_slots / st.block_size, kv_heads_, st.block_size, head_dim_);
      const int64_t b = st.slots[t] / st.block_size, off = st.slots[t] % st.block_size;
      quest_store_heads(f, q, head_dim_, b, off, k, k + kv_row, h0, h1);
      for (int64_t h = h0; h < h1; ++h) quest_block_bounds(f, q, head_dim_, b, h, off);
      return;
    }
    const int64_t bytes = kv_element_bytes(st.format);
    const int64_t slot = st.slots[t] * kv_row + h0 * head_dim_, plane = st.num_slots * kv_row;
    store_kv(cache + slot * bytes, k, (h1 - h0) * head_dim_, st.format);
    store_kv(cache + (plane + slot) * bytes, k + kv_row, (h1 - h0) * head_dim_, st.format);
  }

  // Gemma 3's per-layer parts: [q_norm, k_norm, post_attn, post_ffn, window, rope]
  void set_extras(LayerWeights& w, const std::vector<pybind11::object>& e) {
    TORCH_CHECK(e.size() == 6, "each layer's extras: q_norm, k_norm, post_attn_norm, "
                "post_ffn_norm, window, rope");
    w.q_norm = e[0].cast<at::Tensor>();
    w.k_norm = e[1].cast<at::Tensor>();
    w.post_attn = e[2].cast<at::Tensor>();
    w.post_ffn = e[3].cast<at::Tensor>();
    for (const auto& [t, size, name] :
         {std::tuple<const at::Tensor&, int64_t, const char*>{w.q_norm, head_dim_, "q_norm"},
          {w.k_norm, head_dim_, "k_norm"}, {w.post_attn, hidden_, "post_attn_norm"},
          {w.post_ffn, hidden_, "post_ffn_norm"}}) {
      check_fp32_cpu(t, name);
      TORCH_CHECK(t.is_contiguous() && t.numel() == size, name, " must have ", size,
                  " entries, got ", t.numel());
    }
    w.window = e[4].cast<int64_t>();
    w.rope = e[5].cast<int>();
    TORCH_CHECK(w.window >= 0, "window must be >= 0, got ", w.window);
    TORCH_CHECK(w.rope == 0 || w.rope == 1, "rope must be 0 or 1, got ", w.rope);
    ropes_ = std::max(ropes_, w.rope + 1);
  }

  // The distinct (window, sinks) of the windowed layers, each layer's plan index (0: every
  // key, 1 + its kind), and what the blocks a row must have depend on.
  void index_windows() {
    window_kinds_.clear();
    max_window_ = max_sinks_ = 0;
    all_windowed_ = !layers_.empty();
    for (LayerWeights& w : layers_) {
      if (w.window == 0) {
        w.plan = 0;
        all_windowed_ = false;
        continue;
      }
      const std::pair<int64_t, int64_t> kind{w.window, w.sinks};
      auto it = std::find(window_kinds_.begin(), window_kinds_.end(), kind);
      w.plan = 1 + static_cast<int>(it - window_kinds_.begin());
      if (it == window_kinds_.end()) window_kinds_.push_back(kind);
      max_window_ = std::max(max_window_, w.window);
      max_sinks_ = std::max(max_sinks_, w.sinks);
    }
  }

  // One step's attention plans over rows `lens`: [every key, then each window kind]
  std::vector<DecodeAttentionPlan> step_plans(const int64_t* lens, int64_t n,
                                              int threads) const {
    std::vector<DecodeAttentionPlan> plans;
    plans.reserve(1 + window_kinds_.size());
    plans.emplace_back(lens, n, heads_, kv_heads_, head_dim_, threads);
    for (const auto& [window, sinks] : window_kinds_)
      plans.emplace_back(lens, n, heads_, kv_heads_, head_dim_, threads, window, sinks);
    return plans;
  }

  // RMSNorm of `count` heads (head_dim floats each, adjacent) in place: Gemma's q / k norms
  void head_norms(float* heads, int64_t count, const at::Tensor& w) const {
    add_rms_norm_rows(heads, head_dim_, nullptr, 0, w.data_ptr<float>(), heads, nullptr, count,
                      head_dim_, eps_);
  }

  void activation_rows(const float* gate_up, int64_t gs, float* out, int64_t rows,
                       int64_t width) const {
    if (activation_ == Activation::kGeluTanh)
      gelu_tanh_and_mul_rows(gate_up, gs, out, rows, width);
    else
      silu_and_mul_rows(gate_up, gs, out, rows, width);
  }

  bool team_runs_all(int64_t n) const {
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const SparseLayer* s = sparse_layer(n, l);
      const bool cats = s != nullptr && s->cats != nullptr;
      if (!(runnable(w.qkv, s ? s->qkv : nullptr, n) && runnable(w.o, s ? s->o : nullptr, n) &&
            (cats || (runnable(w.gate_up, s ? s->gate_up : nullptr, n) &&
                      runnable(w.down, s ? s->down : nullptr, n)))))
        return false;
    }
    return true;
  }
  static bool runnable(const Projection& p, const SparseProjection* sparse, int64_t n) {
    return sparse != nullptr || p.team_runnable(n);
  }
  // layer l's sparse twins when a step of n rows uses them, else nullptr
  const SparseLayer* sparse_layer(int64_t n, size_t l) const {
    return n <= sparse_rows_max_ ? &sparse_[l] : nullptr;
  }
  // one projection of a team step: the sparse twin when there is one
  static void run_projection(const Projection& p, const SparseProjection* sparse, const float* x,
                             int64_t xs, float* y, int64_t n, const Team& team,
                             ShareClaim* claims, ShareClaim* rotation_claims) {
    if (sparse != nullptr)
      sparse->run(x, xs, y, n, team, claims, rotation_claims);
    else
      p.run(x, xs, y, n, team, claims);
  }

  struct CacheGeometry {
    int64_t num_slots, block_size;
    KVFormat format;               // fp32 or fp8 K/V (quant/fp8_kv.py), one for every layer
  };
  CacheGeometry check_caches(const std::vector<at::Tensor>& kv_caches) const {
    int64_t num_slots = -1, block_size = 0;
    const KVFormat format = kv_caches.empty() ? KVFormat::kF32
                                              : kv_format_of(kv_caches[0], "kv_cache");
    for (const auto& cache : kv_caches) {
      TORCH_CHECK(kv_format_of(cache, "kv_cache") == format,
                  "every layer's kv cache must have the same dtype");
      if (quest_) {
        TORCH_CHECK(format == KVFormat::kF32 && cache.dim() == 4 && cache.size(0) == 2 &&
                        cache.size(2) % kv_heads_ == 0 && cache.size(2) / kv_heads_ >= 2 &&
                        cache.size(3) == head_dim_ && cache.is_contiguous(),
                    "QUEST kv_cache must be contiguous fp32 [2, num_blocks, kv_heads * "
                    "(block_size + 1), head_dim]");
        const int64_t block = cache.size(2) / kv_heads_ - 1;
        TORCH_CHECK(num_slots < 0 || num_slots == cache.size(1) * block,
                    "every layer's kv cache must have the same blocks");
        num_slots = cache.size(1) * block;
        block_size = block;
        continue;
      }
      TORCH_CHECK(cache.dim() == 5 && cache.size(0) == 2 && cache.size(3) == kv_heads_ &&
                      cache.size(4) == head_dim_ && cache.is_contiguous(),
                  "kv_cache must be contiguous [2, num_blocks, block_size, kv_heads, head_dim]");
      TORCH_CHECK(num_slots < 0 || num_slots == cache.size(1) * cache.size(2),
                  "every layer's kv cache must have the same blocks");
      num_slots = cache.size(1) * cache.size(2);
      block_size = cache.size(2);
    }
    return {num_slots, block_size, format};
  }

  // a row's slot and every block it attends must exist: every block of its context, or where
  // every layer is windowed, the sinks' and the window's (the engine frees the others:
  // attention/window.py, their table entries -1)
  void check_row(int64_t slot, int64_t len, const int64_t* table, int64_t table_len,
                 int64_t num_slots, int64_t block_size) const {
    TORCH_CHECK(slot >= 0 && slot < num_slots, "slot out of range");
    TORCH_CHECK(len >= 1 && len <= table_len * block_size, "seq_len");
    const int64_t sink_blocks = (max_sinks_ + block_size - 1) / block_size;
    const int64_t first_live =
        all_windowed_ ? std::max<int64_t>(0, len - max_window_) / block_size : 0;
    for (int64_t b = 0; b < (len + block_size - 1) / block_size; ++b)
      if (b < sink_blocks || b >= first_live)
        TORCH_CHECK(table[b] >= 0 && table[b] * block_size < num_slots, "block id");
  }

  // Buffers a team step writes on one thread and reads on all (forward_team, generate).
  struct SharedBuffers {
    at::Tensor qkv, attn, o, gate_up, x;
    at::Tensor q_sink;             // the sinks' queries [n, q_width] (shifted sinks only)
    SharedBuffers(int64_t n, int64_t hidden, int64_t qkv_width, int64_t q_width, int64_t inter,
                  const at::TensorOptions& opts, bool sinks = false)
        : qkv(at::empty({n, qkv_width}, opts)), attn(at::empty({n, q_width}, opts)),
          o(at::empty({n, hidden}, opts)), gate_up(at::empty({n, 2 * inter}, opts)),
          x(at::empty({n, hidden}, opts)),
          q_sink(sinks ? at::empty({n, q_width}, opts) : at::Tensor()) {}
  };
  // What each thread of a team keeps to itself: the residual stream, norm and SwiGLU outputs.
  struct PrivateBuffers {
    std::vector<float> residual, h, act, scores;
    std::vector<float> post;       // a normed attention / MLP output (Gemma's post norms)
    PrivateBuffers(int64_t n, int64_t hidden, int64_t inter)
        : residual(n * hidden), h(n * hidden), act(n * inter), post(n * hidden) {}
  };
  // per layer: claims of qkv, attention tasks, merges, o, gate_up, down, CATS' up, then the
  // rotations of sparse qkv, o, gate_up, down (a thread each), QUEST's bounds and selects
  static constexpr int kWorks = 13;
  static constexpr int kRotationWorks = 7;

  int64_t widest_mlp() const {            // Llama's MLPs are all alike; take the widest
    int64_t inter = 0;
    for (size_t l = 0; l < layers_.size(); ++l) {
      if (!layers_[l].down.is_module()) inter = std::max(inter, layers_[l].down.in_features());
      if (sparse_.empty()) continue;          // a module's width: from its sparse twin
      if (sparse_[l].down) inter = std::max(inter, sparse_[l].down->in_features());
      if (sparse_[l].cats) inter = std::max(inter, sparse_[l].cats->inter());
    }
    return inter;
  }

  // Every layer of one step on this thread of a team (the whole step in one parallel region,
  // team.h): projections and attention split between the threads, a barrier wherever a thread
  // reads what another wrote. The small row ops (norms, SwiGLU) each thread runs itself, over
  // every row into private buffers: cheaper than a barrier and a hand-off between cores.
  //
  //   residual, h = norm(residual + x)             private (every thread, same values)
  //   qkv = h @ Wqkv^T            columns shared       -> barrier
  //   rotate my q heads and my KV heads; write my KV heads to the cache    -> barrier
  //   attention tasks (sequence, heads, keys)  shared  -> barrier [merges -> barrier]
  //   o = attn @ Wo^T             columns shared       -> barrier
  //   residual, h = norm(residual + o)             private
  //   gu = h @ Wgu^T              columns shared       -> barrier
  //   act = silu(gate) * up                        private
  //   x = act @ Wdown^T           columns shared       -> barrier
  //
  // (Gemma: the head norms before the rotation on the same heads; the output norms private.)
  // Returns the last layer's output (sh.x, or this thread's pv.post after a post-MLP norm);
  // the residual stream is in pv.residual. `embedded` [n, hidden] is the first layer's input;
  // `plans`: over every key, then one per window kind (step_plans); `claims`: layers * kWorks
  // * team size.
  const float* team_layers(const Team& team, const Step& st, const float* embedded,
                           std::vector<DecodeAttentionPlan>& plans, ShareClaim* claims,
                           SharedBuffers& sh, PrivateBuffers& pv) const {
    const int64_t n = st.n;
    const int64_t q_width = heads_ * head_dim_, kv_row = kv_heads_ * head_dim_;
    const int64_t qkv_width = q_width + 2 * kv_row;
    const int threads = team.size();
    float *qkv_p = sh.qkv.data_ptr<float>(), *attn_p = sh.attn.data_ptr<float>(),
          *o_p = sh.o.data_ptr<float>(), *gu_p = sh.gate_up.data_ptr<float>(),
          *x_p = sh.x.data_ptr<float>();
    float *residual = pv.residual.data(), *h = pv.h.data(), *act = pv.act.data(),
          *post = pv.post.data();
    const float* layer_out = x_p;        // the previous layer's output
    // q heads this thread rotates, KV heads it rotates and writes
    const int64_t h0 = Team::split(heads_, team.rank(), threads),
                  h1 = Team::split(heads_, team.rank() + 1, threads);
    const int64_t k0 = Team::split(kv_heads_, team.rank(), threads),
                  k1 = Team::split(kv_heads_, team.rank() + 1, threads);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      const SparseLayer* sp = sparse_layer(n, l);
      ShareClaim* claim = claims + l * kWorks * threads;    // work i: claim + i * threads
      if (l == 0) {
        std::copy(embedded, embedded + n * hidden_, residual);
        add_rms_norm_rows(embedded, hidden_, nullptr, 0, w.ln1.data_ptr<float>(), h, nullptr, n,
                          hidden_, eps_);
      } else {
        add_rms_norm_rows(layer_out, hidden_, residual, hidden_, w.ln1.data_ptr<float>(), h,
                          residual, n, hidden_, eps_);
      }
      run_projection(w.qkv, sp ? sp->qkv : nullptr, h, hidden_, qkv_p, n, team, claim,
                     claim + kRotationWorks * threads);
      team.barrier();
      char* cache = static_cast<char*>(st.kv_caches[l].data_ptr());
      float* my_q = qkv_p + h0 * head_dim_;
      float* my_k = qkv_p + q_width + k0 * head_dim_;            // my V heads: + kv_row
      if (w.q_norm.defined())
        for (int64_t t = 0; t < n; ++t) {
          head_norms(my_q + t * qkv_width, h1 - h0, w.q_norm);
          head_norms(my_k + t * qkv_width, k1 - k0, w.k_norm);
        }
      const Rope& rope = st.rope[w.rope];
      const float *cos_p = rope.cos, *sin_p = rope.sin;
      const int64_t cs = rope.cos_stride, ss = rope.sin_stride;
      float* q_sink = w.sinks > 0 && st.sink.cos != nullptr ? sh.q_sink.data_ptr<float>()
                                                            : nullptr;
      if (q_sink != nullptr)            // from q before its rotation: the sinks' positions
        rotary_rows(my_q, qkv_width, q_sink + h0 * head_dim_, q_width, st.sink.cos,
                    st.sink.cos_stride, st.sink.sin, st.sink.sin_stride, n, h1 - h0, head_dim_);
      rotary_rows(my_q, qkv_width, my_q, qkv_width, cos_p, cs, sin_p, ss, n, h1 - h0, head_dim_);
      rotary_rows(my_k, qkv_width, my_k, qkv_width, cos_p, cs, sin_p, ss, n, k1 - k0, head_dim_);
      for (int64_t t = 0; t < n; ++t) store_row(cache, st, t, my_k + t * qkv_width, k0, k1);
      team.barrier();
      if (st.quest != nullptr && w.quest_sparse) {       // QUEST's four phases
        QuestDecodePlan& qp = *st.quest;
        const float* fc = reinterpret_cast<const float*>(cache);
        team.for_shares(qp.num_bound_tasks(), 1, claim + 11 * threads,
                        [&](int64_t t0, int64_t t1, int64_t) {
          for (int64_t t = t0; t < t1; ++t) qp.bound_task(t, qkv_p, qkv_width, head_dim_, fc);
        });
        team.barrier();
        team.for_shares(qp.num_items(), 1, claim + 12 * threads,
                        [&](int64_t i0, int64_t i1, int64_t) {
          thread_local std::vector<int64_t> order;
          for (int64_t i = i0; i < i1; ++i) qp.select(i, order);
        });
        team.barrier();
        team.for_shares(qp.num_attend_tasks(), 1, claim + 1 * threads,
                        [&](int64_t t0, int64_t t1, int64_t) {
          for (int64_t t = t0; t < t1; ++t)
            qp.attend_task(t, qkv_p, qkv_width, head_dim_, fc, scale_, pv.scores);
        });
        team.barrier();
        team.for_shares(qp.num_items(), 1, claim + 2 * threads,
                        [&](int64_t i0, int64_t i1, int64_t) {
          for (int64_t i = i0; i < i1; ++i) qp.merge(i, attn_p);
        });
      } else {
        const auto [keys, values] = kv_planes(cache, st);
        DecodeAttentionPlan& plan = plans[w.plan];
        team.for_shares(plan.num_tasks(), 1, claim + 1 * threads,
                        [&](int64_t t0, int64_t t1, int64_t) {
          for (int64_t t = t0; t < t1; ++t)
            plan.run_task(t, qkv_p, qkv_width, head_dim_, keys, values, st.tables,
                          st.table_stride, scale_, attn_p, pv.scores, q_sink, q_width);
        });
        if (plan.num_merges() > 0) {
          team.barrier();
          team.for_shares(plan.num_merges(), 1, claim + 2 * threads,
                          [&](int64_t i0, int64_t i1, int64_t) {
            for (int64_t i = i0; i < i1; ++i) plan.merge(i, attn_p);
          });
        }
      }
      team.barrier();
      run_projection(w.o, sp ? sp->o : nullptr, attn_p, q_width, o_p, n, team,
                     claim + 3 * threads, claim + (kRotationWorks + 1) * threads);
      team.barrier();
      const float* attn_out = o_p;
      if (w.post_attn.defined()) {
        add_rms_norm_rows(o_p, hidden_, nullptr, 0, w.post_attn.data_ptr<float>(), post, nullptr,
                          n, hidden_, eps_);
        attn_out = post;
      }
      add_rms_norm_rows(attn_out, hidden_, residual, hidden_, w.ln2.data_ptr<float>(), h,
                        residual, n, hidden_, eps_);
      layer_out = x_p;
      if (sp != nullptr && sp->cats != nullptr) {     // claims 4, 5, 6: gate, up, down
        sp->cats->run(h, hidden_, gu_p, x_p, n, team, claim + 4 * threads);
        team.barrier();
        continue;
      }
      run_projection(w.gate_up, sp ? sp->gate_up : nullptr, h, hidden_, gu_p, n, team,
                     claim + 4 * threads, claim + (kRotationWorks + 2) * threads);
      team.barrier();
      const int64_t width = sp && sp->down ? sp->down->in_features() : w.down.in_features();
      activation_rows(gu_p, 2 * width, act, n, width);
      run_projection(w.down, sp ? sp->down : nullptr, act, width, x_p, n, team,
                     claim + 5 * threads, claim + (kRotationWorks + 3) * threads);
      team.barrier();
      if (w.post_ffn.defined()) {
        add_rms_norm_rows(x_p, hidden_, nullptr, 0, w.post_ffn.data_ptr<float>(), post, nullptr,
                          n, hidden_, eps_);
        layer_out = post;
      }
    }
    return layer_out;
  }

  // One step as one team (team_layers), the final norm on the first thread.
  at::Tensor forward_team(const at::Tensor& hidden, const Step& st) {
    const int64_t n = st.n;
    const int64_t inter = widest_mlp();
    const auto opts = hidden.options();
    SharedBuffers sh(n, hidden_, (heads_ + 2 * kv_heads_) * head_dim_, heads_ * head_dim_, inter,
                     opts, sink_rope_.defined());
    at::Tensor out = at::empty({n, hidden_}, opts);
    const int threads = at::get_num_threads();
    std::vector<DecodeAttentionPlan> plans = step_plans(st.lens, n, threads);
    std::vector<ShareClaim> claims(layers_.size() * kWorks * threads);
    run_team([&](const Team& team) {
      PrivateBuffers pv(n, hidden_, inter);
      const float* last = team_layers(team, st, hidden.data_ptr<float>(), plans, claims.data(),
                                      sh, pv);
      if (team.rank() == 0)
        add_rms_norm_rows(last, hidden_, pv.residual.data(), hidden_,
                          final_norm_.data_ptr<float>(), out.data_ptr<float>(),
                          pv.residual.data(), n, hidden_, eps_);
    });
    return out;
  }

  // Op by op, each op parallel on its own: any projection, including quantized modules (called
  // back into Python) and row-major weights past kLinearRowsMax rows (MKL).
  at::Tensor forward_ops(const at::Tensor& hidden, const Step& st) {
    const int64_t n = hidden.size(0);
    const int64_t q_width = heads_ * head_dim_, kv_row = kv_heads_ * head_dim_;
    const int64_t* tables = st.tables;
    const int64_t table_stride = st.table_stride;
    const int64_t* lens = st.lens;
    const std::vector<at::Tensor>& kv_caches = st.kv_caches;
    at::Tensor x = hidden, residual = at::empty_like(hidden), h = at::empty_like(hidden);
    at::Tensor attn = at::empty({n, q_width}, hidden.options());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const LayerWeights& w = layers_[l];
      if (l == 0) {
        add_rms_norm_rows(x.data_ptr<float>(), hidden_, nullptr, 0, w.ln1.data_ptr<float>(),
                          h.data_ptr<float>(), nullptr, n, hidden_, eps_);
        residual.copy_(x);
      } else {   // residual += x, in place (the sum is written over the residual)
        add_rms_norm_rows(x.data_ptr<float>(), hidden_, residual.data_ptr<float>(), hidden_,
                          w.ln1.data_ptr<float>(), h.data_ptr<float>(),
                          residual.data_ptr<float>(), n, hidden_, eps_);
      }
      at::Tensor qkv = w.qkv(h);
      TORCH_CHECK(qkv.size(1) == q_width + 2 * kv_row && qkv.stride(1) == 1, "qkv output");
      float* qkv_p = qkv.data_ptr<float>();
      const int64_t qkv_stride = qkv.stride(0);
      if (w.q_norm.defined())
        for (int64_t t = 0; t < n; ++t) {
          head_norms(qkv_p + t * qkv_stride, heads_, w.q_norm);
          head_norms(qkv_p + t * qkv_stride + q_width, kv_heads_, w.k_norm);
        }
      const Rope& rope = st.rope[w.rope];
      at::Tensor q_sink;                // the sinks' queries, from q before its rotation
      if (w.sinks > 0 && st.sink.cos != nullptr) {
        q_sink = at::empty({n, q_width}, hidden.options());
        rotary_rows(qkv_p, qkv_stride, q_sink.data_ptr<float>(), q_width, st.sink.cos,
                    st.sink.cos_stride, st.sink.sin, st.sink.sin_stride, n, heads_, head_dim_);
      }
      rotary_rows(qkv_p, qkv_stride, qkv_p, qkv_stride, rope.cos, rope.cos_stride, rope.sin,
                  rope.sin_stride, n, heads_ + kv_heads_, head_dim_);
      char* cache = static_cast<char*>(kv_caches[l].data_ptr());
      for (int64_t t = 0; t < n; ++t)
        store_row(cache, st, t, qkv_p + t * qkv_stride + q_width, 0, kv_heads_);
      if (st.quest != nullptr && w.quest_sparse) {
        quest_attention(*st.quest, qkv_p, qkv_stride, head_dim_,
                        reinterpret_cast<const float*>(cache), scale_, attn.data_ptr<float>());
      } else {
        const auto [keys, values] = kv_planes(cache, st);
        decode_attention(qkv_p, qkv_stride, head_dim_, keys, values, tables, table_stride, lens,
                         n, heads_, kv_heads_, scale_, attn.data_ptr<float>(), w.window,
                         w.sinks, q_sink.defined() ? q_sink.data_ptr<float>() : nullptr,
                         q_width);
      }
      at::Tensor o = w.o(attn);
      TORCH_CHECK(o.size(1) == hidden_ && o.is_contiguous(), "o_proj output");
      if (w.post_attn.defined())      // in place: o is this step's own tensor
        add_rms_norm_rows(o.data_ptr<float>(), hidden_, nullptr, 0,
                          w.post_attn.data_ptr<float>(), o.data_ptr<float>(), nullptr, n,
                          hidden_, eps_);
      add_rms_norm_rows(o.data_ptr<float>(), hidden_, residual.data_ptr<float>(), hidden_,
                        w.ln2.data_ptr<float>(), h.data_ptr<float>(), residual.data_ptr<float>(),
                        n, hidden_, eps_);
      at::Tensor gate_up = w.gate_up(h);
      TORCH_CHECK(gate_up.size(1) % 2 == 0 && gate_up.stride(1) == 1, "gate_up output");
      const int64_t inter = gate_up.size(1) / 2;
      at::Tensor act = at::empty({n, inter}, hidden.options());
      activation_rows(gate_up.data_ptr<float>(), gate_up.stride(0), act.data_ptr<float>(), n,
                      inter);
      x = w.down(act);
      TORCH_CHECK(x.size(1) == hidden_ && x.is_contiguous(), "down_proj output");
      if (w.post_ffn.defined())       // in place: x is this step's own tensor
        add_rms_norm_rows(x.data_ptr<float>(), hidden_, nullptr, 0, w.post_ffn.data_ptr<float>(),
                          x.data_ptr<float>(), nullptr, n, hidden_, eps_);
    }
    at::Tensor out = at::empty_like(hidden);
    add_rms_norm_rows(x.data_ptr<float>(), hidden_, residual.data_ptr<float>(), hidden_,
                      final_norm_.data_ptr<float>(), out.data_ptr<float>(),
                      residual.data_ptr<float>(), n, hidden_, eps_);
    return out;
  }

  std::vector<LayerWeights> layers_;
  std::vector<SparseLayer> sparse_;        // empty: dense
  pybind11::list sparse_keep_;             // owns the objects sparse_ points to
  int64_t sparse_rows_max_ = 0;
  at::Tensor final_norm_;
  float eps_;
  int64_t heads_, kv_heads_, head_dim_, hidden_ = 0;
  float scale_;
  Activation activation_ = Activation::kSilu;
  // the windowed layers' distinct (window, sinks); the widest of each; whether every layer is
  std::vector<std::pair<int64_t, int64_t>> window_kinds_;
  int64_t max_window_ = 0, max_sinks_ = 0;
  bool all_windowed_ = false;
  at::Tensor sink_rope_;                   // the sinks' query rows [S + W, 2, head_dim], if shifted
  bool quest_ = false;                     // QUEST's cache layout (set_quest)
  int64_t quest_budget_ = 0;               // its token budget per sparse layer
  int ropes_ = 1;                          // RoPE tables the layers use (Gemma: 2)
};

void bind_decode_stack(pybind11::module& m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack", pybind11::module_local())
      .def(pybind11::init<std::vector<std::vector<pybind11::object>>, at::Tensor, double,
                          int64_t, int64_t, int64_t, double, int64_t,
                          std::vector<std::vector<pybind11::object>>>(),
           pybind11::arg("layers"), pybind11::arg("final_norm"), pybind11::arg("eps"),
           pybind11::arg("heads"), pybind11::arg("kv_heads"), pybind11::arg("head_dim"),
           pybind11::arg("scale"), pybind11::arg("activation") = 0,
           pybind11::arg("extras") = std::vector<std::vector<pybind11::object>>{})
      // the GIL is released while a step runs, so Python threads (swap copies, the server)
      // keep going; quantized projections re-acquire it for their module call
      .def("forward", &DecodeStack::forward, pybind11::arg("hidden"), pybind11::arg("kv_caches"),
           pybind11::arg("slot_mapping"), pybind11::arg("block_tables"), pybind11::arg("seq_lens"),
           pybind11::arg("cos"), pybind11::arg("sin"),
           pybind11::arg("cos_local") = pybind11::none(),
           pybind11::arg("sin_local") = pybind11::none(),
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("window", &DecodeStack::window)
      .def_property_readonly("quest", &DecodeStack::quest)
      .def("set_quest", &DecodeStack::set_quest, pybind11::arg("sparse_layers"),
           pybind11::arg("token_budget"))
      .def("set_windows", &DecodeStack::set_windows, pybind11::arg("windows"),
           pybind11::arg("sinks"), pybind11::arg("sink_rope") = pybind11::none())
      .def("can_generate", &DecodeStack::can_generate)
      .def("set_sparsity", &DecodeStack::set_sparsity)
      .def("generate", &DecodeStack::generate,   // releases the GIL itself
           pybind11::arg("ids"), pybind11::arg("positions"), pybind11::arg("steps"),
           pybind11::arg("kv_caches"), pybind11::arg("block_tables"), pybind11::arg("cos_sin"),
           pybind11::arg("embedding"), pybind11::arg("head"), pybind11::arg("vocab"),
           pybind11::arg("stop") = pybind11::none(),
           pybind11::arg("cos_sin_local") = pybind11::none(),
           pybind11::arg("position_base") = 0, pybind11::arg("embed_scale") = 1.0);
}

}  // namespace kvforge
