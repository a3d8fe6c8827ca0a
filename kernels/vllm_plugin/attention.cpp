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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

namespace {

constexpr int64_t kLeanRows = 8;   // lean_attention takes a step whose sequences have at most this many query rows
constexpr int64_t kMaxHead = 256;  // and heads of at most this size

struct Layer {
  bool ready = false;
  int64_t group = -1;
  at::Tensor key_cache, value_cache;  // [blocks, kv_heads, block_size, head_size] views of the layer's cache
  double scale = 1.0, softcap = 0.0, k_scale = 1.0, v_scale = 1.0;
  int64_t window = -1;
  std::optional<at::Tensor> alibi, sinks;
  std::string kv_dtype, isa;
  bool lean = false;  // decode rows may take lean_attention (see there): set by set_layer from what it was given
};

struct Step {
  bool valid = false;
  int64_t tokens = 0;  // num_actual_tokens: the batch's rows without padding
  bool causal = true;
  at::Tensor query_start_loc, seq_lens, block_table, scheduler_metadata, slot_mapping;
  std::optional<at::Tensor> dynamic_causal;
  int64_t max_query = 0;  // the most rows any sequence has in this step (query_start_loc's largest step)
};

struct State {
  std::mutex lock;  // set_* and end_step come from the engine's thread; taken only there, never by attention
  std::vector<Layer> layers;
  std::vector<Step> steps;
  int64_t direct = 0, fallen_back = 0;  // calls of `attention` each way since forget (tests ask)
  int64_t lean_calls = 0;               // of `direct`, those lean_attention served
  bool lean_on = true;                  // set_lean: whether decode rows may take lean_attention at all
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
  const bool lean = kv_dtype == "auto" && isa == "vec" && kv_cache.scalar_type() == at::kBFloat16 && !alibi &&
                    !sinks && softcap == 0.0 && window < 0 && kv_cache.size(3) % 32 == 0 &&
                    kv_cache.size(3) / 2 <= kMaxHead && block_size % 16 == 0 && kv_cache.is_contiguous();
  layer = Layer{true, group, halves[0], halves[1], scale, softcap, k_scale, v_scale, window, alibi, sinks,
                std::move(kv_dtype), std::move(isa), lean};
}

void set_step(int64_t group, int64_t tokens, bool causal, const at::Tensor& query_start_loc,
              const at::Tensor& seq_lens, const at::Tensor& block_table, const at::Tensor& scheduler_metadata,
              const at::Tensor& slot_mapping, const std::optional<at::Tensor>& dynamic_causal) {
  TORCH_CHECK(group >= 0, "edge_attn::set_step: expected group >= 0, got ", group);
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  if (static_cast<int64_t>(s.steps.size()) <= group) s.steps.resize(group + 1);
  int64_t max_query = 0;
  if (query_start_loc.scalar_type() == at::kInt && query_start_loc.is_contiguous()) {
    const int32_t* starts = query_start_loc.data_ptr<int32_t>();
    for (int64_t i = 0; i + 1 < query_start_loc.numel(); ++i)
      max_query = std::max<int64_t>(max_query, starts[i + 1] - starts[i]);
  } else {
    max_query = INT64_MAX;  // not read here: never lean
  }
  s.steps[group] = Step{true, tokens, causal, query_start_loc, seq_lens, block_table, scheduler_metadata,
                        slot_mapping, dynamic_causal, max_query};
}

void set_lean(bool on) {
  auto& s = state();
  std::lock_guard<std::mutex> guard(s.lock);
  s.lean_on = on;
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
  s.direct = s.fallen_back = s.lean_calls = 0;
}

std::vector<int64_t> calls() {
  auto& s = state();
  return {s.direct, s.fallen_back, s.lean_calls};
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


// ---- lean decode attention --------------------------------------------------------------------------------------
// vLLM's CPU attention costs ~8 us a layer for one decode row at a short context on this project's hosts (a boxed
// call with 18 arguments, its scheduler's tiling, an OpenMP region), where the arithmetic is well under 1 us. For a
// step whose every sequence has at most kLeanRows query rows (decode, and a drafted verify pass), on vLLM's "vec"
// cache layout (x86 without AMX; tests/kernels/test_attention_cpp.py checks it against vLLM's), with a bf16 cache and
// none of alibi, sinks, soft-capping or a window, the rows are attended here. Each row the same way whatever the
// batch: a drafted token's logits equal an undrafted one's. The step's keys and values are written here too, as
// vLLM's write for that layout writes them (lean_write). Causal: row j of a sequence's n rows sees positions
// [0, seq_len - n + j]. bf16 is read and rounded by c10's own bit conversions.
// The "vec" layout (vLLM 0.28 csrc/cpu/cpu_attn_vec.hpp): a block's keys per KV head column-major [head, block_size],
// its values row-major [block_size, head].


// The kernel's body is written once and compiled for each instruction set the host may have (lean_row_v4, _v3, _base
// below): its helpers are always inlined into those, so their vectors take the caller's width.
#define EDGE_LEAN_INLINE inline __attribute__((always_inline))

// e^x for x <= 0 (softmax after the max is taken), written so the compiler vectorizes it: 2^(x log2 e) split into
// an integer power (the exponent bits) and a fraction's degree-6 polynomial; relative error < 2e-7, 0 below -87.
EDGE_LEAN_INLINE float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float t = x * 1.44269504088896341f;
  const float fi = std::floor(t);
  const float f = t - fi;  // [0, 1)
  float p = 1.5353362e-4f;
  p = p * f + 1.3398874e-3f;
  p = p * f + 9.6181291e-3f;
  p = p * f + 5.5504109e-2f;
  p = p * f + 2.4022650e-1f;
  p = p * f + 6.9314718e-1f;
  p = p * f + 1.0f;
  const int32_t e = static_cast<int32_t>(fi) + 127;
  uint32_t bits = static_cast<uint32_t>(e) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

typedef float f32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

EDGE_LEAN_INLINE f32x16 load_bf16x16(const uint16_t* p) {  // 16 bf16 from p as floats (unaligned)
  u16x16 raw;
  std::memcpy(&raw, p, sizeof raw);
  const u32x16 wide = __builtin_convertvector(raw, u32x16) << 16;
  f32x16 out;
  std::memcpy(&out, &wide, sizeof out);
  return out;
}

// One query row's G heads (sharing KV head `kv_head`) against `count` cached positions of one sequence, in vectors
// of 16 floats (one zmm in lean_row_v4, two ymm in _v3, four xmm in _base). q: the row's [G, head] bf16 query;
// out: its [G, head] bf16 output; scores: G rows of `padded` floats; qf: G * head floats.
template <int G>
EDGE_LEAN_INLINE void lean_row_body(const uint16_t* q, uint16_t* out, int64_t head, int64_t kv_head, int64_t count,
                               const int32_t* blocks, int64_t block_size, const uint16_t* key_base,
                               const uint16_t* value_base, int64_t block_stride, int64_t head_stride, float scale,
                               float* scores, float* qf) {
  const int64_t padded = (count + 15) / 16 * 16;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t d = 0; d < head; ++d) qf[g * head + d] = c10::detail::f32_from_bits(q[g * head + d]) * scale;
  // scores, 16 positions at a time: a block's keys are column-major, so 16 positions of one d are contiguous
  for (int64_t start = 0; start < count; start += block_size) {
    const uint16_t* keys = key_base + blocks[start / block_size] * block_stride + kv_head * head_stride;
    const int64_t end = std::min(block_size, count - start);
    for (int64_t t0 = 0; t0 < end; t0 += 16) {
      f32x16 acc[G];
      for (int g = 0; g < G; ++g) acc[g] = f32x16{};
      for (int64_t d = 0; d < head; ++d) {
        const f32x16 k = load_bf16x16(keys + d * block_size + t0);
        for (int g = 0; g < G; ++g) acc[g] += qf[g * head + d] * k;
      }
      for (int g = 0; g < G; ++g) std::memcpy(scores + g * padded + start + t0, &acc[g], sizeof acc[g]);
    }
  }
  // softmax over [0, count): the positions past it in the last 16 (keys not yet written) weigh 0
  for (int g = 0; g < G; ++g) {
    float* sc = scores + g * padded;
    for (int64_t t = count; t < padded; ++t) sc[t] = -INFINITY;
    f32x16 top, chunk;
    std::memcpy(&top, sc, sizeof top);
    for (int64_t t0 = 16; t0 < padded; t0 += 16) {
      std::memcpy(&chunk, sc + t0, sizeof chunk);
      top = top > chunk ? top : chunk;
    }
    float most = top[0];
    for (int i = 1; i < 16; ++i) most = std::max(most, top[i]);
    for (int64_t t = 0; t < padded; ++t) sc[t] = exp_nonpositive(sc[t] - most);
    for (int64_t t = count; t < padded; ++t) sc[t] = 0.0f;
    f32x16 total = f32x16{};
    for (int64_t t0 = 0; t0 < padded; t0 += 16) {
      std::memcpy(&chunk, sc + t0, sizeof chunk);
      total += chunk;
    }
    float sum = 0.0f;
    for (int i = 0; i < 16; ++i) sum += total[i];
    const float inv = 1.0f / sum;
    for (int64_t t = 0; t < count; ++t) sc[t] *= inv;
  }
  // outputs, 16 dimensions at a time over every position: values are row-major in a block
  for (int64_t c = 0; c < head; c += 16) {
    f32x16 acc[G];
    for (int g = 0; g < G; ++g) acc[g] = f32x16{};
    for (int64_t start = 0; start < count; start += block_size) {
      const uint16_t* values = value_base + blocks[start / block_size] * block_stride + kv_head * head_stride + c;
      const int64_t end = std::min(block_size, count - start);
      const float* p = scores + start;
      for (int64_t t = 0; t < end; ++t) {
        const f32x16 v = load_bf16x16(values + t * head);
        for (int g = 0; g < G; ++g) acc[g] += p[g * padded + t] * v;
      }
    }
    for (int g = 0; g < G; ++g)
      for (int64_t i = 0; i < 16; ++i) out[g * head + c + i] = c10::detail::round_to_nearest_even(acc[g][i]);
  }
}

using LeanRow = void (*)(const uint16_t*, uint16_t*, int64_t, int64_t, int64_t, const int32_t*, int64_t,
                         const uint16_t*, const uint16_t*, int64_t, int64_t, float, float*, float*);

#define EDGE_LEAN_ARGS                                                                                               \
  const uint16_t *q, uint16_t *out, int64_t head, int64_t kv_head, int64_t count, const int32_t *blocks,             \
      int64_t block_size, const uint16_t *key_base, const uint16_t *value_base, int64_t block_stride,                \
      int64_t head_stride, float scale, float *scores, float *qf
#define EDGE_LEAN_CALL                                                                                               \
  lean_row_body<G>(q, out, head, kv_head, count, blocks, block_size, key_base, value_base, block_stride, head_stride, \
                   scale, scores, qf)

template <int G>
void lean_row_base(EDGE_LEAN_ARGS) { EDGE_LEAN_CALL; }
#if defined(__x86_64__) && defined(__GNUC__)
template <int G>
__attribute__((target("avx2,fma,f16c,bmi,bmi2"))) void lean_row_v3(EDGE_LEAN_ARGS) { EDGE_LEAN_CALL; }
template <int G>
__attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma,f16c,bmi,bmi2"))) void lean_row_v4(
    EDGE_LEAN_ARGS) { EDGE_LEAN_CALL; }
