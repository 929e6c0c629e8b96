// llmc's native CPU kernels: an ONNX Runtime custom-op library (domain "ai.llmc"): ShadowCorrection
// and DecodeAttention (below).
//
// ShadowCorrection(x[..., K], wt[K, N], base[..., N]?; lo, hi) -> y[..., N]
//
//   y = base + (x - clip(x, lo, hi)) @ wt
//
// The float part of a W8A8 projection with shadow outliers: x's entries outside [lo, hi] are the
// outliers, about 1% of a row, and each adds its excess times one row of the float weight table.
// The graph-level form (llmc.backends.onnx_backend) gathers every channel that any row of a block
// has an outlier in and multiplies densely; this kernel visits each row's own outliers only:
// R * k * N multiply-adds for k outliers a row, instead of R * M * N for a block's union of M.
//
// The work is split into tasks, a tile of kTile output columns by a block of rows, run on ONNX
// Runtime's intra-op threads. Each row sums its outliers' weight-row slices in order of channel in a
// local accumulator, then adds base: the output is written once, and a block's weight-row slices
// stay in cache across its rows. A NaN entry of x is an outlier (its excess is NaN), as in the
// graph form.
//
// Built by `llmc kernels build` (llmc.runtime.native) against ONNX Runtime's C/C++ API headers;
// it calls ONNX Runtime only through the API table it is registered with, so it links to no
// ONNX Runtime library.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kTile = 256;  // output columns per task: 1 KiB of a weight row, of an output row

constexpr int64_t kScan = 64;  // x entries checked at once for an outlier (a vectorised test)
constexpr int64_t kBlockRows = 32;  // a task's rows: blocks of at least this many
constexpr int64_t kTasks = 8;  // tasks to aim for, column tiles times row blocks
constexpr size_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all
constexpr int64_t kAttentionParallel = 1 << 15;  // attended positions x head size x heads below which one thread does it all

struct Outliers {  // by row: row r's outlier channels and excesses are [start[r], start[r + 1])
  std::vector<int64_t> start;  // [rows + 1]
  std::vector<int32_t> channel;
  std::vector<float> excess;
};

void find_outliers(const float* x, int64_t rows, int64_t k, float lo, float hi, Outliers& out) {
  out.start.assign(rows + 1, 0);
  out.channel.clear();
  out.excess.clear();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    for (int64_t c0 = 0; c0 < k; c0 += kScan) {
      const int64_t c1 = std::min(k, c0 + kScan);
      int any = 0;  // branch-free, so that it vectorises
      for (int64_t c = c0; c < c1; ++c) {
        const float v = xr[c];
        any |= static_cast<int>(v < lo) | static_cast<int>(v > hi) | static_cast<int>(v != v);
      }
      if (any == 0) continue;
      for (int64_t c = c0; c < c1; ++c) {
        const float v = xr[c];
        if (!(v >= lo && v <= hi)) {  // outside, or NaN
          out.channel.push_back(static_cast<int32_t>(c));
          out.excess.push_back(v - (v < lo ? lo : (v > hi ? hi : v)));
        }
      }
    }
    out.start[r + 1] = static_cast<int64_t>(out.channel.size());
  }
}

struct Job {
  const Outliers* outliers;
  const float* wt;
  const float* base;  // may be null
  float* y;
  int64_t rows, n, tiles, row_blocks;
};

// A vector of 16 floats (GCC's vector extension: AVX-512, two AVX registers, or four SSE ones).
typedef float Vec __attribute__((vector_size(64)));
constexpr int64_t kLanes = 16, kVecs = kTile / kLanes;

inline Vec load(const float* p) {
  Vec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, Vec v) { __builtin_memcpy(p, &v, sizeof v); }

