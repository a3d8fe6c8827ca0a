// vLLM 0.28's CPU paged attention called from C++: torch.ops.edge_attn.attention (issue 42 part 2, the step's own
// cost). kernels/vllm_plugin/attention.py documents what it replaces and when it falls back.
//
// The compiled graph calls `attention(query, key, value, output, layer)` once per layer and step: the KV cache
// write and the attention, the same two vLLM C++ kernels with the same arguments that vLLM's Python ops
// (unified_kv_cache_update, unified_attention_with_output) pass them. What those ops look up in Python on every
// call (the forward context, the layer, its metadata, its cache views) is kept here instead:
//   set_layer: once per layer and KV cache (the cache's key and value views, the layer's constants);
//   set_step:  once per step and metadata group (the batch's tensors), before the model's forward;
//   end_step:  after it. Outside a step, or for a layer or group not set, `attention` calls
//              edge_attn::vllm_attention (vLLM's own Python ops, registered by attention.py) instead.
// So a graph compiled with Inductor's C++ wrapper runs a decode step without entering Python.

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

struct Layer {
  bool ready = false;
  int64_t group = -1;
  at::Tensor key_cache, value_cache;  // [blocks, kv_heads, block_size, head_size] views of the layer's cache
  double scale = 1.0, softcap = 0.0, k_scale = 1.0, v_scale = 1.0;
  int64_t window = -1;
  std::optional<at::Tensor> alibi, sinks;
  std::string kv_dtype, isa;
};

struct Step {
  bool valid = false;
  int64_t tokens = 0;  // num_actual_tokens: the batch's rows without padding
  bool causal = true;
  at::Tensor query_start_loc, seq_lens, block_table, scheduler_metadata, slot_mapping;
  std::optional<at::Tensor> dynamic_causal;
};

struct State {
  std::mutex lock;  // set_* and end_step come from the engine's thread; taken only there, never by attention
  std::vector<Layer> layers;
  std::vector<Step> steps;
  int64_t direct = 0, fallen_back = 0;  // calls of `attention` each way since forget (tests ask)
};

State& state() {
  static State* kept = new State();  // never destroyed: no tensor outlives libtorch at exit
  return *kept;
}

void set_layer(int64_t index, int64_t group, const at::Tensor& kv_cache, double scale,
               const std::optional<at::Tensor>& alibi, int64_t window, double softcap,
               const std::optional<at::Tensor>& sinks, double k_scale, double v_scale, std::string kv_dtype,
               std::string isa) {
  TORCH_CHECK(index >= 0 && group >= 0, "edge_attn::set_layer: expected index, group >= 0, got ", index, ", ",
              group);
  TORCH_CHECK(kv_cache.dim() == 4, "edge_attn::set_layer: expected a cache [blocks, kv_heads, block_size, "
              "2 * head_size], got ", kv_cache.sizes());
  // vLLM's CPU backend: view as [blocks, kv_heads, 2 * block_size, head_size] and split along dim 2
  const auto blocks = kv_cache.size(0), heads = kv_cache.size(1), block_size = kv_cache.size(2);
  auto halves = kv_cache.view({blocks, heads, block_size * 2, -1}).chunk(2, 2);
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  if (static_cast<int64_t>(s.layers.size()) <= index) s.layers.resize(index + 1);
  auto& layer = s.layers[index];
  layer = Layer{true, group, halves[0], halves[1], scale, softcap, k_scale, v_scale, window, alibi, sinks,
                std::move(kv_dtype), std::move(isa)};
}

void set_step(int64_t group, int64_t tokens, bool causal, const at::Tensor& query_start_loc,
              const at::Tensor& seq_lens, const at::Tensor& block_table, const at::Tensor& scheduler_metadata,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& dynamic_causal) {
  TORCH_CHECK(group >= 0, "edge_attn::set_step: expected group >= 0, got ", group);
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  if (static_cast<int64_t>(s.steps.size()) <= group) s.steps.resize(group + 1);
  s.steps[group] = Step{true, tokens, causal, query_start_loc, seq_lens, block_table, scheduler_metadata,
                        slot_mapping, dynamic_causal};
}

void end_step() {
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  for (auto& step : s.steps) step = Step{};  // releases the batch's tensors too
}