#endif

// The instruction set the lean kernel runs: the best the CPU has (x86-64-v4: AVX-512 F/BW/VL/DQ; v3: AVX2 and FMA;
// else the baseline), no higher than ATEN_CPU_CAPABILITY allows (avx512, avx2, default), so that a run with
// ATEN_CPU_CAPABILITY=avx2 on an AVX-512 host checks the AVX2 code as it checks ATen's. set_lean_isa picks one for a
// test (never one the CPU lacks).
enum class LeanIsa { base = 0, v3 = 1, v4 = 2 };

LeanIsa host_lean_isa() {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
      __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    return LeanIsa::v4;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return LeanIsa::v3;
#endif
  return LeanIsa::base;
}

LeanIsa default_lean_isa() {
  LeanIsa isa = host_lean_isa();
  const char* cap = std::getenv("ATEN_CPU_CAPABILITY");
  if (cap != nullptr) {
    const std::string value(cap);
    if (value == "default") isa = LeanIsa::base;
    else if (value == "avx2" && isa > LeanIsa::v3) isa = LeanIsa::v3;
  }
  return isa;
}

LeanIsa& lean_isa_in_use() {
  static LeanIsa isa = default_lean_isa();
  return isa;
}

const char* lean_isa_name(LeanIsa isa) {
  switch (isa) {
    case LeanIsa::v4: return "x86-64-v4";
    case LeanIsa::v3: return "x86-64-v3";
    default: return "baseline";
  }
}