// One row's slice [n0, n0 + width) of the output: its outliers' weight-row slices, scaled and summed
// in order of channel, then added to base. A whole tile sums in kVecs vector registers and writes the
// output once; a partial tile (the last one of a row) sums in memory.
inline void row_slice(const Job& job, int64_t r, int64_t n0, int64_t width) {
  const Outliers& o = *job.outliers;
  float* yr = job.y + r * job.n + n0;
  const float* br = job.base != nullptr ? job.base + r * job.n + n0 : nullptr;
  const int64_t first = o.start[r], last = o.start[r + 1];
  if (width == kTile) {
    Vec acc[kVecs] = {};
    for (int64_t i = first; i < last; ++i) {
      const float d = o.excess[i];
      const float* wr = job.wt + static_cast<int64_t>(o.channel[i]) * job.n + n0;
#pragma GCC unroll 16
      for (int64_t v = 0; v < kVecs; ++v) acc[v] += d * load(wr + v * kLanes);
    }
#pragma GCC unroll 16
    for (int64_t v = 0; v < kVecs; ++v) store(yr + v * kLanes, br != nullptr ? load(br + v * kLanes) + acc[v] : acc[v]);
    return;
  }
  float acc[kTile] = {};
  for (int64_t i = first; i < last; ++i) {
    const float d = o.excess[i];
    const float* wr = job.wt + static_cast<int64_t>(o.channel[i]) * job.n + n0;
    for (int64_t j = 0; j < width; ++j) acc[j] += d * wr[j];
  }
  for (int64_t j = 0; j < width; ++j) yr[j] = br != nullptr ? br[j] + acc[j] : acc[j];
}

// Task t: column tile t % tiles of the rows in row block t / tiles.
void run_task(void* data, size_t t) {
  const Job& job = *static_cast<const Job*>(data);
  const int64_t tile = static_cast<int64_t>(t) % job.tiles, block = static_cast<int64_t>(t) / job.tiles;
  const int64_t n0 = tile * kTile, width = std::min(kTile, job.n - n0);
  const int64_t per = (job.rows + job.row_blocks - 1) / job.row_blocks;
  const int64_t r0 = block * per, r1 = std::min(job.rows, r0 + per);
  for (int64_t r = r0; r < r1; ++r) row_slice(job, r, n0, width);
}

struct ShadowKernel {
  float lo, hi;

  ShadowKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    lo = ki.GetAttribute<float>("lo");
    hi = ki.GetAttribute<float>("hi");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    Ort::ConstValue wt = ctx.GetInput(1);
    const OrtValue* base_value = ctx.GetInputCount() > 2 ? static_cast<const OrtValue*>(ctx.GetInput(2)) : nullptr;
    std::vector<int64_t> xs = x.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> ws = wt.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.empty() || ws.size() != 2 || ws[0] != xs.back())
      throw Ort::Exception("ShadowCorrection: x must be [..., K] and wt [K, N] with the same K", ORT_INVALID_ARGUMENT);
    const int64_t k = ws[0], n = ws[1];
    int64_t rows = 1;
    for (size_t i = 0; i + 1 < xs.size(); ++i) rows *= xs[i];
    std::vector<int64_t> ys(xs.begin(), xs.end() - 1);
    ys.push_back(n);
    const float* base = nullptr;
    if (base_value != nullptr) {
      Ort::ConstValue b{base_value};
      if (b.GetTensorTypeAndShapeInfo().GetShape() != ys)
        throw Ort::Exception("ShadowCorrection: base must be [..., N], x's rows by wt's columns", ORT_INVALID_ARGUMENT);
      base = b.GetTensorData<float>();
    }
    Ort::UnownedValue y = ctx.GetOutput(0, ys.data(), ys.size());
    Outliers outliers;
    find_outliers(x.GetTensorData<float>(), rows, k, lo, hi, outliers);
    const int64_t tiles = (n + kTile - 1) / kTile;
    // as few row blocks as make kTasks tasks (a block's rows share its weight-row slices in cache), of
    // kBlockRows rows at least
    const int64_t row_blocks = std::max<int64_t>(1, std::min<int64_t>(rows / kBlockRows, (kTasks + tiles - 1) / tiles));
    Job job{&outliers, wt.GetTensorData<float>(), base, y.GetTensorMutableData<float>(), rows, n, tiles, row_blocks};
    const size_t tasks = static_cast<size_t>(tiles * row_blocks);
    if (tasks > 1 && outliers.channel.size() * static_cast<size_t>(n) >= kParallelWork)
      ctx.ParallelFor(run_task, tasks, 0, &job);
    else
      for (size_t t = 0; t < tasks; ++t) run_task(&job, t);
  }
};