void forget() {
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  s.layers.clear();
  s.steps.clear();
  s.direct = s.fallen_back = 0;
}

std::vector<int64_t> calls() {
  auto& s = state();
  return {s.direct, s.fallen_back};
}

// -1 when `attention` would fall back for this layer now, else its group (tests and the step profiler ask)
int64_t ready_group(int64_t index) {
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  if (index < 0 || index >= static_cast<int64_t>(s.layers.size()) || !s.layers[index].ready) return -1;
  const auto group = s.layers[index].group;
  if (group >= static_cast<int64_t>(s.steps.size()) || !s.steps[group].valid) return -1;
  return group;
}

at::Tensor rows(const at::Tensor& t, int64_t n) { return t.size(0) == n ? t : t.narrow(0, 0, n); }

void attention(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& output,
               int64_t index) {
  // The engine's thread sets the state before the forward and clears it after, and runs the forward itself: no
  // lock is needed to read it here (tests/kernels/test_attention_cpp.py steps it the same way).
  auto& s = state();
  const Layer* layer = index >= 0 && index < static_cast<int64_t>(s.layers.size()) && s.layers[index].ready
                           ? &s.layers[index] : nullptr;  // clang-format: keep
  const Step* step = layer && layer->group < static_cast<int64_t>(s.steps.size()) && s.steps[layer->group].valid
                         ? &s.steps[layer->group] : nullptr;
  if (step == nullptr) {
    static const c10::OperatorHandle fallback =
        c10::Dispatcher::singleton().findSchemaOrThrow("edge_attn::vllm_attention", "");
    std::vector<c10::IValue> stack{query, key, value, output, index};
    ++s.fallen_back;
    fallback.callBoxed(&stack);
    return;
  }
  ++s.direct;
  static const c10::OperatorHandle write =
      c10::Dispatcher::singleton().findSchemaOrThrow("_C::cpu_attn_reshape_and_cache", "");
  static const c10::OperatorHandle attend =
      c10::Dispatcher::singleton().findSchemaOrThrow("_C::cpu_attention_with_kv_cache", "");
  // CPUAttentionBackendImpl.do_kv_cache_update: the whole key and value, the group's slot mapping
  std::vector<c10::IValue> stack{key, value, layer->key_cache, layer->value_cache, step->slot_mapping, layer->isa,
                                 layer->k_scale, layer->v_scale, layer->kv_dtype};
  write.callBoxed(&stack);
  // CPUAttentionBackendImpl.forward: the rows without padding
  stack = {rows(query, step->tokens), layer->key_cache, layer->value_cache, rows(output, step->tokens),
           step->query_start_loc, step->seq_lens, layer->scale, step->causal,
           layer->alibi ? c10::IValue(*layer->alibi) : c10::IValue(), layer->window, step->block_table,
           layer->softcap, step->scheduler_metadata, layer->sinks ? c10::IValue(*layer->sinks) : c10::IValue(),
           step->dynamic_causal ? c10::IValue(*step->dynamic_causal) : c10::IValue(), layer->k_scale,
           layer->v_scale, layer->kv_dtype};
  attend.callBoxed(&stack);
}

}  // namespace

TORCH_LIBRARY(edge_attn, m) {
  m.def("attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, int layer) -> ()");
  // vLLM's own path for a layer or a step the state does not cover; implemented in Python (attention.py)
  m.def("vllm_attention(Tensor query, Tensor key, Tensor value, Tensor(a!) output, int layer) -> ()");
  m.def("set_layer(int index, int group, Tensor kv_cache, float scale, Tensor? alibi, int window, float softcap, "
        "Tensor? sinks, float k_scale, float v_scale, str kv_dtype, str isa) -> ()", &set_layer);
  m.def("set_step(int group, int tokens, bool causal, Tensor query_start_loc, Tensor seq_lens, Tensor block_table, "
        "Tensor scheduler_metadata, Tensor slot_mapping, Tensor? dynamic_causal) -> ()", &set_step);
  m.def("end_step() -> ()", &end_step);
  m.def("forget() -> ()", &forget);
  m.def("ready_group(int index) -> int", &ready_group);
  m.def("calls() -> int[]", &calls);
}

TORCH_LIBRARY_IMPL(edge_attn, CPU, m) { m.impl("attention", &attention); }