std::string lean_isa() { return lean_isa_name(lean_isa_in_use()); }

// "auto" (what the host and ATEN_CPU_CAPABILITY allow), "x86-64-v4", "x86-64-v3" or "baseline"; returns the one set
std::string set_lean_isa(std::string name) {
  LeanIsa want;
  if (name == "auto") want = default_lean_isa();
  else if (name == "x86-64-v4") want = LeanIsa::v4;
  else if (name == "x86-64-v3") want = LeanIsa::v3;
  else if (name == "baseline") want = LeanIsa::base;
  else TORCH_CHECK(false, "edge_attn::set_lean_isa: name: expected auto, x86-64-v4, x86-64-v3 or baseline, got '",
                   name, "'");
  TORCH_CHECK(want <= host_lean_isa(), "edge_attn::set_lean_isa: name: '", name, "' needs instructions this CPU "
              "lacks (it has ", lean_isa_name(host_lean_isa()), ")");
  lean_isa_in_use() = want;
  return lean_isa();
}

template <int G>
LeanRow lean_row_isa() {
#if defined(__x86_64__) && defined(__GNUC__)  // the x86 builds exist only there (a discarded if constexpr still names them)
  switch (lean_isa_in_use()) {
    case LeanIsa::v4: return lean_row_v4<G>;
    case LeanIsa::v3: return lean_row_v3<G>;
    default: break;
  }
#endif
  return lean_row_base<G>;
}