struct ShadowCorrectionOp : Ort::CustomOpBase<ShadowCorrectionOp, ShadowKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new ShadowKernel(api, info); }
  const char* GetName() const { return "ShadowCorrection"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ---------------------------------------------------------------------------------------------------
// DecodeAttention: one token's attention over a bound KV cache, GroupQueryAttention's signature at one row
//
//   (query, key?, value?, past_key, past_value, seqlens_k, total_sequence_length, cos_cache?, sin_cache?)
//     -> (output [1, 1, H*D], present_key, present_value)
//
// query is [1, 1, H*D], or q/k/v packed [1, 1, (H + 2*KV)*D] with key and value omitted; the caches are
// [1, KV, C, D] float32, present bound to past's memory (else past is copied first); seqlens_k [1] is the
// cache length before the token, which lands at that position. With do_rotary, q and k are rotated
// there (rotate-half, cos/sin [C, D/2]). Attends over [start, p] with start = p + 1 - local_window_size
// when one is set. Tasks on ONNX Runtime's pool are a KV head by a block of kPositions positions: all its
// query heads' scores, softmax terms and weighted V rows, which one pass over the tasks' maxima and
// sums then merges (as split-K "flash decoding" does).

int64_t attribute_or(const Ort::ConstKernelInfo& ki, const char* name, int64_t fallback) {
  try {
    return ki.GetAttribute<int64_t>(name);
  } catch (const Ort::Exception&) {
    return fallback;
  }
}

// e^x for x <= 0 (scores minus their maximum), 16 at a time: x = n ln2 + r with |r| <= ln2 / 2, e^r by its
// Taylor polynomial to r^6 (relative error about 1e-7), 2^n into the exponent bits; below -87, e^-87.
typedef int32_t IVec __attribute__((vector_size(64)));

inline Vec exp_nonpositive(Vec x) {
  const Vec floor_x = Vec{} - 87.0f;
  x = x < floor_x ? floor_x : x;
  const Vec round = Vec{} + 12582912.0f;  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const Vec n = (x * 1.44269504f + round) - round;
  const Vec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  Vec e = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const IVec bits = (IVec)e + (__builtin_convertvector(n, IVec) << 23);
  return (Vec)bits;
}

inline float hsum(Vec v) {
  float t = 0.0f;
  for (int64_t l = 0; l < kLanes; ++l) t += v[l];
  return t;
}

// The lane sums of 16 vectors as one vector (lane i: the sum of a[i]'s lanes): four levels that each add
// the halves of pairs, 15 shuffle-adds in place of 16 horizontal sums.
inline Vec fold(Vec x, Vec y, IVec lo, IVec hi) { return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi); }

inline Vec lane_sums(Vec* a) {
  const IVec lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const IVec lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const IVec lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const IVec lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  for (int i = 0; i < 8; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo8, lo8 + 8);
  for (int i = 0; i < 4; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo4, lo4 + 4);
  for (int i = 0; i < 2; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo2, lo2 + 2);
  return fold(a[0], a[1], lo1, lo1 + 1);
}

constexpr int64_t kMaxGroup = 16;    // query heads per KV head that the attention kernel handles
constexpr int64_t kPositions = 128;  // cache positions per attention task

// A cache row's 16 entries from j on as floats: float32 as they are, int8 codes converted (their
// per-channel scales are folded into q for K and applied to the output for V).
inline Vec row16(const float* p) { return load(p); }

inline Vec row16(const int8_t* p) {  // GCC's generic widening is scalar code: the instructions where there are some
#if defined(__AVX512F__)
  return (Vec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(c)), hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(c, 8)));
  Vec v;
  __builtin_memcpy(&v, &lo, sizeof lo);
  __builtin_memcpy(reinterpret_cast<char*>(&v) + sizeof lo, &hi, sizeof hi);
  return v;