LeanRow lean_row_for(int64_t group) {
  switch (group) {
    case 1: return lean_row_isa<1>();
    case 2: return lean_row_isa<2>();
    case 3: return lean_row_isa<3>();
    case 4: return lean_row_isa<4>();
    case 5: return lean_row_isa<5>();
    case 6: return lean_row_isa<6>();
    case 7: return lean_row_isa<7>();
    case 8: return lean_row_isa<8>();
    default: return nullptr;
  }
}

// Whether lean_attention takes this call: the step's shape and every tensor as the kernel reads it.
bool lean_fits(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const at::Tensor& output,
               const Layer& layer, const Step& step) {
  if (step.max_query > kLeanRows || !step.causal || step.dynamic_causal || step.tokens <= 0 ||
      step.seq_lens.scalar_type() != at::kInt || step.block_table.scalar_type() != at::kInt ||
      !step.block_table.is_contiguous() || !step.seq_lens.is_contiguous() ||
      step.slot_mapping.scalar_type() != at::kLong || !step.slot_mapping.is_contiguous() ||
      step.slot_mapping.numel() < step.tokens)
    return false;
  const int64_t kv_heads = layer.key_cache.size(1), head = layer.key_cache.size(3);
  for (const at::Tensor* t : {&query, &key, &value, &output})
    if (t->scalar_type() != at::kBFloat16 || t->dim() != 3 || t->size(0) < step.tokens || t->size(2) != head ||
        t->stride(2) != 1 || t->stride(1) != head)
      return false;
  const int64_t heads = query.size(1);
  if (heads % kv_heads != 0 || output.size(1) != heads || key.size(1) != kv_heads || value.size(1) != kv_heads ||
      head % 16 != 0 || lean_row_for(heads / kv_heads) == nullptr)
    return false;
  const int32_t* lens = step.seq_lens.data_ptr<int32_t>();
  const int64_t room = step.block_table.size(1) * layer.key_cache.size(2);
  for (int64_t i = 0; i < step.seq_lens.numel(); ++i)
    if (lens[i] > room) return false;
  return true;
}

// vLLM's "vec" write of the step's rows (cpu_attn_reshape_and_cache for this layout, bf16): each key column-major in
// its block, each value a row; a negative slot (padding) is skipped.
void lean_write(const at::Tensor& key, const at::Tensor& value, const Layer& layer, const Step& step) {
  const int64_t kv_heads = layer.key_cache.size(1), block_size = layer.key_cache.size(2),
                head = layer.key_cache.size(3);
  const int64_t block_stride = layer.key_cache.stride(0), head_stride = layer.key_cache.stride(1);
  auto* key_base = reinterpret_cast<uint16_t*>(layer.key_cache.data_ptr());
  auto* value_base = reinterpret_cast<uint16_t*>(layer.value_cache.data_ptr());
  const auto* k = reinterpret_cast<const uint16_t*>(key.data_ptr());
  const auto* v = reinterpret_cast<const uint16_t*>(value.data_ptr());
  const int64_t* slots = step.slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < step.tokens; ++i) {
    const int64_t slot = slots[i];
    if (slot < 0) continue;
    const int64_t block = slot / block_size, offset = slot % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const uint16_t* key_row = k + i * key.stride(0) + h * head;
      uint16_t* key_column = key_base + block * block_stride + h * head_stride + offset;
      for (int64_t d = 0; d < head; ++d) key_column[d * block_size] = key_row[d];
      uint16_t* value_row = value_base + block * block_stride + h * head_stride + offset * head;
      std::memcpy(value_row, v + i * value.stride(0) + h * head, static_cast<size_t>(head) * sizeof(uint16_t));
    }
  }
}

// The step's rows, each sequence's rows attended one by one (lean_row), after lean_fits said yes.
void lean_attention(const at::Tensor& query, const at::Tensor& output, const Layer& layer, const Step& step) {
  const int64_t heads = query.size(1), head = layer.key_cache.size(3), kv_heads = layer.key_cache.size(1);
  const int64_t block_size = layer.key_cache.size(2);
  const int64_t group = heads / kv_heads, sequences = step.seq_lens.numel();
  const LeanRow row_fn = lean_row_for(group);
  const int32_t* starts = step.query_start_loc.data_ptr<int32_t>();
  const int32_t* lens = step.seq_lens.data_ptr<int32_t>();
  const int32_t* table = step.block_table.data_ptr<int32_t>();
  const int64_t table_width = step.block_table.size(1);
  int64_t longest = 0;
  for (int64_t i = 0; i < sequences; ++i) longest = std::max<int64_t>(longest, lens[i]);
  const auto* key_base = reinterpret_cast<const uint16_t*>(layer.key_cache.data_ptr());
  const auto* value_base = reinterpret_cast<const uint16_t*>(layer.value_cache.data_ptr());
  const int64_t block_stride = layer.key_cache.stride(0), head_stride = layer.key_cache.stride(1);
  const auto* q = reinterpret_cast<const uint16_t*>(query.data_ptr());
  auto* out = reinterpret_cast<uint16_t*>(output.data_ptr());
  thread_local std::vector<float> scores, qf;
  const int64_t padded = (longest + 15) / 16 * 16;
  if (scores.size() < static_cast<size_t>(group * padded)) scores.resize(static_cast<size_t>(group * padded));
  if (qf.size() < static_cast<size_t>(group * head)) qf.resize(static_cast<size_t>(group * head));
  const float scale = static_cast<float>(layer.scale);
  for (int64_t i = 0; i < sequences; ++i) {
    const int64_t rows = starts[i + 1] - starts[i];
    for (int64_t j = 0; j < rows; ++j) {
      const int64_t row = starts[i] + j, count = lens[i] - rows + j + 1;
      for (int64_t h = 0; h < kv_heads; ++h)
        row_fn(q + row * query.stride(0) + h * group * head, out + row * output.stride(0) + h * group * head, head,
               h, count, table + i * table_width, block_size, key_base, value_base, block_stride, head_stride, scale,
               scores.data(), qf.data());
    }
  }
}

// ---- graph inputs held from C++ -----------------------------------------------------------------------------------
// A compiled graph with Inductor's C++ wrapper runs without the GIL, and releases each input's handle once the graph
// is done with it. An input Python owns alone (a model's parameter or buffer: its TensorImpl's only C++ reference
// is its PyObject's) then falls from 2 C++ references to 1, and c10 hands the PyObject back (decref_pyobject), which
// takes the GIL, in the middle of the forward: ~64 times a decode step on the default model. In one-process serving
// the event loop holds the GIL exactly then (the step's outputs were handed over as the forward began), so the
// engine's thread waited for it there: 90 % of its context switches had aoti_torch_delete_tensor_object ->
// decref_pyobject -> take_gil in their stacks (perf sched_switch, docs/reports/2026-12-08-gil-in-the-graph.md). A reference held here keeps every such input at
// 2 or more through the graph, so no release inside it needs the GIL. The tensors are the model's own (no copy).
std::vector<at::Tensor>& held_tensors() {
  static auto* kept = new std::vector<at::Tensor>();  // never destroyed, as state()
  return *kept;
}

int64_t hold_tensors(const std::vector<at::Tensor>& tensors) {
  auto& kept = held_tensors();
  kept.insert(kept.end(), tensors.begin(), tensors.end());
  return static_cast<int64_t>(kept.size());
}

void release_tensors() {
  std::vector<at::Tensor> gone;
  gone.swap(held_tensors());
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
  if (s.lean_on && layer->lean && lean_fits(query, key, value, output, *layer, *step)) {
    lean_write(key, value, *layer, *step);
    lean_attention(query, output, *layer, *step);
    ++s.lean_calls;
    return;
  }
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
  m.def("set_lean(bool on) -> ()", &set_lean);
  m.def("lean_isa() -> str", &lean_isa);
  m.def("hold_tensors(Tensor[] tensors) -> int", &hold_tensors);
  m.def("release_tensors() -> ()", &release_tensors);
  m.def("set_lean_isa(str name) -> str", &set_lean_isa);
}

TORCH_LIBRARY_IMPL(edge_attn, CPU, m) { m.impl("attention", &attention); }