#else
  Vec v;
  for (int64_t l = 0; l < kLanes; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

template <typename T>
struct AttentionJob {
  const float* q;  // [H, D], rotated, times K's scales for an int8 cache
  const T* k;      // [KV, C, D]
  const T* v;
  const float* v_scale;  // [KV, D] for an int8 cache, else null
  int64_t group, c, d, start, total, blocks;
  float scale;
  float* m;  // per (head, block): the block's largest score, its sum of e^(score - m), its unnormalised output [D]
  float* l;
  float* o;
};

// Task t: KV head t / blocks over the positions of block t % blocks, for each of its query heads: the
// scores (each K row read once for the group), their e^(s - m) and sum, and the e-weighted sum of V rows.
template <typename T>
void attend_block(void* data, size_t t) {
  const AttentionJob<T>& job = *static_cast<const AttentionJob<T>*>(data);
  const int64_t g = static_cast<int64_t>(t) / job.blocks, b = static_cast<int64_t>(t) % job.blocks, d = job.d;
  const int64_t t0 = job.start + b * kPositions, n = std::min(job.total - t0, kPositions);
  alignas(64) float s[kMaxGroup][kPositions];
  const T* kg = job.k + (g * job.c + t0) * d;
  const T* vg = job.v + (g * job.c + t0) * d;
  int64_t first = 0;
  if (d % kLanes == 0) {  // 16 positions at a time: their dot products' lane sums in one vector
    for (; first + kLanes <= n; first += kLanes) {
      for (int64_t h = 0; h < job.group; ++h) {
        const float* q = job.q + (g * job.group + h) * d;
        Vec a[kLanes];
        for (int64_t i = 0; i < kLanes; ++i) {
          const T* kr = kg + (first + i) * d;
          Vec acc = {};
          for (int64_t j = 0; j < d; j += kLanes) acc += load(q + j) * row16(kr + j);
          a[i] = acc;
        }
        store(&s[h][first], lane_sums(a) * job.scale);
      }
    }
  }
  for (int64_t i = first; i < n; ++i) {
    const T* kr = kg + i * d;
    for (int64_t h = 0; h < job.group; ++h) {
      const float* q = job.q + (g * job.group + h) * d;
      float dot = 0.0f;
      if (d % kLanes == 0) {
        Vec acc = {};
        for (int64_t j = 0; j < d; j += kLanes) acc += load(q + j) * row16(kr + j);
        dot = hsum(acc);
      } else {
        for (int64_t j = 0; j < d; ++j) dot += q[j] * static_cast<float>(kr[j]);
      }
      s[h][i] = dot * job.scale;
    }
  }
  for (int64_t h = 0; h < job.group; ++h) {
    const int64_t slot = (g * job.group + h) * job.blocks + b;
    float top = -INFINITY;
    bool nan = false;  // a NaN score makes the head's output NaN (as in GroupQueryAttention), not garbage from the exp
    for (int64_t i = 0; i < n; ++i) {
      top = std::max(top, s[h][i]);
      nan |= s[h][i] != s[h][i];
    }
    if (nan) {
      job.m[slot] = job.l[slot] = NAN;
      std::fill(job.o + slot * d, job.o + (slot + 1) * d, NAN);
      continue;
    }
    float sum = 0.0f;
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes) {
      const Vec e = exp_nonpositive(load(&s[h][i]) - top);
      store(&s[h][i], e);
      sum += hsum(e);
    }
    for (; i < n; ++i) {
      s[h][i] = std::exp(s[h][i] - top);
      sum += s[h][i];
    }
    job.m[slot] = top;
    job.l[slot] = sum;
    float* o = job.o + slot * d;
    std::fill(o, o + d, 0.0f);
    for (int64_t r = 0; r < n; ++r) {
      const float w = s[h][r];
      const T* vr = vg + r * d;
      if (d % kLanes == 0)
        for (int64_t j = 0; j < d; j += kLanes) store(o + j, load(o + j) + w * row16(vr + j));
      else
        for (int64_t j = 0; j < d; ++j) o[j] += w * static_cast<float>(vr[j]);
    }
    if (job.v_scale != nullptr)
      for (int64_t j = 0; j < d; ++j) o[j] *= job.v_scale[g * d + j];
  }
}

// Rotate-half at one position, each product rounded before the sum (no fused multiply-add), as the runtime's
// and ONNX Runtime's rotations round: an int8 cache stores the same codes.
__attribute__((optimize("fp-contract=off"))) void rotate(float* x, int64_t heads, int64_t d, const float* cos, const float* sin) {
  const int64_t half = d / 2;
  for (int64_t h = 0; h < heads; ++h) {
    float* xh = x + h * d;
    for (int64_t j = 0; j < half; ++j) {
      const float a = xh[j], b = xh[j + half];
      xh[j] = a * cos[j] - b * sin[j];
      xh[j + half] = b * cos[j] + a * sin[j];
    }
  }
}

// T: the caches' element type, float (DecodeAttention) or int8 codes with per-channel scales, inputs 9 and
// 10 [1, KV, 1, D] (DecodeAttentionInt8: a stored row is clip(rint(x / scale), -128, 127), as the runtime's
// and ONNX Runtime's quantized caches).
template <typename T>
struct AttentionKernel {
  int64_t heads, kv_heads, rotary, window;
  float scale;

  AttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    scale = ki.GetAttribute<float>("scale");
    rotary = attribute_or(ki, "do_rotary", 0);
    window = attribute_or(ki, "local_window_size", -1);
    if (heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || heads / kv_heads > kMaxGroup)
      throw Ort::Exception("DecodeAttention: num_heads must be kv_num_heads times 1 to 16", ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    auto present = [&](size_t i) { return i < ctx.GetInputCount() && static_cast<const OrtValue*>(ctx.GetInput(i)) != nullptr; };
    Ort::ConstValue query = ctx.GetInput(0), past_k = ctx.GetInput(3), past_v = ctx.GetInput(4), seqlens = ctx.GetInput(5);
    const std::vector<int64_t> cache = past_k.GetTensorTypeAndShapeInfo().GetShape();
    if (cache.size() != 4 || cache[0] != 1 || cache[1] != kv_heads || past_v.GetTensorTypeAndShapeInfo().GetShape() != cache)
      throw Ort::Exception("DecodeAttention: the caches must both be [1, kv_num_heads, capacity, head_size]", ORT_INVALID_ARGUMENT);
    const int64_t c = cache[2], d = cache[3], hd = heads * d, kvd = kv_heads * d;
    const bool packed = !present(1);
    const int64_t width = query.GetTensorTypeAndShapeInfo().GetElementCount();
    if (width != (packed ? hd + 2 * kvd : hd))
      throw Ort::Exception("DecodeAttention: one row only; query must be [1, 1, num_heads * head_size] (or q, k, v packed)", ORT_INVALID_ARGUMENT);
    const int64_t p = seqlens.GetTensorData<int32_t>()[0];
    if (p < 0 || p >= c)
      throw Ort::Exception("DecodeAttention: seqlens_k is outside the cache's capacity", ORT_INVALID_ARGUMENT);
    if (!packed && (!present(2) || ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetElementCount() != kvd ||
                    ctx.GetInput(2).GetTensorTypeAndShapeInfo().GetElementCount() != kvd))
      throw Ort::Exception("DecodeAttention: key and value must both be [1, 1, kv_num_heads * head_size]", ORT_INVALID_ARGUMENT);
    const float* qsrc = query.GetTensorData<float>();
    const float* ksrc = packed ? qsrc + hd : ctx.GetInput(1).GetTensorData<float>();
    const float* vsrc = packed ? qsrc + hd + kvd : ctx.GetInput(2).GetTensorData<float>();
    std::vector<float> q(qsrc, qsrc + hd), k(ksrc, ksrc + kvd);
    if (rotary != 0) {
      if (!present(7) || !present(8) || ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetElementCount() < (p + 1) * (d / 2) ||
          ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetElementCount() < (p + 1) * (d / 2))
        throw Ort::Exception("DecodeAttention: do_rotary needs cos_cache and sin_cache [positions, head_size / 2] past seqlens_k",
                             ORT_INVALID_ARGUMENT);
      const float* cos = ctx.GetInput(7).GetTensorData<float>() + p * (d / 2);
      const float* sin = ctx.GetInput(8).GetTensorData<float>() + p * (d / 2);
      rotate(q.data(), heads, d, cos, sin);
      rotate(k.data(), kv_heads, d, cos, sin);
    }
    const float* k_scale = nullptr;
    const float* v_scale = nullptr;
    if constexpr (std::is_same_v<T, int8_t>) {
      if (!present(9) || !present(10) || ctx.GetInput(9).GetTensorTypeAndShapeInfo().GetElementCount() != kvd ||
          ctx.GetInput(10).GetTensorTypeAndShapeInfo().GetElementCount() != kvd)
        throw Ort::Exception("DecodeAttentionInt8: k_scale and v_scale must be [1, kv_num_heads, 1, head_size]", ORT_INVALID_ARGUMENT);
      k_scale = ctx.GetInput(9).GetTensorData<float>();
      v_scale = ctx.GetInput(10).GetTensorData<float>();
    }
    Ort::UnownedValue out = ctx.GetOutput(0, std::vector<int64_t>{1, 1, hd});
    T* kc = ctx.GetOutput(1, cache).GetTensorMutableData<T>();
    T* vc = ctx.GetOutput(2, cache).GetTensorMutableData<T>();
    const size_t cache_size = static_cast<size_t>(kvd * c);
    if (kc != past_k.GetTensorData<T>()) std::copy(past_k.GetTensorData<T>(), past_k.GetTensorData<T>() + cache_size, kc);
    if (vc != past_v.GetTensorData<T>()) std::copy(past_v.GetTensorData<T>(), past_v.GetTensorData<T>() + cache_size, vc);
    for (int64_t i = 0; i < kvd; ++i) {  // the token's K and V row, at position p of each KV head
      T* kd = kc + ((i / d) * c + p) * d + i % d;
      T* vd = vc + ((i / d) * c + p) * d + i % d;
      if constexpr (std::is_same_v<T, int8_t>) {
        *kd = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, std::nearbyint(k[i] / k_scale[i]))));
        *vd = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, std::nearbyint(vsrc[i] / v_scale[i]))));
      } else {
        *kd = k[i];
        *vd = vsrc[i];
      }
    }
    if constexpr (std::is_same_v<T, int8_t>)  // q . (codes * scale) = (q * scale) . codes
      for (int64_t h = 0; h < heads; ++h)
        for (int64_t j = 0; j < d; ++j) q[h * d + j] *= k_scale[(h / (heads / kv_heads)) * d + j];
    const int64_t total = p + 1, start = window > 0 ? std::max<int64_t>(0, total - window) : 0;
    const int64_t group = heads / kv_heads, blocks = (total - start + kPositions - 1) / kPositions;
    std::vector<float> m(static_cast<size_t>(heads * blocks)), l(m.size()), o(m.size() * static_cast<size_t>(d));
    AttentionJob<T> job{q.data(), kc, vc, v_scale, group, c, d, start, total, blocks, scale, m.data(), l.data(), o.data()};
    const size_t tasks = static_cast<size_t>(kv_heads * blocks);
    if (tasks > 1 && (total - start) * d * heads >= kAttentionParallel)
      ctx.ParallelFor(attend_block<T>, tasks, 0, &job);
    else
      for (size_t t = 0; t < tasks; ++t) attend_block<T>(&job, t);
    // the blocks merged per head: rescaled to the largest maximum, normalised by the total sum
    float* y = out.GetTensorMutableData<float>();
    for (int64_t h = 0; h < heads; ++h) {
      const float* mh = m.data() + h * blocks;
      const float top = *std::max_element(mh, mh + blocks);
      float sum = 0.0f;
      float* yh = y + h * d;
      std::fill(yh, yh + d, 0.0f);
      for (int64_t b = 0; b < blocks; ++b) {
        const float f = std::exp(mh[b] - top);
        sum += f * l[h * blocks + b];
        const float* ob = o.data() + (h * blocks + b) * d;
        for (int64_t j = 0; j < d; ++j) yh[j] += f * ob[j];
      }
      const float inv = 1.0f / sum;
      for (int64_t j = 0; j < d; ++j) yh[j] *= inv;
    }
  }
};

template <typename T>
struct DecodeAttentionOp : Ort::CustomOpBase<DecodeAttentionOp<T>, AttentionKernel<T>> {
  static constexpr bool kInt8 = std::is_same_v<T, int8_t>;
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new AttentionKernel<T>(api, info); }
  const char* GetName() const { return kInt8 ? "DecodeAttentionInt8" : "DecodeAttention"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInt8 ? 11 : 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    if ((i == 3 || i == 4) && kInt8) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 || i == 2 || i == 7 || i == 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i > 0 && kInt8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
};

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain> domains;  // alive as long as the library: sessions refer to them

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static const ShadowCorrectionOp shadow_correction;
  static const DecodeAttentionOp<float> decode_attention;
  static const DecodeAttentionOp<int8_t> decode_attention_int8;
  try {
    Ort::CustomOpDomain domain{"ai.llmc"};
    domain.Add(&shadow_correction);
    domain.Add(&decode_attention);
    domain.Add(&decode_attention_int8);
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
