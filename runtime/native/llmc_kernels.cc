// llmc's native CPU kernels: an ONNX Runtime custom-op library (domain "ai.llmc"): ShadowCorrection,
// DecodeAttention (and DecodeAttentionInt8, DecodeAttentionFloat16), SwiGLU, RMSNorm, BlockQMatMul and W8A8MatMul (below).
//
// ShadowCorrection(x[..., K], wt[K, N], base[..., N]?, residual[..., N]?; lo, hi, gate?, up?, width?, scale?, zero_point?)
//   -> y[..., N] (with gate, up and width: y[..., width], codes[..., width]?)
//
//   y = residual + (base + (x - clip(x, lo, hi)) @ wt)
//
// (residual: the residual stream a block's last projection adds to, so that the add is not a pass of its own)
// With SwiGLU's attributes (gate, up, width; scale and zero_point for a codes output; no residual) y is SwiGLU's of
// that result (see SwiGLU below): a task then takes whole rows, each into a row buffer of its thread and SwiGLU's of
// it (and its codes) into the outputs while it is in cache, so a gated MLP's gate/up result is never written out.
// The float part of a W8A8 projection with shadow outliers: x's entries outside [lo, hi] are the
// outliers, about 1% of a row, and each adds its excess times one row of the float weight table.
// The graph-level form (llmc.backends.onnx_backend) gathers every channel that any row of a block
// has an outlier in and multiplies densely; this kernel visits each row's own outliers only:
// R * k * N multiply-adds for k outliers a row, instead of R * M * N for a block's union of M.
//
// The work is split into tasks, a block of rows by a group of column tiles (at most kTile columns each, the
// tiles of a row of even widths in whole vectors), run on ONNX Runtime's intra-op threads. A task first finds
// its rows' outliers, 16 entries at a time (a mask of compares, with AVX-512), so that no thread scans a chunk's
// rows while the others wait (a few rows are scanned before the tasks, their outlier count deciding the threads).
// It then takes its rows one at a time and each row's tiles in turn: a tile sums the row's outliers' weight-row
// slices in order of channel in vector registers, then adds base, so the output is written once and each row's
// base, residual and output are read and written in address order; the weight rows of a block's outlier
// channels tend to stay in cache across its rows. (Tasks of a column tile by a block of rows, visiting each row
// in slices of kTile columns, spent 25-40% more time on a 512-token prefill.) A NaN entry of x is an outlier
// (its excess is NaN), as in the graph form.
//
// Built by `llmc kernels build` (llmc.runtime.native) against ONNX Runtime's C/C++ API headers;
// it calls ONNX Runtime only through the API table it is registered with, so it links to no
// ONNX Runtime library.

#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// Output columns per tile, summed in vector registers: with AVX-512, 256 (16 of its 32 registers; 1 KiB of a
// weight row, of an output row); with AVX, 96 (12 of its 16); else 48.
#if defined(__AVX512F__)
constexpr int64_t kTile = 256;
#elif defined(__AVX__)
constexpr int64_t kTile = 96;
#else
constexpr int64_t kTile = 48;
#endif

constexpr int64_t kScan = 64;  // x entries tested at once for an outlier without AVX (branch-free, then one at a time)
constexpr int64_t kMaskLanes = 16;  // entries compared to a mask at once: with AVX-512 16, with AVX 8
constexpr int64_t kTasks = 8;  // tasks to aim for (the row-blocked ops)
constexpr int64_t kShadowTasks = 16;  // ShadowCorrection's: row blocks times groups of column tiles
constexpr size_t kParallelWork = 1 << 16;  // multiply-adds (or their estimate) below which one thread does it all
constexpr int64_t kAttentionParallel = 1 << 15;  // attended positions x head size x heads below which one thread does it all

// Rows of a [..., n] input in blocks of per rows (set here) over ONNX Runtime's threads (at most kTasks blocks),
// or on this thread when small.
void for_rows(Ort::KernelContext& ctx, void (*fn)(void*, size_t), void* job, int64_t rows, int64_t n, int64_t& per) {
  if (rows == 0) return;  // (a chunk's rows that need logits may be none)
  const int64_t tasks = std::max<int64_t>(1, std::min<int64_t>(rows, kTasks));
  per = (rows + tasks - 1) / tasks;
  const size_t count = static_cast<size_t>((rows + per - 1) / per);
  if (count > 1 && rows * n >= kAttentionParallel)
    ctx.ParallelFor(fn, count, 0, job);
  else
    for (size_t t = 0; t < count; ++t) fn(job, t);
}

// The rows of a [..., n] tensor: the product of its leading dimensions.
inline int64_t leading_rows(const std::vector<int64_t>& shape) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  return rows;
}

// v with room for n elements at least: grown when smaller, never shrunk (a buffer kept across calls).
template <typename T>
inline void grow(std::vector<T>& v, int64_t n) {
  if (v.size() < static_cast<size_t>(n)) v.resize(static_cast<size_t>(n));
}

struct Outliers {  // by row: row r's outlier channels and excesses are [start[r], start[r + 1])
  std::vector<int64_t> start;  // [rows + 1]
  std::vector<int32_t> channel;
  std::vector<float> excess;
};

// Row r's entries [c0, c1) outside [lo, hi] (or NaN) appended to out, one at a time.
inline void scan_scalar(const float* xr, int64_t c0, int64_t c1, float lo, float hi, Outliers& out) {
  for (int64_t c = c0; c < c1; ++c) {
    const float v = xr[c];
    if (!(v >= lo && v <= hi)) {  // outside, or NaN
      out.channel.push_back(static_cast<int32_t>(c));
      out.excess.push_back(v - (v < lo ? lo : (v > hi ? hi : v)));
    }
  }
}

// Rows [0, rows) of x [rows, k]: their outliers into out (start indexed from x's first row).
void find_outliers(const float* x, int64_t rows, int64_t k, float lo, float hi, Outliers& out) {
  out.start.assign(rows + 1, 0);
  out.channel.clear();
  out.excess.clear();
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * k;
    int64_t c0 = 0;
#if defined(__AVX512F__) || defined(__AVX__)
    // kMaskLanes (AVX: 8) entries at a time: a mask of those inside [lo, hi] (an ordered compare: NaN is
    // outside), then the positions of the others
#if defined(__AVX512F__)
    constexpr int64_t lanes = kMaskLanes;
    const __m512 vlo = _mm512_set1_ps(lo), vhi = _mm512_set1_ps(hi);
#else
    constexpr int64_t lanes = kMaskLanes / 2;
    const __m256 vlo = _mm256_set1_ps(lo), vhi = _mm256_set1_ps(hi);
#endif
    for (; c0 + lanes <= k; c0 += lanes) {
#if defined(__AVX512F__)
      const __m512 v = _mm512_loadu_ps(xr + c0);
      unsigned outside = static_cast<uint16_t>(~(_mm512_cmp_ps_mask(v, vlo, _CMP_GE_OQ) & _mm512_cmp_ps_mask(v, vhi, _CMP_LE_OQ)));
#else
      const __m256 v = _mm256_loadu_ps(xr + c0);
      unsigned outside = ~static_cast<unsigned>(_mm256_movemask_ps(_mm256_and_ps(_mm256_cmp_ps(v, vlo, _CMP_GE_OQ), _mm256_cmp_ps(v, vhi, _CMP_LE_OQ)))) & 0xffu;
#endif
      while (outside != 0) {
        const int64_t c = c0 + __builtin_ctz(outside);
        outside &= outside - 1;
        const float e = xr[c];
        out.channel.push_back(static_cast<int32_t>(c));
        out.excess.push_back(e - (e < lo ? lo : (e > hi ? hi : e)));
      }
    }
#else
    for (; c0 + kScan <= k; c0 += kScan) {
      int any = 0;  // branch-free
      for (int64_t c = c0; c < c0 + kScan; ++c) {
        const float v = xr[c];
        any |= static_cast<int>(v < lo) | static_cast<int>(v > hi) | static_cast<int>(v != v);
      }
      if (any != 0) scan_scalar(xr, c0, c0 + kScan, lo, hi, out);
    }
#endif
    scan_scalar(xr, c0, k, lo, hi, out);
    out.start[r + 1] = static_cast<int64_t>(out.channel.size());
  }
}

// An IEEE half's bits as a float (normal, subnormal, zero, infinity, NaN), for CPUs without F16C.
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  float magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa != 0 ? NAN : INFINITY;
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), -24);
  } else {
    const uint32_t bits = (exponent + 112) << 23 | mantissa << 13;
    std::memcpy(&magnitude, &bits, sizeof bits);
  }
  uint32_t out;
  std::memcpy(&out, &magnitude, sizeof out);
  out |= sign;
  std::memcpy(&magnitude, &out, sizeof out);
  return magnitude;
}

// A float as the nearest IEEE half (ties to even, as numpy's and F16C's conversions): overflow to infinity, NaN
// kept NaN, tiny values to subnormals or zero.
inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000);
  const uint32_t magnitude = bits & 0x7fffffff;
  if (magnitude > 0x7f800000) return sign | 0x7e00;            // NaN
  if (magnitude >= 0x477ff000) return sign | 0x7c00;           // 65520 and up (and infinity): infinity
  if (magnitude < 0x38800000) {                                // below 2^-14: a subnormal half (or zero)
    float m;
    std::memcpy(&m, &magnitude, sizeof m);
    return sign | static_cast<uint16_t>(std::nearbyint(m * 16777216.0f));  // in units of 2^-24, to even
  }
  // rebias the exponent (127 -> 15) and round the mantissa's 13 dropped bits to even
  return sign | static_cast<uint16_t>((magnitude + 0xfff + ((magnitude >> 13) & 1) - 0x38000000) >> 13);
#endif
}

// One cached element as a float: float32 as it is, float16 from its bits, an int8 code as its value.
inline float as_float(float x) { return x; }
inline float as_float(uint16_t x) { return half_to_float(x); }
inline float as_float(int8_t x) { return static_cast<float>(x); }

// The CPU's own vector of floats (kNative lanes: AVX-512 16, AVX 8, else 4), GCC's vector extension. The kernels'
// vectors are this wide: GCC keeps a vector wider than the CPU's registers in memory when it sits in an array
// (accumulators), moving it in 8-byte pieces (an AVX2 build's attention with 16-float vectors ran at 2 useful GFMA/s).
#if defined(__AVX512F__)
constexpr int64_t kNative = 16;
#elif defined(__AVX__)
constexpr int64_t kNative = 8;
#else
constexpr int64_t kNative = 4;
#endif
typedef float NVec __attribute__((vector_size(kNative * sizeof(float))));
typedef int32_t NIVec __attribute__((vector_size(kNative * sizeof(int32_t))));

inline NVec nload(const float* p) {
  NVec v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline void nstore(float* p, NVec v) { __builtin_memcpy(p, &v, sizeof v); }

// x in every lane: one broadcast (NVec{} + x would be an addition, 0 + -0 being +0).
inline NVec nsplat(float x) {
#if defined(__AVX512F__)
  return (NVec)_mm512_set1_ps(x);
#elif defined(__AVX__)
  return (NVec)_mm256_set1_ps(x);
#else
  return NVec{x, x, x, x};
#endif
}

// kNative entries from p on as floats: float32 as they are, float16 (their bits: the corrections' weight tables)
// and int8 codes (a quantized cache's rows; their per-channel scales are folded into q for K and applied to the
// output for V) widened with the CPU's instructions where there are some (GCC's generic widening is scalar code).
inline NVec nload16(const float* p) { return nload(p); }

inline NVec nload16(const uint16_t* p) {
#if defined(__AVX512F__)
  return (NVec)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX__) && defined(__F16C__)
  return (NVec)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  NVec v;
  for (int64_t l = 0; l < kNative; ++l) v[l] = half_to_float(p[l]);
  return v;
#endif
}

inline NVec nload16(const int8_t* p) {
#if defined(__AVX512F__)
  return (NVec)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#elif defined(__AVX2__)
  return (NVec)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
#else
  NVec v;
  for (int64_t l = 0; l < kNative; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

inline NVec nload16(const uint8_t* p) {  // uint8 codes offset by 128 (memory-budgeted bundles'), less the offset
#if defined(__AVX512F__)
  return (NVec)_mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))), _mm512_set1_ps(128.0f));
#elif defined(__AVX2__)
  return (NVec)_mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))), _mm256_set1_ps(128.0f));
#else
  NVec v;
  for (int64_t l = 0; l < kNative; ++l) v[l] = static_cast<float>(p[l]) - 128.0f;
  return v;
#endif
}

// An optional attribute, or fallback where it is absent. Through the C API, so that an absent one throws nothing
// (AddressSanitizer's preloaded runtime, which the tests use, cannot intercept a C++ throw).
template <typename V>
V attribute_or(const Ort::ConstKernelInfo& ki, const char* name, V fallback) {
  V value = fallback;
  const OrtKernelInfo* info = ki;
  OrtStatus* status;
  if constexpr (std::is_same_v<V, float>)
    status = Ort::GetApi().KernelInfoGetAttribute_float(info, name, &value);
  else
    status = Ort::GetApi().KernelInfoGetAttribute_int64(info, name, &value);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return fallback;
  }
  return value;
}

// An optional list of integers, empty where it is absent (through the C API, as attribute_or).
std::vector<int64_t> ints_or_empty(const Ort::ConstKernelInfo& ki, const char* name) {
  const OrtKernelInfo* info = ki;
  size_t size = 0;
  OrtStatus* status = Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, nullptr, &size);
  if (status != nullptr) {
    Ort::GetApi().ReleaseStatus(status);
    return {};
  }
  std::vector<int64_t> out(size);
  if (size > 0) Ort::ThrowOnError(Ort::GetApi().KernelInfoGetAttributeArray_int64(info, name, out.data(), &size));
  return out;
}

// The uint8 codes of a W8A8 projection's input, as ONNX QuantizeLinear computes them (see the quantized copies below).
struct Quantizer {
  float scale = 0.0f;
  int32_t zero_point = 0;
  bool on = false;  // whether the op has the codes output

  // The codes output (output 1) of this shape, or null when the op has none.
  uint8_t* output(Ort::KernelContext& ctx, const std::vector<int64_t>& shape) const {
    return on ? ctx.GetOutput(1, shape.data(), shape.size()).GetTensorMutableData<uint8_t>() : nullptr;
  }
};

Quantizer quantizer_of(const Ort::ConstKernelInfo& ki, const char* op) {
  Quantizer q;
  q.on = ki.GetOutputCount() > 1;
  if (!q.on) return q;
  q.scale = ki.GetAttribute<float>("scale");
  q.zero_point = static_cast<int32_t>(ki.GetAttribute<int64_t>("zero_point"));
  if (!(q.scale > 0.0f) || q.zero_point < 0 || q.zero_point > 255)
    throw Ort::Exception(std::string(op) + ": codes need a positive scale and a zero_point in 0..255", ORT_INVALID_ARGUMENT);
  return q;
}

void quantize_row(const float* y, int64_t n, const Quantizer& q, uint8_t* out) {
  const float lo = static_cast<float>(-q.zero_point), hi = static_cast<float>(255 - q.zero_point);
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 s = _mm512_set1_ps(q.scale), l = _mm512_set1_ps(lo), h = _mm512_set1_ps(hi);
  const __m512i z = _mm512_set1_epi32(q.zero_point);
  for (; j + 16 <= n; j += 16) {  // max/min return their second operand for a NaN: lo, then 0
    const __m512 v = _mm512_min_ps(_mm512_max_ps(_mm512_div_ps(_mm512_loadu_ps(y + j), s), l), h);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + j), _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(v), z)));
  }
#elif defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(q.scale), l = _mm256_set1_ps(lo), h = _mm256_set1_ps(hi);
  const __m256i z = _mm256_set1_epi32(q.zero_point);
  for (; j + 8 <= n; j += 8) {
    const __m256 v = _mm256_min_ps(_mm256_max_ps(_mm256_div_ps(_mm256_loadu_ps(y + j), s), l), h);
    const __m256i c = _mm256_add_epi32(_mm256_cvtps_epi32(v), z);
    const __m128i w = _mm_packus_epi32(_mm256_castsi256_si128(c), _mm256_extracti128_si256(c, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(out + j), _mm_packus_epi16(w, w));
  }
#endif
  for (; j < n; ++j) {
    float v = y[j] / q.scale;
    v = v > lo ? v : lo;
    v = v < hi ? v : hi;
    out[j] = static_cast<uint8_t>(static_cast<int32_t>(std::nearbyint(v)) + q.zero_point);
  }
}

void swiglu_row(const float* g, const float* u, int64_t width, float* y);  // SwiGLU's, below

// SwiGLU after a correction (ShadowCorrection's attributes gate, up, width; gate < 0: none): each corrected row's
// SwiGLU is the output, and its codes (may be null) a second one.
struct SwigluAfter {
  int64_t gate = -1, up = -1, width = 0;
  const Quantizer* quant = nullptr;
  uint8_t* codes = nullptr;
};

inline float load1(const float* p) { return *p; }
inline float load1(const uint16_t* p) { return half_to_float(*p); }
inline float load1(const int8_t* p) { return static_cast<float>(*p); }
inline float load1(const uint8_t* p) { return static_cast<float>(*p) - 128.0f; }

// A correction's weight table [K, N]: float32 or float16 rows as they are (a hand-made graph's), or a projection's
// int8 codes (uint8 offset by 128) whose sums each column's scale multiplies, the hot channels' outliers then adding
// their rows of hot_delta (the float weights less the codes' values) on top.
struct Table {
  const void* data = nullptr;
  ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  const float* scale = nullptr;      // [N]: int8 and uint8 codes'
  const float* hot_delta = nullptr;  // [hot, N]
  const int32_t* hot_pos = nullptr;  // [hot_n]: channel -> its row of hot_delta, or -1
  int64_t hot_n = 0;

  bool codes() const { return type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 || type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8; }
  size_t element_bytes() const { return codes() ? 1 : type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? 2 : 4; }
  int32_t hot(int32_t channel) const { return channel < hot_n ? hot_pos[channel] : -1; }
};

// The hot channels' rows of hot_delta by channel (a kernel's, from the attribute hot_channels): -1 for the others.
std::vector<int32_t> hot_positions(const std::vector<int64_t>& hot, const char* op) {
  int64_t most = -1;
  for (int64_t c : hot) {
    if (c < 0) throw Ort::Exception((std::string(op) + ": hot_channels must be channels of x (0 or more)").c_str(), ORT_INVALID_ARGUMENT);
    most = std::max(most, c);
  }
  std::vector<int32_t> pos(static_cast<size_t>(most + 1), -1);
  for (size_t i = 0; i < hot.size(); ++i) pos[static_cast<size_t>(hot[i])] = static_cast<int32_t>(i);
  return pos;
}

template <typename W>
struct Job {
  // the rows' outliers, found before the tasks; or null, and each task finds its own rows' (x's, outside [lo, hi])
  // into blocks[task], start indexed from its first row
  const Outliers* outliers;
  Outliers* blocks;
  const float* x;
  int64_t k;
  float lo, hi;
  const W* wt;
  const float* base;      // may be null
  const float* residual;  // may be null
  float* y;               // [rows, n]; with swiglu, [rows, swiglu.width] (SwiGLU's of the corrected rows)
  int64_t rows, n, tiles, width;  // width: columns per tile, a multiple of kNative (the last tile may be narrower)
  int64_t block_rows, group_tiles, groups;  // a task's rows and tiles (the last block's and group's may be fewer)
  SwigluAfter swiglu;
  const Table* table = nullptr;  // wt's scales and hot rows (codes), or null (a float table)
};

// Row r of the output's columns [n0, n0 + NV * kNative), its outliers row `at` of o: their weight-row slices,
// scaled and summed in order of channel in NV vector registers, then added to base; the output row (y's, or the row
// buffer SwiGLU reads) is written once.
template <int NV, typename W>
void tile_row(const Job<W>& job, const Outliers& o, int64_t at, int64_t r, int64_t n0, float* row) {
  NVec acc[NV] = {};
  for (int64_t i = o.start[at]; i < o.start[at + 1]; ++i) {
    const NVec d = nsplat(o.excess[i]);
    const W* wr = job.wt + static_cast<int64_t>(o.channel[i]) * job.n + n0;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[v] += d * nload16(wr + v * kNative);
  }
  if (const Table* t = job.table; t != nullptr && t->scale != nullptr) {  // codes: their sums scaled, then the hot rows
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) acc[v] *= nload(t->scale + n0 + v * kNative);
    for (int64_t i = t->hot_n > 0 ? o.start[at] : o.start[at + 1]; i < o.start[at + 1]; ++i) {
      const int32_t h = t->hot(o.channel[i]);
      if (h < 0) continue;
      const NVec d = nsplat(o.excess[i]);
      const float* hr = t->hot_delta + static_cast<int64_t>(h) * job.n + n0;
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) acc[v] += d * nload(hr + v * kNative);
    }
  }
  float* yr = row + n0;
  if (job.residual != nullptr) {
    const float* br = job.base + r * job.n + n0;
    const float* rr = job.residual + r * job.n + n0;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) nstore(yr + v * kNative, nload(rr + v * kNative) + (nload(br + v * kNative) + acc[v]));
  } else if (job.base != nullptr) {
    const float* br = job.base + r * job.n + n0;
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) nstore(yr + v * kNative, nload(br + v * kNative) + acc[v]);
  } else {
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) nstore(yr + v * kNative, acc[v]);
  }
}

template <typename W, int... NV>
constexpr auto tile_kernels(std::integer_sequence<int, NV...>) {
  return std::array<void (*)(const Job<W>&, const Outliers&, int64_t, int64_t, int64_t, float*), sizeof...(NV)>{&tile_row<NV + 1, W>...};
}

// Row r's columns [n0, n1), one at a time (those past the last whole vector of a row), its outliers row `at` of o.
template <typename W>
void tail_row(const Job<W>& job, const Outliers& o, int64_t at, int64_t r, int64_t n0, int64_t n1, float* row) {
  for (int64_t j = n0; j < n1; ++j) {
    float acc = 0.0f;
    for (int64_t i = o.start[at]; i < o.start[at + 1]; ++i) acc += o.excess[i] * load1(job.wt + static_cast<int64_t>(o.channel[i]) * job.n + j);
    if (const Table* t = job.table; t != nullptr && t->scale != nullptr) {
      acc *= t->scale[j];
      for (int64_t i = t->hot_n > 0 ? o.start[at] : o.start[at + 1]; i < o.start[at + 1]; ++i)
        if (const int32_t h = t->hot(o.channel[i]); h >= 0) acc += o.excess[i] * t->hot_delta[static_cast<int64_t>(h) * job.n + j];
    }
    const int64_t e = r * job.n + j;
    const float y = job.base != nullptr ? job.base[e] + acc : acc;  // the correction added to base, then to the residual
    row[j] = job.residual != nullptr ? job.residual[e] + y : y;
  }
}

// Task t: the rows of row block t / groups, the columns of tile group t % groups; a row at a time, its tiles in
// turn, so that each row's base, residual and output are read and written in address order. With SwiGLU after the
// correction (one group: whole rows), a row goes to this thread's row buffer, and SwiGLU's of it to the output.
template <typename W>
void run_task(void* data, size_t t) {
  static constexpr auto kernels = tile_kernels<W>(std::make_integer_sequence<int, kTile / kNative>{});
  const Job<W>& job = *static_cast<const Job<W>*>(data);
  const int64_t block = static_cast<int64_t>(t) / job.groups, group = static_cast<int64_t>(t) % job.groups;
  const int64_t r0 = block * job.block_rows, r1 = std::min(job.rows, r0 + job.block_rows);
  const int64_t t0 = group * job.group_tiles, t1 = std::min(job.tiles, t0 + job.group_tiles);
  const Outliers* o = job.outliers;
  int64_t first = 0;  // the row that o's start indexes from
  if (o == nullptr) {  // the task's rows' outliers, found here (by each of the row block's tasks)
    find_outliers(job.x + r0 * job.k, r1 - r0, job.k, job.lo, job.hi, job.blocks[t]);
    o = &job.blocks[t];
    first = r0;
  }
  const auto& sw = job.swiglu;
  thread_local std::vector<float> whole;  // a corrected row that SwiGLU reads (in cache: 12 KB for SmolLM2's gate/up)
  if (sw.gate >= 0) grow(whole, job.n);
  for (int64_t r = r0; r < r1; ++r) {
    float* row = sw.gate >= 0 ? whole.data() : job.y + r * job.n;
    for (int64_t tile = t0; tile < t1; ++tile) {
      const int64_t n0 = tile * job.width, n1 = std::min(job.n, n0 + job.width), vecs = (n1 - n0) / kNative;
      if (vecs > 0) kernels[vecs - 1](job, *o, r - first, r, n0, row);
      if (n0 + vecs * kNative < n1) tail_row(job, *o, r - first, r, n0 + vecs * kNative, n1, row);
    }
    if (sw.gate >= 0) {
      float* y = job.y + r * sw.width;
      swiglu_row(row + sw.gate, row + sw.up, sw.width, y);
      if (sw.codes != nullptr) quantize_row(y, sw.width, *sw.quant, sw.codes + r * sw.width);
    }
  }
}

// y = residual + (base + (x - clip(x, lo, hi)) @ wt) for x [rows, k]: outliers holds x's outliers, found before; or,
// when it is null, each task finds its own rows' (a chunk's; no serial scan before the tasks, which read 256 rows of
// 1,536 on one thread while the others waited), or, for fewer than kShadowTasks rows, they are found here first.
// With swiglu (gate >= 0) y is SwiGLU's of those rows, [rows, swiglu.width], and a task takes whole rows (one group of
// tiles): fewer rows than kShadowTasks then make fewer tasks (a partial chunk's few rows; a chunk's 256 make 16).
// The tasks a correction of rows x n is cut into (a Job's tiles, width, block_rows, group_tiles and groups).
struct Tiling {
  int64_t tiles, width, block_rows, group_tiles, groups;
  size_t tasks;
};

inline Tiling correction_tiling(int64_t rows, int64_t n, bool whole_rows) {
  // columns in as few tiles of at most kTile as there can be, of even widths (whole vectors but the last's end)
  const int64_t most = (n + kTile - 1) / kTile;
  const int64_t width = ((n + most - 1) / most + kNative - 1) / kNative * kNative, tiles = (n + width - 1) / width;
  // about kShadowTasks blocks of rows (a chunk's), or one a row where there are fewer, each cut into groups of
  // tiles to make up at least kShadowTasks tasks (a prompt's last row through the LM head: its 49,152 columns in 16
  // groups); blocks and groups of equal size but the last, none empty
  const int64_t block_rows = (rows + kShadowTasks - 1) / kShadowTasks, row_blocks = (rows + block_rows - 1) / block_rows;
  const int64_t want = whole_rows ? 1 : std::min(tiles, (kShadowTasks + row_blocks - 1) / row_blocks);
  const int64_t group_tiles = (tiles + want - 1) / want, groups = (tiles + group_tiles - 1) / group_tiles;
  return {tiles, width, block_rows, group_tiles, groups, static_cast<size_t>(row_blocks * groups)};
}

template <typename W>
void correct_with(Ort::KernelContext& ctx, const Outliers* outliers, const float* x, int64_t k, float lo, float hi, const Table& table,
                  const float* base, const float* residual, float* y, int64_t rows, int64_t n, const SwigluAfter& swiglu) {
  const W* wt = static_cast<const W*>(table.data);
  if (rows == 0 || n == 0) return;  // an empty result
  const Tiling tiling = correction_tiling(rows, n, swiglu.gate >= 0);  // SwiGLU: whole rows
  const size_t tasks = tiling.tasks;
  thread_local Outliers found;             // the caller's: a few rows' outliers
  thread_local std::vector<Outliers> own;  // the caller's: each task's outliers, where the tasks find them
  if (outliers == nullptr && rows < kShadowTasks) {  // a few rows (the prompt's last, say): found first, and their count decides the threads
    find_outliers(x, rows, k, lo, hi, found);
    outliers = &found;
  }
  if (outliers == nullptr && own.size() < tasks) own.resize(tasks);
  Job<W> job{outliers, outliers == nullptr ? own.data() : nullptr, x, k, lo, hi, wt, base, residual, y, rows, n, tiling.tiles, tiling.width,
             tiling.block_rows, tiling.group_tiles, tiling.groups, swiglu, &table};
  // the correction's multiply-adds, or, before the outliers are found, their estimate: about 1% of x's entries
  // (calibration's clip at the 99th percentile), and a row's read of x and write of y
  const size_t work = outliers != nullptr ? outliers->channel.size() * static_cast<size_t>(n)
                                          : static_cast<size_t>(rows * (k + n * (k / 100 + 1)));
  if (tasks > 1 && work >= kParallelWork)
    ctx.ParallelFor(run_task<W>, tasks, 0, &job);
  else
    for (size_t t = 0; t < tasks; ++t) run_task<W>(&job, t);
}

// The Job of one decode row's correction into sums (W8A8MatMul's packed path: no base or residual).
template <typename W>
Job<W> decode_job(const Outliers& o, const float* xs, int64_t k, float lo, float hi, const Table& table, float* sums, int64_t n, const Tiling& tiling) {
  return Job<W>{&o, nullptr, xs, k, lo, hi, static_cast<const W*>(table.data), nullptr, nullptr, sums, 1, n,
                tiling.tiles, tiling.width, tiling.block_rows, tiling.group_tiles, tiling.groups, {}, &table};
}

// correct_with for the table's element type.
void correct(Ort::KernelContext& ctx, const Outliers* outliers, const float* x, int64_t k, float lo, float hi, const Table& table,
             const float* base, const float* residual, float* y, int64_t rows, int64_t n, const SwigluAfter& swiglu = {}) {
  switch (table.type) {
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16: return correct_with<uint16_t>(ctx, outliers, x, k, lo, hi, table, base, residual, y, rows, n, swiglu);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8: return correct_with<int8_t>(ctx, outliers, x, k, lo, hi, table, base, residual, y, rows, n, swiglu);
    case ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8: return correct_with<uint8_t>(ctx, outliers, x, k, lo, hi, table, base, residual, y, rows, n, swiglu);
    default: return correct_with<float>(ctx, outliers, x, k, lo, hi, table, base, residual, y, rows, n, swiglu);
  }
}

// The table of a correction: wt [k, n] (float32, float16, int8 or uint8), with integer codes its column scales
// [n] and, for hot channels (hot_pos, from the attribute), hot_delta [hot, n]; `op` names the op in errors.
Table table_of(Ort::ConstValue wt, const OrtValue* scale_value, const OrtValue* hot_value, const std::vector<int32_t>& hot_pos, int64_t hot,
               int64_t k, int64_t n, const char* op) {
  Table t;
  t.data = wt.GetTensorRawData();
  t.type = wt.GetTensorTypeAndShapeInfo().GetElementType();
  const std::string name(op);
  if (t.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT && t.type != ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 && !t.codes())
    throw Ort::Exception((name + ": wt (the outliers' weight table) must be float32, float16, int8 or uint8").c_str(), ORT_INVALID_ARGUMENT);
  if (!t.codes()) {
    if (scale_value != nullptr || hot > 0)
      throw Ort::Exception((name + ": a float weight table takes no wt_scale, hot_delta or hot_channels").c_str(), ORT_INVALID_ARGUMENT);
    return t;
  }
  if (scale_value == nullptr || Ort::ConstValue{scale_value}.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n))
    throw Ort::Exception((name + ": int8 or uint8 codes (wt) need wt_scale, one scale per column [N]").c_str(), ORT_INVALID_ARGUMENT);
  t.scale = Ort::ConstValue{scale_value}.GetTensorData<float>();
  if (hot > 0) {
    if (hot_value == nullptr || Ort::ConstValue{hot_value}.GetTensorTypeAndShapeInfo().GetShape() != std::vector<int64_t>{hot, n})
      throw Ort::Exception((name + ": hot_channels need hot_delta [hot channels, N]").c_str(), ORT_INVALID_ARGUMENT);
    if (static_cast<int64_t>(hot_pos.size()) > k)
      throw Ort::Exception((name + ": hot_channels must be channels of x (below K)").c_str(), ORT_INVALID_ARGUMENT);
    t.hot_delta = Ort::ConstValue{hot_value}.GetTensorData<float>();
    t.hot_pos = hot_pos.data();
    t.hot_n = static_cast<int64_t>(hot_pos.size());
  } else if (hot_value != nullptr) {
    throw Ort::Exception((name + ": hot_delta comes with hot_channels").c_str(), ORT_INVALID_ARGUMENT);
  }
  return t;
}

struct ShadowKernel {
  float lo, hi;
  int64_t gate, up, width;  // SwiGLU's attributes: its result of the corrected rows is the output (gate < 0: none)
  Quantizer quant;          // and its codes (a second output)
  int64_t hot = 0;          // hot channels (attribute hot_channels) and their rows of hot_delta by channel
  std::vector<int32_t> hot_pos;

  ShadowKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    lo = ki.GetAttribute<float>("lo");
    hi = ki.GetAttribute<float>("hi");
    gate = attribute_or<int64_t>(ki, "gate", -1);
    up = attribute_or<int64_t>(ki, "up", -1);
    width = attribute_or<int64_t>(ki, "width", 0);
    if ((gate >= 0 || up >= 0 || width > 0) && !(gate >= 0 && up >= 0 && width > 0))
      throw Ort::Exception("ShadowCorrection: SwiGLU's gate, up and width come together (columns of the result, width positive), or none",
                           ORT_INVALID_ARGUMENT);
    quant = quantizer_of(ki, "ShadowCorrection");
    if (quant.on && gate < 0)
      throw Ort::Exception("ShadowCorrection: a codes output needs SwiGLU's attributes (the codes are of SwiGLU's result)", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> channels = ints_or_empty(ki, "hot_channels");
    hot = static_cast<int64_t>(channels.size());
    hot_pos = hot_positions(channels, "ShadowCorrection");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    Ort::ConstValue wt = ctx.GetInput(1);
    const OrtValue* base_value = ctx.GetInputCount() > 2 ? static_cast<const OrtValue*>(ctx.GetInput(2)) : nullptr;
    const OrtValue* residual_value = ctx.GetInputCount() > 3 ? static_cast<const OrtValue*>(ctx.GetInput(3)) : nullptr;
    const OrtValue* scale_value = ctx.GetInputCount() > 4 ? static_cast<const OrtValue*>(ctx.GetInput(4)) : nullptr;
    const OrtValue* hot_value = ctx.GetInputCount() > 5 ? static_cast<const OrtValue*>(ctx.GetInput(5)) : nullptr;
    std::vector<int64_t> xs = x.GetTensorTypeAndShapeInfo().GetShape();
    std::vector<int64_t> ws = wt.GetTensorTypeAndShapeInfo().GetShape();
    if (xs.empty() || ws.size() != 2 || ws[0] != xs.back())
      throw Ort::Exception("ShadowCorrection: x must be [..., K] and wt [K, N] with the same K", ORT_INVALID_ARGUMENT);
    const int64_t k = ws[0], n = ws[1];
    const Table table = table_of(wt, scale_value, hot_value, hot_pos, hot, k, n, "ShadowCorrection");
    const int64_t rows = leading_rows(xs);
    std::vector<int64_t> ys(xs.begin(), xs.end() - 1);
    ys.push_back(n);
    if (gate >= 0 && std::max(gate, up) > n - width)
      throw Ort::Exception("ShadowCorrection: SwiGLU's gate and up columns (width of each) must lie inside wt's N", ORT_INVALID_ARGUMENT);
    const float* base = nullptr;
    if (base_value != nullptr) {
      Ort::ConstValue b{base_value};
      if (b.GetTensorTypeAndShapeInfo().GetShape() != ys)
        throw Ort::Exception("ShadowCorrection: base must be [..., N], x's rows by wt's columns", ORT_INVALID_ARGUMENT);
      base = b.GetTensorData<float>();
    }
    const float* residual = nullptr;
    if (residual_value != nullptr) {
      Ort::ConstValue b{residual_value};
      if (base == nullptr || b.GetTensorTypeAndShapeInfo().GetShape() != ys)
        throw Ort::Exception("ShadowCorrection: residual must come with base, both [..., N]", ORT_INVALID_ARGUMENT);
      if (gate >= 0)  // a gated MLP's gate/up projection adds no residual stream
        throw Ort::Exception("ShadowCorrection: a residual and SwiGLU's attributes do not come together", ORT_INVALID_ARGUMENT);
      residual = b.GetTensorData<float>();
    }
    std::vector<int64_t> shape = ys;  // the output's: SwiGLU's width with SwiGLU after the correction
    if (gate >= 0) shape.back() = width;
    Ort::UnownedValue y = ctx.GetOutput(0, shape.data(), shape.size());
    float* out = y.GetTensorMutableData<float>();
    const float* xd = x.GetTensorData<float>();
    const SwigluAfter swiglu{gate, up, width, &quant, quant.output(ctx, shape)};
    correct(ctx, nullptr, xd, k, lo, hi, table, base, residual, out, rows, n, swiglu);
  }
};

struct ShadowCorrectionOp : Ort::CustomOpBase<ShadowCorrectionOp, ShadowKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new ShadowKernel(api, info); }
  const char* GetName() const { return "ShadowCorrection"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }  // x, wt, base?, residual?, wt_scale?, hot_delta?
  ONNXTensorElementDataType GetInputType(size_t i) const {  // wt: float32, float16, int8 or uint8 (checked when it runs)
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 2 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 2; }  // y, and with SwiGLU's attributes its codes (optional)
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

// ---------------------------------------------------------------------------------------------------
// DecodeAttention: the decode graph's attention over a bound KV cache, GroupQueryAttention's signature
//
//   (query, key?, value?, past_key, past_value, seqlens_k, total_sequence_length, cos_cache?, sin_cache?)
//     -> (output [1, S, H*D], present_key, present_value)
//
// query is [1, S, H*D], or q/k/v packed [1, S, (H + 2*KV)*D] with key and value omitted (or either without the
// leading 1, [S, ...], and then the output is [S, H*D]: the backend's rows as they are); the caches are
// [1, KV, C, D] float32, present bound to past's memory (else past is copied first); seqlens_k [1] is the
// cache length after the rows minus one: the S rows land at positions p0 = seqlens_k - S + 1 to seqlens_k.
// With do_rotary, q and k are rotated there (rotate-half, cos/sin [C, D/2]). A row at position p attends
// over [start, p], start = p + 1 - local_window_size when one is set. One row (decode): tasks on ONNX
// Runtime's pool are a KV head by a block of kPositions positions: all its query heads' scores, softmax
// terms and weighted V rows, which one pass over the tasks' maxima and sums then merges (as split-K
// "flash decoding" does). More rows (a prompt's chunk): attend_chunk below. With bf16=1 (the backend sets it in
// W8A8 programs, whose attention output is o_proj's 8-bit input) a chunk's products are bfloat16 ones with float32
// sums on a CPU with AVX512_BF16 (vdpbf16ps): the queries, keys, values and softmax terms are rounded to bfloat16
// (LLMC_ATTN_BF16=0 keeps float32). One row stays float32: it is bound by reading the cache, not by multiplying.

// e^x for x <= 87 (scores minus their maximum, minus a gate), a vector at a time: x = n ln2 + r with
// |r| <= ln2 / 2, e^r by its Taylor polynomial to r^6 (relative error about 1e-7), 2^n into the exponent bits;
// below -87, e^-87.
inline NVec vexp(NVec x) {
  const NVec floor_x = nsplat(-87.0f);
  x = x < floor_x ? floor_x : x;
  const NVec round = nsplat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const NVec n = (x * 1.44269504f + round) - round;
  const NVec r = (x - n * 0.693145752f) - n * 1.42860677e-6f;  // ln 2 in two parts
  NVec e = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
  const NIVec bits = (NIVec)e + (__builtin_convertvector(n, NIVec) << 23);
  return (NVec)bits;
}

// A vector's largest lane, whether any lane of a compare's mask is set, and the sum of its lanes: with AVX-512 in
// halves (four levels; GCC makes a chain of 15 dependent scalar steps of the loops below).
inline float hmax(NVec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps((__m512)v);
#else
  float t = v[0];
  for (int64_t l = 1; l < kNative; ++l) t = std::max(t, v[l]);
  return t;
#endif
}

inline bool any_lane(NIVec v) {
#if defined(__AVX512F__)
  return _mm512_test_epi32_mask((__m512i)v, (__m512i)v) != 0;
#else
  bool any = false;
  for (int64_t l = 0; l < kNative; ++l) any |= v[l] != 0;
  return any;
#endif
}

inline float hsum(NVec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps((__m512)v);
#else
  float t = 0.0f;
  for (int64_t l = 0; l < kNative; ++l) t += v[l];
  return t;
#endif
}

// The lane sums of kNative native vectors as one vector (lane i: the sum of a[i]'s lanes). AVX-512: four
// levels that each add the halves of pairs, 15 shuffle-adds in place of 16 horizontal sums; AVX: three levels
// of horizontal adds, then the two halves' sums added.
#if defined(__AVX512F__)
inline NVec fold(NVec x, NVec y, NIVec lo, NIVec hi) { return __builtin_shuffle(x, y, lo) + __builtin_shuffle(x, y, hi); }

inline NVec lane_sums(NVec* a) {
  const NIVec lo8 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const NIVec lo4 = {0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27};
  const NIVec lo2 = {0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29};
  const NIVec lo1 = {0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30};
  for (int i = 0; i < 8; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo8, lo8 + 8);
  for (int i = 0; i < 4; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo4, lo4 + 4);
  for (int i = 0; i < 2; ++i) a[i] = fold(a[2 * i], a[2 * i + 1], lo2, lo2 + 2);
  return fold(a[0], a[1], lo1, lo1 + 1);
}
#elif defined(__AVX__)
inline NVec lane_sums(NVec* a) {
  __m256 t[4];
  for (int i = 0; i < 4; ++i) t[i] = _mm256_hadd_ps((__m256)a[2 * i], (__m256)a[2 * i + 1]);
  const __m256 u0 = _mm256_hadd_ps(t[0], t[1]), u1 = _mm256_hadd_ps(t[2], t[3]);
  return (NVec)_mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}
#else
inline NVec lane_sums(NVec* a) {
  NVec v;
  for (int64_t i = 0; i < kNative; ++i) v[i] = hsum(a[i]);
  return v;
}
#endif

constexpr int64_t kMaxGroup = 16;    // query heads per KV head that the attention kernel handles
constexpr int64_t kPositions = 128;  // cache positions per attention task

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

// One row's decode attention reads each cached key and value row once for a batch of up to kHeadBatch query
// heads of its group: a row is loaded (an int8 row widened) once, then multiplied into every head's sums, which
// add in the same order as for one head at a time. kNative keys' dot products are kept per
// head and lane-summed into one vector of scores; a value row's columns are kept in kRowVecs registers per head.
constexpr int kHeadBatch = kNative == 16 ? 4 : 3;  // AVX: 3 heads x 4 vectors of output columns, 12 of 16 registers
constexpr int kRowVecs = 4;                        // output columns per pass over a block's value rows: 4 vectors

// s[h][first, first + kNative) = scale * q_h . k_i for the G heads from q on (rows d apart). kKeyStep keys at a
// time, so that G * kKeyStep sums are in flight (one key's G alone would wait on each multiply-add's latency).
#if defined(__FMA__) || defined(__AVX512F__)
constexpr int64_t kKeyStep = 4;
#else
constexpr int64_t kKeyStep = 2;  // a multiply and an add need a register more than a fused one (AVX's 16)
#endif

template <int G, typename T>
inline void score_keys(const float* q, const T* k, int64_t d, int64_t first, float scale, float (*s)[kPositions]) {
  static_assert(kNative % kKeyStep == 0);
  NVec a[G][kNative];
  for (int64_t i = 0; i < kNative; i += kKeyStep) {
    const T* kr = k + (first + i) * d;
    NVec acc[G][kKeyStep] = {};
    for (int64_t j = 0; j < d; j += kNative) {
      NVec kv[kKeyStep];
#pragma GCC unroll 4
      for (int x = 0; x < kKeyStep; ++x) kv[x] = nload16(kr + x * d + j);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) {
        const NVec qv = nload(q + h * d + j);
#pragma GCC unroll 4
        for (int x = 0; x < kKeyStep; ++x) acc[h][x] += qv * kv[x];
      }
    }
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
      for (int x = 0; x < kKeyStep; ++x) a[h][i + x] = acc[h][x];
  }
  for (int h = 0; h < G; ++h) nstore(&s[h][first], lane_sums(a[h]) * scale);
}

// o_h[c0, c0 + CN * kNative) = sum over the n rows r of w_h[r] * v's row r, for the G heads from w and o on
// (head h's row of o at o + h * os).
template <int G, int CN, typename T>
inline void weighted_rows(const float (*w)[kPositions], int64_t n, const T* v, int64_t d, int64_t c0, float* o, int64_t os) {
  NVec acc[G][CN] = {};
  for (int64_t r = 0; r < n; ++r) {
    NVec wr[G];
#pragma GCC unroll 4
    for (int h = 0; h < G; ++h) wr[h] = nsplat(w[h][r]);
#pragma GCC unroll 4
    for (int x = 0; x < CN; ++x) {
      const NVec vx = nload16(v + r * d + c0 + x * kNative);
#pragma GCC unroll 4
      for (int h = 0; h < G; ++h) acc[h][x] += wr[h] * vx;
    }
  }
  for (int h = 0; h < G; ++h)
#pragma GCC unroll 4
    for (int x = 0; x < CN; ++x) nstore(o + h * os + c0 + x * kNative, acc[h][x]);
}

// s[h][0, n) = scale * q_h . k_i for the G heads from q on and the block's n keys (whole kNative groups of
// them, the rest one by one). With v, the value rows of each group of keys are fetched into cache meanwhile (the
// block's weighted sum reads them next: two streams keep more of memory's bandwidth busy than one after the other).
template <int G, typename T>
void score_heads(const float* q, const T* k, int64_t n, int64_t d, float scale, float (*s)[kPositions], const T* v = nullptr) {
  int64_t first = 0;
  if (d % kNative == 0)
    for (; first + kNative <= n; first += kNative) {
      if (v != nullptr) {
        const char* rows = reinterpret_cast<const char*>(v + first * d);
        for (size_t b = 0; b < static_cast<size_t>(kNative * d) * sizeof(T); b += 64) _mm_prefetch(rows + b, _MM_HINT_T0);
      }
      score_keys<G>(q, k, d, first, scale, s);
    }
  for (int64_t i = first; i < n; ++i)
    for (int h = 0; h < G; ++h) {
      const float* qh = q + h * d;
      const T* kr = k + i * d;
      float dot = 0.0f;
      if (d % kNative == 0) {
        NVec acc = {};
        for (int64_t j = 0; j < d; j += kNative) acc += nload(qh + j) * nload16(kr + j);
        dot = hsum(acc);
      } else {
        for (int64_t j = 0; j < d; ++j) dot += qh[j] * as_float(kr[j]);
      }
      s[h][i] = dot * scale;
    }
}

// o_h = sum over the block's n value rows r of w_h[r] * v's row r, for the G heads from w and o on (rows os apart).
template <int G, typename T>
void value_heads(const float (*w)[kPositions], const T* v, int64_t n, int64_t d, float* o, int64_t os) {
  int64_t c0 = 0;
  if (d % kNative == 0) {
    for (; c0 + kRowVecs * kNative <= d; c0 += kRowVecs * kNative) weighted_rows<G, kRowVecs>(w, n, v, d, c0, o, os);
    for (; c0 < d; c0 += kNative) weighted_rows<G, 1>(w, n, v, d, c0, o, os);
  }
  for (; c0 < d; ++c0)
    for (int h = 0; h < G; ++h) {
      float acc = 0.0f;
      for (int64_t r = 0; r < n; ++r) acc += w[h][r] * as_float(v[r * d + c0]);
      o[h * os + c0] = acc;
    }
}

// fn(std::integral_constant<int, g>) for a head count g from 1 to kHeadBatch: the count as a template argument.
template <int G = kHeadBatch, typename Fn>
void with_heads(int64_t g, Fn&& fn) {
  if constexpr (G > 1) {
    if (g < G) return with_heads<G - 1>(g, std::forward<Fn>(fn));
  }
  fn(std::integral_constant<int, G>{});
}

// Task t: KV head t / blocks over the positions of block t % blocks, for each of its query heads: the scores,
// their e^(s - m) and sum, and the e-weighted sum of V rows (unnormalised, per head and block in job.o).
template <typename T>
void attend_block(void* data, size_t t) {
  const AttentionJob<T>& job = *static_cast<const AttentionJob<T>*>(data);
  const int64_t g = static_cast<int64_t>(t) / job.blocks, b = static_cast<int64_t>(t) % job.blocks, d = job.d;
  const int64_t t0 = job.start + b * kPositions, n = std::min(job.total - t0, kPositions);
  alignas(64) float s[kMaxGroup][kPositions];
  const T* kg = job.k + (g * job.c + t0) * d;
  const T* vg = job.v + (g * job.c + t0) * d;
  for (int64_t h0 = 0; h0 < job.group; h0 += kHeadBatch)
    with_heads(std::min<int64_t>(kHeadBatch, job.group - h0), [&](auto heads) {
      score_heads<decltype(heads)::value>(job.q + (g * job.group + h0) * d, kg, n, d, job.scale, s + h0, h0 == 0 ? vg : nullptr);
    });
  for (int64_t h = 0; h < job.group; ++h) {
    const int64_t slot = (g * job.group + h) * job.blocks + b;
    // the largest score, a native vector at a time; a NaN score makes the head's output NaN (as in
    // GroupQueryAttention), not garbage from the exp
    NVec tops = nsplat(-INFINITY);
    NIVec bad = {};
    int64_t i = 0;
    for (; i + kNative <= n; i += kNative) {
      const NVec x = nload(&s[h][i]);
      bad |= x != x;
      tops = tops > x ? tops : x;
    }
    float top = hmax(tops);
    bool nan = any_lane(bad);
    for (; i < n; ++i) {
      top = std::max(top, s[h][i]);
      nan |= s[h][i] != s[h][i];
    }
    if (nan) {
      job.m[slot] = job.l[slot] = NAN;
      continue;
    }
    NVec sums = {};
    for (i = 0; i + kNative <= n; i += kNative) {
      const NVec e = vexp(nload(&s[h][i]) - top);
      nstore(&s[h][i], e);
      sums += e;
    }
    float sum = hsum(sums);
    for (; i < n; ++i) {
      s[h][i] = std::exp(s[h][i] - top);
      sum += s[h][i];
    }
    job.m[slot] = top;
    job.l[slot] = sum;
  }
  for (int64_t h0 = 0; h0 < job.group; h0 += kHeadBatch) {
    const int64_t heads = std::min<int64_t>(kHeadBatch, job.group - h0), slot = (g * job.group + h0) * job.blocks + b;
    float* o = job.o + slot * d;  // the heads' rows are blocks * d apart
    with_heads(heads, [&](auto batch) { value_heads<decltype(batch)::value>(s + h0, vg, n, d, o, job.blocks * d); });
    for (int64_t h = 0; h < heads; ++h) {
      float* oh = o + h * job.blocks * d;
      if (std::isnan(job.m[slot + h * job.blocks]))  // the head's scores had a NaN: its output is NaN
        std::fill(oh, oh + d, NAN);
      else if (job.v_scale != nullptr)
        for (int64_t j = 0; j < d; ++j) oh[j] *= job.v_scale[g * d + j];
    }
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

// A chunk's attention (more than one row): a task is a KV head by a block of kQueryBlock positions, all its
// query heads' rows (as flash attention does): over the cache's positions in blocks of kKeyBlock (each block's
// keys transposed, and its value rows widened to floats, once per call before the tasks: every task of the head
// reads them; each task doing its own took 12-20% of a 256-row chunk's time after 256 positions), the scores of
// kRowGroup rows at a time against them, an online softmax (each
// row's running maximum and sum, its output rescaled when the maximum grows) and the e-weighted value rows
// added to the rows' outputs. A row attends to the positions up to its own (and, with a window, the last
// local_window_size of them); blocks past a row's position give it nothing.
constexpr int64_t kQueryBlock = 16;   // a chunk task's positions
constexpr int64_t kKeyBlock = 64;     // cache positions per step of a chunk task
constexpr int64_t kMaxHeadSize = 256;  // a chunk's head size at most
constexpr int64_t kHeadStep = 16;       // a chunk's head size is a multiple of this: whole native vectors on any CPU
constexpr int kRowGroup = 6;  // query rows whose scores and outputs are computed together
// native vectors of keys whose scores, and of output columns whose sums, a pass keeps in registers for the
// kRowGroup rows: with AVX-512 4 (24 of its 32 registers), else 2 (AVX: 12 of its 16)
constexpr int64_t kPassVecs = kNative == 16 ? 4 : 2;
constexpr int64_t kKeyNative = kKeyBlock / kNative;

template <typename T>
struct ChunkJob {
  const float* q;  // [rows, H*D], rotated, times K's scales for an int8 cache
  const T* k;      // [KV, C, D]
  const T* v;
  const float* v_scale;  // [KV, D] for an int8 cache, else null
  float* out;            // [rows, H*D]
  int64_t heads, group, c, d, p0, rows, window, qblocks;
  float scale;
  // the call's key blocks, made once before the tasks (every task of a KV head reads them): block b covers positions
  // base + b * kKeyBlock on, transposed ([KV][blocks][d][kKeyBlock]), and its value rows as floats ([KV][blocks]
  // [kKeyBlock][d]; null for a float32 cache without bf16, whose rows are read where they are)
  int64_t base = 0, blocks = 0;
  float* kt = nullptr;
  float* vf = nullptr;
  // bfloat16 blocks instead (LLMC_BF16_CHUNKS): keys as pairs of entries (2j, 2j + 1) transposed ([d / 2]
  // [kKeyBlock] 32-bit pairs), values as pairs of rows (2t, 2t + 1) ([kKeyBlock / 2][d] pairs), in kt's and vf's room
  bool bf16 = false;
};

NIVec lane_numbers() {
  NIVec v;
  for (int64_t l = 0; l < kNative; ++l) v[l] = static_cast<int32_t>(l);
  return v;
}

const NIVec native_index = lane_numbers();

#if defined(__AVX512BF16__) && defined(__AVX512F__)
// Chunk attention's products in bfloat16 with float32 sums (vdpbf16ps: two products a lane an instruction, twice the
// float32 FMA's): a CPU with AVX512_BF16. LLMC_ATTN_BF16=0 keeps them in float32.
#define LLMC_BF16_CHUNKS 1

// kNative floats as bfloat16 (rounded to nearest even), in order.
inline __m256i to_bf16(NVec x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }

// Lane l: a[l]'s bfloat16 in the low half, b[l]'s in the high half (a pair for vdpbf16ps).
inline __m512i bf16_pairs(NVec a, NVec b) {
  return _mm512_or_si512(_mm512_cvtepu16_epi32(to_bf16(a)), _mm512_slli_epi32(_mm512_cvtepu16_epi32(to_bf16(b)), 16));
}

inline NVec dot_pairs(NVec acc, __m512i a, __m512i b) { return (NVec)_mm512_dpbf16_ps((__m512)acc, (__m512bh)a, (__m512bh)b); }

// A pair of bfloat16 values per lane (LLMC_BF16_CHUNKS' operands): the loops below take them as they take floats.
struct Pairs {
  __m512i v;
};

inline Pairs operand(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
inline Pairs broadcast(uint32_t pair) { return {_mm512_set1_epi32(static_cast<int32_t>(pair))}; }
inline NVec multiply_add(NVec acc, Pairs a, Pairs b) { return dot_pairs(acc, a.v, b.v); }
inline Pairs first_of_pair(Pairs a) { return {_mm512_and_si512(a.v, _mm512_set1_epi32(0xffff))}; }
#endif

// The operands of the score and value loops: float32 entries (E = float), or bfloat16 pairs (E = uint32_t, above),
// whose steps then each cover two entries (of the head size for scores, of the block's rows for values).
inline NVec operand(const float* p) { return nload(p); }
inline NVec broadcast(float x) { return nsplat(x); }
inline NVec multiply_add(NVec acc, NVec a, NVec b) { return acc + a * b; }
inline NVec first_of_pair(NVec a) { return a; }  // (float32 steps are single entries)

// The scores of kRowGroup query rows against P native vectors of keys from vector b0 of a block transposed
// ([steps][kKeyBlock]; steps = d, or d / 2 pairs), summed in kRowGroup * P registers.
template <int P, typename E>
inline void score_pass(const E* const* q, const E* kt, int64_t steps, float (&s)[kRowGroup][kKeyBlock], int64_t b0) {
  using V = decltype(operand(kt));
  NVec acc[kRowGroup][P] = {};
  for (int64_t j = 0; j < steps; ++j) {
    V kv[P];
#pragma GCC unroll 4
    for (int b = 0; b < P; ++b) kv[b] = operand(kt + j * kKeyBlock + (b0 + b) * kNative);
#pragma GCC unroll 8
    for (int r = 0; r < kRowGroup; ++r) {
      const V qv = broadcast(q[r][j]);
#pragma GCC unroll 4
      for (int b = 0; b < P; ++b) acc[r][b] = multiply_add(acc[r][b], kv[b], qv);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 4
    for (int b = 0; b < P; ++b) nstore(&s[r][(b0 + b) * kNative], acc[r][b]);
}

// The scores of kRowGroup query rows against the first kn keys of a block (in whole native vectors: the
// scores past them are left unset, and the rows' masks drop them), kPassVecs vectors a pass.
template <typename E>
inline void group_scores(const E* const* q, const E* kt, int64_t steps, float (&s)[kRowGroup][kKeyBlock], int64_t kn) {
  const int64_t vecs = (kn + kNative - 1) / kNative;
  int64_t b0 = 0;
  for (; b0 + kPassVecs <= vecs; b0 += kPassVecs) score_pass<kPassVecs>(q, kt, steps, s, b0);
  switch (vecs - b0) {
    case 3: score_pass<3>(q, kt, steps, s, b0); break;
    case 2: score_pass<2>(q, kt, steps, s, b0); break;
    case 1: score_pass<1>(q, kt, steps, s, b0); break;
    default: break;
  }
}

// kRowGroup rows' outputs, columns [c0, c0 + CN * kNative): += p[r][t] * value row t, for the block's steps rows (or
// pairs of rows, [steps][d] pairs, with the weights as pairs: odd drops the last pair's second row, past the task's
// keys, whose weight is 0 but which may hold an infinity, and 0 x inf is NaN).
template <int CN, typename E, size_t W>
inline void group_values(const E (*p)[W], int64_t steps, bool odd, const E* vb, int64_t d, int64_t c0, float* const* acc) {
  using V = decltype(operand(vb));
  NVec o[kRowGroup][CN];
#pragma GCC unroll 8
  for (int r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CN; ++x) o[r][x] = nload(acc[r] + c0 + x * kNative);
  for (int64_t t = 0; t < steps; ++t) {
    V vv[CN];
#pragma GCC unroll 4
    for (int x = 0; x < CN; ++x) vv[x] = operand(vb + t * d + c0 + x * kNative);
    if (odd && t == steps - 1)
      for (int x = 0; x < CN; ++x) vv[x] = first_of_pair(vv[x]);
#pragma GCC unroll 8
    for (int r = 0; r < kRowGroup; ++r) {
      const V pr = broadcast(p[r][t]);
#pragma GCC unroll 4
      for (int x = 0; x < CN; ++x) o[r][x] = multiply_add(o[r][x], vv[x], pr);
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kRowGroup; ++r)
#pragma GCC unroll 4
    for (int x = 0; x < CN; ++x) nstore(acc[r] + c0 + x * kNative, o[r][x]);
}

// group_values over all of a row group's d columns, kPassVecs native vectors a pass.
template <typename E, size_t W>
inline void all_values(const E (*p)[W], int64_t steps, bool odd, const E* vb, int64_t d, float* const* acc) {
  int64_t c0 = 0;
  for (; c0 + kPassVecs * kNative <= d; c0 += kPassVecs * kNative) group_values<kPassVecs>(p, steps, odd, vb, d, c0, acc);
  switch ((d - c0) / kNative) {
    case 3: group_values<3>(p, steps, odd, vb, d, c0, acc); break;
    case 2: group_values<2>(p, steps, odd, vb, d, c0, acc); break;
    case 1: group_values<1>(p, steps, odd, vb, d, c0, acc); break;
    default: break;
  }
}

#if defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))); }
inline __m256 load8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  alignas(32) float f[8];
  for (int i = 0; i < 8; ++i) f[i] = half_to_float(p[i]);
  return _mm256_load_ps(f);
#endif
}

// r[i] becomes column i of the 8 x 8 matrix whose rows r holds.
inline void transpose8(__m256 (&r)[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 4; ++i) {
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 2; ++i) {  // rows 4i..4i+3: columns 0, 1, 2, 3 (and 4..7 in the upper halves)
    u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xee);
    u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xee);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
    r[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
  }
}
#endif

// kt[j][x] = key row x's entry j for the block's kn rows from k on, zero for x in [kn, kKeyBlock): 8 x 8 tiles
// (with AVX2; d is a multiple of kHeadStep in a chunk), else one entry at a time.
template <typename T>
void transpose_keys(const T* k, int64_t kn, int64_t d, float* kt) {
#if defined(__AVX2__)
  for (int64_t x0 = 0; x0 < kKeyBlock; x0 += 8)
    for (int64_t j0 = 0; j0 < d; j0 += 8) {
      __m256 r[8];
      for (int64_t i = 0; i < 8; ++i) r[i] = x0 + i < kn ? load8(k + (x0 + i) * d + j0) : _mm256_setzero_ps();
      transpose8(r);
      for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (j0 + i) * kKeyBlock + x0, r[i]);
    }
#else
  for (int64_t x = 0; x < kKeyBlock; ++x)
    for (int64_t j = 0; j < d; ++j) kt[j * kKeyBlock + x] = x < kn ? as_float(k[x * d + j]) : 0.0f;
#endif
}

// Task t: KV head t / blocks's key block t % blocks (its positions up to the chunk's last) into job.kt and job.vf.
template <typename T>
void prepare_block(void* data, size_t t) {
  const ChunkJob<T>& job = *static_cast<const ChunkJob<T>*>(data);
  const int64_t g = static_cast<int64_t>(t) / job.blocks, b = static_cast<int64_t>(t) % job.blocks, d = job.d;
  const int64_t k0 = job.base + b * kKeyBlock, kn = std::min(kKeyBlock, job.p0 + job.rows - k0);
  const int64_t at = (g * job.blocks + b) * d * kKeyBlock;
#if LLMC_BF16_CHUNKS
  if (job.bf16) {
    const T* k = job.k + (g * job.c + k0) * d;
    alignas(64) uint16_t rows[kKeyBlock * kMaxHeadSize];  // the keys' rows in bfloat16: pairs of entries, then transposed
    for (int64_t i = 0; i < kn * d; i += kNative) _mm256_storeu_si256(reinterpret_cast<__m256i*>(rows + i), to_bf16(nload16(k + i)));
    transpose_keys(reinterpret_cast<const float*>(rows), kn, d / 2, job.kt + at);  // 32-bit pairs moved as they are
    const T* v = job.v + (g * job.c + k0) * d;
    uint32_t* dst = reinterpret_cast<uint32_t*>(job.vf + at);
    for (int64_t t = 0; t < kn; t += 2)
      for (int64_t j = 0; j < d; j += kNative)
        _mm512_storeu_si512(dst + (t / 2) * d + j, bf16_pairs(nload16(v + t * d + j), t + 1 < kn ? nload16(v + (t + 1) * d + j) : NVec{}));
    return;
  }
#endif
  transpose_keys(job.k + (g * job.c + k0) * d, kn, d, job.kt + at);
  if (job.vf != nullptr) {
    const T* src = job.v + (g * job.c + k0) * d;
    float* dst = job.vf + at;
    int64_t i = 0;
    for (; i + kNative <= kn * d; i += kNative) nstore(dst + i, nload16(src + i));
    for (; i < kn * d; ++i) dst[i] = as_float(src[i]);
  }
}

template <typename T>
void attend_chunk(void* data, size_t t) {
  const ChunkJob<T>& job = *static_cast<const ChunkJob<T>*>(data);
  const int64_t g = static_cast<int64_t>(t) / job.qblocks, i0 = (static_cast<int64_t>(t) % job.qblocks) * kQueryBlock;
  const int64_t i1 = std::min(job.rows, i0 + kQueryBlock), d = job.d, hd = job.heads * d;
  const int64_t n = (i1 - i0) * job.group;  // the task's query rows: row r is position i0 + r / group, head g * group + r % group
  std::vector<float> acc(static_cast<size_t>((n + kRowGroup - 1) / kRowGroup * kRowGroup * d), 0.0f), m(static_cast<size_t>(n), -INFINITY), l(static_cast<size_t>(n), 0.0f);
  std::vector<char> nan(static_cast<size_t>(n), 0);
  alignas(64) float pb[kRowGroup][kKeyBlock];
  auto qrow = [&](int64_t r) { return job.q + (i0 + r / job.group) * hd + (g * job.group + r % job.group) * d; };
#if LLMC_BF16_CHUNKS
  alignas(64) uint32_t pp[kRowGroup][kKeyBlock / 2];  // the weights as bfloat16 pairs
  thread_local std::vector<uint32_t> qp;  // the task's query rows as bfloat16 pairs, d / 2 a row
  if (job.bf16) {
    grow(qp, n * d / 2);
    for (int64_t r = 0; r < n; ++r)
      for (int64_t j = 0; j < d; j += kNative)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(qp.data() + r * d / 2) + j), to_bf16(nload(qrow(r) + j)));
  }
#endif
  const T* vg = job.v + g * job.c * d;
  const int64_t last = job.p0 + i1 - 1, first = job.window > 0 ? std::max<int64_t>(0, job.p0 + i0 + 1 - job.window) : 0;
  // the blocks from the one holding first (a window's first position need not start one; the rows' masks drop what
  // is before it), up to last: positions past last in its block are masked too
  for (int64_t k0 = job.base + (first - job.base) / kKeyBlock * kKeyBlock; k0 <= last; k0 += kKeyBlock) {
    const int64_t kn = std::min(kKeyBlock, last + 1 - k0), at = (g * job.blocks + (k0 - job.base) / kKeyBlock) * d * kKeyBlock;
    const float* kt = job.kt + at;
    const float* vb = job.vf != nullptr ? job.vf + at : reinterpret_cast<const float*>(vg + k0 * d);
    for (int64_t r0 = 0; r0 < n; r0 += kRowGroup) {
      const float* qs[kRowGroup];
      float* as[kRowGroup];
      for (int rr = 0; rr < kRowGroup; ++rr) {
        qs[rr] = qrow(std::min(r0 + rr, n - 1));
        as[rr] = acc.data() + (r0 + rr) * d;  // rows past n: padding, given zero weights
      }
      alignas(64) float sc[kRowGroup][kKeyBlock];
#if LLMC_BF16_CHUNKS
      if (job.bf16) {
        const uint32_t* qq[kRowGroup];
        for (int rr = 0; rr < kRowGroup; ++rr) qq[rr] = qp.data() + std::min(r0 + rr, n - 1) * d / 2;
        group_scores(qq, reinterpret_cast<const uint32_t*>(kt), d / 2, sc, kn);
      } else
#endif
        group_scores(qs, kt, d, sc, kn);
      for (int rr = 0; rr < kRowGroup; ++rr) {
        const int64_t r = r0 + rr, pos = job.p0 + i0 + r / job.group;
        const int64_t tb = job.window > 0 ? std::max<int64_t>(0, pos + 1 - job.window - k0) : 0, te = std::min(kn, pos + 1 - k0);
        float* pr = pb[rr];
        if (r >= n || te <= tb) {  // nothing of this block for the row
#if LLMC_BF16_CHUNKS
          if (job.bf16)
            std::fill(pp[rr], pp[rr] + kKeyBlock / 2, 0u);
          else
#endif
            std::fill(pr, pr + kKeyBlock, 0.0f);
          continue;
        }
        // the row's scores in [tb, te) (the others -inf, then weight 0): maximum, e^(s - max) and their sum, a
        // native vector at a time
        const bool whole = tb == 0 && te == kKeyBlock;
        NVec top = nsplat(-INFINITY);
        NIVec bad = {};
        for (int64_t b = 0; b < kKeyNative; ++b) {
          NVec x = nload(&sc[rr][b * kNative]) * job.scale;
          if (!whole) {
            const NIVec at = native_index + static_cast<int32_t>(b * kNative);
            x = (at >= static_cast<int32_t>(tb)) & (at < static_cast<int32_t>(te)) ? x : nsplat(-INFINITY);
          }
          bad |= x != x;
          top = top > x ? top : x;
          nstore(&sc[rr][b * kNative], x);
        }
        const float grown = std::max(m[r], hmax(top)), rescale = vexp(nsplat(m[r] - grown))[0];  // (no call to expf)
        nan[r] |= any_lane(bad);
        NVec sum = {};
        for (int64_t b = 0; b < kKeyNative; ++b) {
          const NVec x = nload(&sc[rr][b * kNative]);
          NVec e = vexp(x - grown);
          if (!whole) e = x == -INFINITY ? NVec{} : e;
#if LLMC_BF16_CHUNKS
          if (job.bf16) {  // the weights as rounded, and their sum: the output a weighted mean of the value rows
            const __m256i h = to_bf16(e);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(reinterpret_cast<uint16_t*>(pp[rr]) + b * kNative), h);
            sum += (NVec)_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
            continue;
          }
#endif
          sum += e;
          nstore(pr + b * kNative, e);
        }
        l[r] = l[r] * rescale + hsum(sum);
        m[r] = grown;
        if (rescale != 1.0f)
          for (int64_t j = 0; j < d; j += kNative) nstore(as[rr] + j, nload(as[rr] + j) * rescale);
      }
#if LLMC_BF16_CHUNKS
      if (job.bf16)  // pairs of rows; an odd count's last pair ends past the task's keys
        all_values(pp, (kn + 1) / 2, kn % 2 != 0, reinterpret_cast<const uint32_t*>(vb), d, as);
      else
#endif
        all_values(pb, kn, false, vb, d, as);
    }
  }
  for (int64_t r = 0; r < n; ++r) {  // normalised by the sums (an int8 cache: times V's scales), a NaN score's row NaN
    float* y = job.out + (i0 + r / job.group) * hd + (g * job.group + r % job.group) * d;
    if (nan[r]) {
      std::fill(y, y + d, NAN);
      continue;
    }
    const NVec inv = nsplat(1.0f / l[r]);
    const float* a = acc.data() + r * d;
    if (job.v_scale != nullptr)
      for (int64_t j = 0; j < d; j += kNative) nstore(y + j, nload(a + j) * inv * nload(job.v_scale + g * d + j));
    else
      for (int64_t j = 0; j < d; j += kNative) nstore(y + j, nload(a + j) * inv);
  }
}

// The new rows of an attention call, rows [t * per, (t + 1) * per) of task t: each row's query (rotated, and times
// K's scales for an int8 cache) into q, its key (rotated) and value into the caches at its position p0 + r.
template <typename T>
struct RowsJob {
  const float *qsrc, *ksrc, *vsrc;
  int64_t rows, width, kvstride, heads, kv_heads, d, c, p0;
  const float *cos, *sin;  // [positions, d / 2], or null without rotary
  const float *k_scale, *v_scale;  // an int8 cache's, else null
  float* q;                         // [rows, heads * d]
  T *kc, *vc;                       // [kv_heads, c, d]
  int64_t per;
};

template <typename T>
void new_rows(void* data, size_t t) {
  const RowsJob<T>& job = *static_cast<const RowsJob<T>*>(data);
  const int64_t d = job.d, hd = job.heads * d, kvd = job.kv_heads * d;
  thread_local std::vector<float> k;  // a row's key, rotated
  grow(k, kvd);
  for (int64_t r = static_cast<int64_t>(t) * job.per, end = std::min(job.rows, r + job.per); r < end; ++r) {
    float* qr = job.q + r * hd;
    std::copy(job.qsrc + r * job.width, job.qsrc + r * job.width + hd, qr);
    std::copy(job.ksrc + r * job.kvstride, job.ksrc + r * job.kvstride + kvd, k.begin());
    if (job.cos != nullptr) {
      const float* cos = job.cos + (job.p0 + r) * (d / 2);
      const float* sin = job.sin + (job.p0 + r) * (d / 2);
      rotate(qr, job.heads, d, cos, sin);
      rotate(k.data(), job.kv_heads, d, cos, sin);
    }
    const float* vr = job.vsrc + r * job.kvstride;
    for (int64_t i = 0; i < kvd; ++i) {  // the row's K and V, at position p0 + r of each KV head
      T* kd = job.kc + ((i / d) * job.c + job.p0 + r) * d + i % d;
      T* vd = job.vc + ((i / d) * job.c + job.p0 + r) * d + i % d;
      const float kx = k[i], vx = vr[i];
      if constexpr (std::is_same_v<T, int8_t>) {
        *kd = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, std::nearbyint(kx / job.k_scale[i]))));
        *vd = static_cast<int8_t>(std::min(127.0f, std::max(-128.0f, std::nearbyint(vx / job.v_scale[i]))));
      } else if constexpr (std::is_same_v<T, uint16_t>) {
        *kd = float_to_half(kx);
        *vd = float_to_half(vx);
      } else {
        *kd = kx;
        *vd = vx;
      }
    }
    if constexpr (std::is_same_v<T, int8_t>)  // q . (codes * scale) = (q * scale) . codes
      for (int64_t h = 0; h < job.heads; ++h)
        for (int64_t j = 0; j < d; ++j) qr[h * d + j] *= job.k_scale[(h / (job.heads / job.kv_heads)) * d + j];
  }
}

// T: the caches' element type, float (DecodeAttention), float16 (DecodeAttentionFloat16, its bits as uint16_t: a
// stored row is the nearest half, ties to even, as numpy's astype) or int8 codes with per-channel scales, inputs 9
// and 10 [1, KV, 1, D] (DecodeAttentionInt8: a stored row is clip(rint(x / scale), -128, 127), as the runtime's
// and ONNX Runtime's quantized caches).
template <typename T>
struct AttentionKernel {
  int64_t heads, kv_heads, rotary, window;
  float scale;
  // a chunk's products in bfloat16: where the node says bf16=1 (the W8A8 programs'), on a CPU with AVX512_BF16
  // (LLMC_BF16_CHUNKS), unless LLMC_ATTN_BF16=0 (read when a kernel is made)
  bool bf16 = false;

  AttentionKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
#if LLMC_BF16_CHUNKS
    const char* env = std::getenv("LLMC_ATTN_BF16");
    bf16 = attribute_or<int64_t>(ki, "bf16", 0) != 0 && (env == nullptr || std::strcmp(env, "0") != 0);
#endif
    heads = ki.GetAttribute<int64_t>("num_heads");
    kv_heads = ki.GetAttribute<int64_t>("kv_num_heads");
    scale = ki.GetAttribute<float>("scale");
    rotary = attribute_or<int64_t>(ki, "do_rotary", 0);
    window = attribute_or<int64_t>(ki, "local_window_size", -1);
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
    const std::vector<int64_t> qshape = query.GetTensorTypeAndShapeInfo().GetShape();
    const bool batched = qshape.size() == 3;  // [1, rows, width] (GroupQueryAttention's), else [rows, width]
    if ((qshape.size() != 2 && !(batched && qshape[0] == 1)) || qshape[qshape.size() - 2] < 1 ||
        qshape.back() != (packed ? hd + 2 * kvd : hd))
      throw Ort::Exception("DecodeAttention: query must be [1, rows, num_heads * head_size] or [rows, num_heads * head_size] (or q, k, v packed)",
                           ORT_INVALID_ARGUMENT);
    const int64_t rows = qshape[qshape.size() - 2], width = qshape.back();
    const int64_t p = seqlens.GetTensorData<int32_t>()[0], p0 = p + 1 - rows;  // the rows' positions: p0 .. p
    if (p0 < 0 || p >= c)
      throw Ort::Exception("DecodeAttention: the rows' positions (seqlens_k - rows + 1 to seqlens_k) are outside the cache's capacity",
                           ORT_INVALID_ARGUMENT);
    if (rows > 1 && (d % kHeadStep != 0 || d > kMaxHeadSize))
      throw Ort::Exception("DecodeAttention: more than one row needs a head_size that is a multiple of 16, at most 256", ORT_INVALID_ARGUMENT);
    if (!packed && (!present(2) || ctx.GetInput(1).GetTensorTypeAndShapeInfo().GetElementCount() != rows * kvd ||
                    ctx.GetInput(2).GetTensorTypeAndShapeInfo().GetElementCount() != rows * kvd))
      throw Ort::Exception("DecodeAttention: key and value must both be [1, rows, kv_num_heads * head_size]", ORT_INVALID_ARGUMENT);
    const float* qsrc = query.GetTensorData<float>();
    const float* ksrc = packed ? qsrc + hd : ctx.GetInput(1).GetTensorData<float>();
    const float* vsrc = packed ? qsrc + hd + kvd : ctx.GetInput(2).GetTensorData<float>();
    const int64_t kvstride = packed ? width : kvd;  // between one row's key (value) and the next's
    if (rotary != 0 && (!present(7) || !present(8) || ctx.GetInput(7).GetTensorTypeAndShapeInfo().GetElementCount() < (p + 1) * (d / 2) ||
                        ctx.GetInput(8).GetTensorTypeAndShapeInfo().GetElementCount() < (p + 1) * (d / 2)))
      throw Ort::Exception("DecodeAttention: do_rotary needs cos_cache and sin_cache [positions, head_size / 2] past seqlens_k",
                           ORT_INVALID_ARGUMENT);
    const float* k_scale = nullptr;
    const float* v_scale = nullptr;
    if constexpr (std::is_same_v<T, int8_t>) {
      if (!present(9) || !present(10) || ctx.GetInput(9).GetTensorTypeAndShapeInfo().GetElementCount() != kvd ||
          ctx.GetInput(10).GetTensorTypeAndShapeInfo().GetElementCount() != kvd)
        throw Ort::Exception("DecodeAttentionInt8: k_scale and v_scale must be [1, kv_num_heads, 1, head_size]", ORT_INVALID_ARGUMENT);
      k_scale = ctx.GetInput(9).GetTensorData<float>();
      v_scale = ctx.GetInput(10).GetTensorData<float>();
    }
    Ort::UnownedValue out = ctx.GetOutput(0, batched ? std::vector<int64_t>{1, rows, hd} : std::vector<int64_t>{rows, hd});
    T* kc = ctx.GetOutput(1, cache).GetTensorMutableData<T>();
    T* vc = ctx.GetOutput(2, cache).GetTensorMutableData<T>();
    const size_t cache_size = static_cast<size_t>(kvd * c);
    if (kc != past_k.GetTensorData<T>()) std::copy(past_k.GetTensorData<T>(), past_k.GetTensorData<T>() + cache_size, kc);
    if (vc != past_v.GetTensorData<T>()) std::copy(past_v.GetTensorData<T>(), past_v.GetTensorData<T>() + cache_size, vc);
    thread_local std::vector<float> q, m, l, o;  // this thread's buffers, kept across calls (grown, never shrunk)
    grow(q, rows * hd);
    // the rows' queries (rotated; times K's scales for an int8 cache) into q, their keys (rotated) and values into the
    // caches: blocks of rows on ONNX Runtime's threads (a chunk's)
    RowsJob<T> prep{qsrc, ksrc, vsrc, rows, width, kvstride, heads, kv_heads, d, c, p0,
                    rotary != 0 ? ctx.GetInput(7).GetTensorData<float>() : nullptr, rotary != 0 ? ctx.GetInput(8).GetTensorData<float>() : nullptr,
                    k_scale, v_scale, q.data(), kc, vc, 0};
    for_rows(ctx, new_rows<T>, &prep, rows, hd + 2 * kvd, prep.per);
    if (rows > 1) {
      const int64_t qblocks = (rows + kQueryBlock - 1) / kQueryBlock;
      ChunkJob<T> job{q.data(), kc, vc, v_scale, out.GetTensorMutableData<float>(), heads, heads / kv_heads, c, d, p0, rows, window, qblocks, scale};
      // the key blocks the chunk's rows attend over: from the earliest row's window start, in whole blocks
      job.base = window > 0 ? std::max<int64_t>(0, p0 + 1 - window) : 0;
      job.blocks = (p0 + rows - job.base + kKeyBlock - 1) / kKeyBlock;
      // this thread's, kept across calls: the chunk's keys and values as floats, KV heads x positions x d x 4 bytes
      // each (SmolLM2 at 2,048 positions: 1.5 MB; the float16 cache of one layer x 2), or as bfloat16 in half of that
      thread_local std::vector<float> kt, vf;
      grow(kt, kv_heads * job.blocks * d * kKeyBlock);
      job.kt = kt.data();
      job.bf16 = bf16;
      if (!std::is_same_v<T, float> || bf16) {
        grow(vf, kv_heads * job.blocks * d * kKeyBlock);
        job.vf = vf.data();
      }
      const bool parallel = (p + 1) * d * heads >= kAttentionParallel;
      const size_t prepared = static_cast<size_t>(kv_heads * job.blocks), tasks = static_cast<size_t>(kv_heads * qblocks);
      if (parallel && prepared > 1)
        ctx.ParallelFor(prepare_block<T>, prepared, 0, &job);
      else
        for (size_t t = 0; t < prepared; ++t) prepare_block<T>(&job, t);
      if (parallel && tasks > 1)
        ctx.ParallelFor(attend_chunk<T>, tasks, 0, &job);
      else
        for (size_t t = 0; t < tasks; ++t) attend_chunk<T>(&job, t);
      return;
    }
    const int64_t total = p + 1, start = window > 0 ? std::max<int64_t>(0, total - window) : 0;
    const int64_t group = heads / kv_heads, blocks = (total - start + kPositions - 1) / kPositions;
    grow(m, heads * blocks);  // every task writes all its slots
    grow(l, heads * blocks);
    grow(o, heads * blocks * d);
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
  // the caches' element type (inputs 3, 4 and outputs 1, 2)
  static constexpr ONNXTensorElementDataType kCache = kInt8 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8
                                                     : std::is_same_v<T, uint16_t> ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16
                                                                                   : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new AttentionKernel<T>(api, info); }
  const char* GetName() const {
    return kInt8 ? "DecodeAttentionInt8" : kCache == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16 ? "DecodeAttentionFloat16" : "DecodeAttention";
  }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return kInt8 ? 11 : 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 5 || i == 6) return ONNX_TENSOR_ELEMENT_DATA_TYPE_INT32;
    if (i == 3 || i == 4) return kCache;
    return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 1 || i == 2 || i == 7 || i == 8 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i > 0 ? kCache : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ---------------------------------------------------------------------------------------------------
// Quantized copies: SwiGLU and RMSNorm (below), and ShadowCorrection with SwiGLU's attributes, may also write their
// result as the uint8 codes of the W8A8 projection that reads it (attributes scale and zero_point, a second output),
// as ONNX QuantizeLinear computes them (Quantizer, quantize_row: above the corrections): clamp(round_half_even(y /
// scale) + zero_point, 0, 255), a NaN as 0. ONNX Runtime's QuantizeLinear is then not a pass of its own.

// An op of float inputs whose first output is float and whose optional second is its codes (Quantizer).
template <typename Op, typename Kernel>
struct CodesOp : Ort::CustomOpBase<Op, Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Kernel(api, info); }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  ONNXTensorElementDataType GetInputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
  size_t GetOutputTypeCount() const { return 2; }
  ONNXTensorElementDataType GetOutputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetOutputCharacteristic(size_t i) const {
    return i == 1 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
};

// ---------------------------------------------------------------------------------------------------
// SwiGLU(x[..., W]; gate, up, width, scale?, zero_point?) -> y[..., width], codes[..., width]?
//
//   y = silu(x[..., gate : gate + width]) * x[..., up : up + width]
//
// The gated MLP's activation straight from its fused gate/up projection (fuse_sibling_linears): one pass
// where the stock ops slice the gate and the up halves out, then apply sigmoid, and multiply twice.
// silu(g) = g / (1 + e^-g), with -g clamped to [-87, 87] (past it silu is g, or -0, to float precision).
// codes: y quantized for the down projection (see Quantizer).

struct SwigluJob {
  const float* x;
  float* y;
  uint8_t* codes;  // may be null
  Quantizer quant;
  int64_t rows, w, gate, up, width, per;
};

// y[0, width) = silu(g[j]) * u[j]: one row's SwiGLU (W8A8MatMul's too, where it does the activation before it).
void swiglu_row(const float* g, const float* u, int64_t width, float* y) {
  int64_t j = 0;
  for (; j + kNative <= width; j += kNative) {
    const NVec gv = nload(g + j);
    NVec neg = NVec{} - gv;
    neg = neg > nsplat(87.0f) ? nsplat(87.0f) : neg;
    nstore(y + j, gv / (1.0f + vexp(neg)) * nload(u + j));
  }
  for (; j < width; ++j) y[j] = g[j] / (1.0f + std::exp(-g[j])) * u[j];
}

void swiglu_rows(void* data, size_t t) {
  const SwigluJob& job = *static_cast<const SwigluJob*>(data);
  const int64_t r0 = static_cast<int64_t>(t) * job.per, r1 = std::min(job.rows, r0 + job.per);
  for (int64_t r = r0; r < r1; ++r) {
    const float* x = job.x + r * job.w;
    float* y = job.y + r * job.width;
    swiglu_row(x + job.gate, x + job.up, job.width, y);
    if (job.codes != nullptr) quantize_row(y, job.width, job.quant, job.codes + r * job.width);
  }
}

struct SwigluKernel {
  int64_t gate, up, width;
  Quantizer quant;

  SwigluKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    gate = ki.GetAttribute<int64_t>("gate");
    up = ki.GetAttribute<int64_t>("up");
    width = ki.GetAttribute<int64_t>("width");
    if (gate < 0 || up < 0 || width <= 0)
      throw Ort::Exception("SwiGLU: gate and up must be columns of x and width positive", ORT_INVALID_ARGUMENT);
    quant = quantizer_of(ki, "SwiGLU");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || std::max(gate, up) > shape.back() - width)
      throw Ort::Exception("SwiGLU: x must be [..., W] with the gate and up columns inside W", ORT_INVALID_ARGUMENT);
    const int64_t w = shape.back();
    const int64_t rows = leading_rows(shape);
    shape.back() = width;
    Ort::UnownedValue y = ctx.GetOutput(0, shape.data(), shape.size());
    SwigluJob job{x.GetTensorData<float>(), y.GetTensorMutableData<float>(), quant.output(ctx, shape), quant, rows, w, gate, up, width, 1};
    for_rows(ctx, swiglu_rows, &job, rows, width, job.per);
  }
};

struct SwigluOp : CodesOp<SwigluOp, SwigluKernel> {
  const char* GetName() const { return "SwiGLU"; }
  size_t GetInputTypeCount() const { return 1; }
};

// ---------------------------------------------------------------------------------------------------
// RMSNorm(x[..., n], weight[n]; epsilon, scale?, zero_point?) -> y[..., n], codes[..., n]?
//
//   y = x / sqrt(mean(x^2) + epsilon) * weight
//
// ONNX RMSNormalization over the last axis, with the codes of the W8A8 projection that reads y (see Quantizer).

struct NormJob {
  const float* x;
  const float* weight;
  float* y;
  uint8_t* codes;  // may be null
  Quantizer quant;
  int64_t rows, n, per;
  float epsilon;
};

// y = x / sqrt(mean(x^2) + epsilon) * weight over one row of n (RMSNorm, and BlockQMatMul's optional norm).
void rms_row(const float* x, const float* weight, int64_t n, float epsilon, float* y) {
  NVec acc = {};
  int64_t j = 0;
  for (; j + kNative <= n; j += kNative) acc += nload(x + j) * nload(x + j);
  float squares = hsum(acc);
  for (; j < n; ++j) squares += x[j] * x[j];
  const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + epsilon);
  for (j = 0; j + kNative <= n; j += kNative) nstore(y + j, nload(x + j) * inv * nload(weight + j));
  for (; j < n; ++j) y[j] = x[j] * inv * weight[j];
}

void norm_rows(void* data, size_t t) {
  const NormJob& job = *static_cast<const NormJob*>(data);
  const int64_t r0 = static_cast<int64_t>(t) * job.per, r1 = std::min(job.rows, r0 + job.per), n = job.n;
  for (int64_t r = r0; r < r1; ++r) {
    float* y = job.y + r * n;
    rms_row(job.x + r * n, job.weight, n, job.epsilon, y);
    if (job.codes != nullptr) quantize_row(y, n, job.quant, job.codes + r * n);
  }
}

struct NormKernel {
  float epsilon;
  Quantizer quant;

  NormKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    epsilon = ki.GetAttribute<float>("epsilon");
    quant = quantizer_of(ki, "RMSNorm");
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0), weight = ctx.GetInput(1);
    const std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    if (shape.empty() || weight.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(shape.back()))
      throw Ort::Exception("RMSNorm: x must be [..., n] and weight [n]", ORT_INVALID_ARGUMENT);
    const int64_t n = shape.back();
    const int64_t rows = leading_rows(shape);
    Ort::UnownedValue y = ctx.GetOutput(0, shape.data(), shape.size());
    NormJob job{x.GetTensorData<float>(), weight.GetTensorData<float>(), y.GetTensorMutableData<float>(), quant.output(ctx, shape), quant, rows, n, 1, epsilon};
    for_rows(ctx, norm_rows, &job, rows, n, job.per);
  }
};

struct NormOp : CodesOp<NormOp, NormKernel> {
  const char* GetName() const { return "RMSNorm"; }
  size_t GetInputTypeCount() const { return 2; }
};

// ---------------------------------------------------------------------------------------------------
// BlockQMatMul(x[..., K0], codes[N, nb, 16], scales[N * nb], zero_points[N * ceil(nb / 2)]?, residual[..., N]?,
//              norm[K0]?; K, N, block_size, digits?, epsilon?) -> y[..., N]
//
// ONNX Runtime's MatMulNBits for 4-bit codes in blocks of 32 inputs with int8 activations (accuracy_level 4),
// for the rows of a decode step: y[n] = sum over blocks b of scale[n, b] * (codes[n, b] - z[n, b]) . x_b,
// with x_b quantized to int8 per block (its scale the block's largest magnitude / 127, round half to even) and
// z the 4-bit zero point (two a byte, the low nibble first; 8 when there are none). codes hold two inputs a
// byte, the even one in the low nibble. With digits D (fold_block_offsets) x is widened first, as the
// backend's Concat widens it for MatMulNBits: [x, P, ..., P] with D copies of P, x's sums over its blocks
// of 32 zero-padded to whole blocks, so that K = K0 + D * len(P). With residual, y is that plus residual (a
// block's last projection adding into the residual stream, so that the Add is not an op of its own). With norm,
// x is first RMS-normalised, x / sqrt(mean(x^2) + epsilon) * norm, as RMSNorm computes it (the norm before a
// block's first projection, so that it is not an op of its own).
//
// Each row of x is widened and quantized once. Its int8 entries are stored in the codes' order: blocks in
// pairs, the even inputs of both blocks, then their odd ones, so that one 32-byte load of two blocks' codes
// meets them in two unsigned-by-signed byte multiplies (low nibbles, high nibbles; vpmaddubsw, at most
// 2 * 15 * 127 a lane: no saturation). Eight blocks' int32 sums are then one vector (pair-adds), in the
// lane order kLaneBlock, which x's block scales and code sums are stored in too: the scales, the zero
// points' term and the accumulation are one vector operation per eight blocks. A column's last group may
// reach past its blocks into the next column's: x is zero there (its codes, code sums and scales), so that
// their terms vanish; only the matrix's last columns, where that would read past the weights, sum their
// last blocks one at a time.
//
// The op is bound by reading the weights once (half a byte a weight and a float scale per 32). Tasks on ONNX
// Runtime's threads are blocks of kMatVecColumns output columns, each summed whole before the next: one
// column's codes are one sequential stream (several columns summed together, sharing x's loads, were
// slower at one row, their codes being several streams).

constexpr int64_t kQBlock = 32;          // inputs per block (BlockQMatMul's block_size)
constexpr int64_t kGroupBlocks = 8;      // blocks summed in one vector
constexpr int64_t kMatVecColumns = 64;   // output columns per task
constexpr int kLaneBlock[kGroupBlocks] = {0, 2, 4, 6, 1, 3, 5, 7};  // the block of a group in each lane (lane_of inverts it)

struct QuantizedRow {  // a row of x widened and quantized per block, padded with zero blocks to whole groups
  std::vector<int8_t> q;     // [groups * 8 * 32]: pairs of blocks, their even inputs, then their odd ones
  std::vector<float> scale;  // [groups * 8]: the blocks' scales, each group's in kLaneBlock order
  std::vector<float> sum;    // [groups * 8]: the blocks' code sums, as scale
};

// Where block b's scale and code sum are stored.
constexpr int64_t lane_of(int64_t b) {
  const int64_t at = b % kGroupBlocks;
  return b - at + (at % 2) * (kGroupBlocks / 2) + at / 2;
}

constexpr bool lanes_match() {
  for (int l = 0; l < kGroupBlocks; ++l)
    if (lane_of(kLaneBlock[l]) != l) return false;
  return true;
}
static_assert(lanes_match(), "lane_of must put each block in the lane the pair-adds leave its sum in");

inline int64_t matvec_groups(int64_t nb) { return (nb + kGroupBlocks - 1) / kGroupBlocks; }

void quantize_blocks(const float* x, int64_t k0, int64_t digits, int64_t nb, QuantizedRow& out, std::vector<float>& wide) {
  const int64_t k = nb * kQBlock, sums = (k0 / kQBlock + kQBlock - 1) / kQBlock * kQBlock;
  wide.assign(static_cast<size_t>(k), 0.0f);
  std::memcpy(wide.data(), x, static_cast<size_t>(k0) * sizeof(float));
  for (int64_t b = 0; b < k0 / kQBlock; ++b) {
    float t = 0.0f;
    for (int64_t i = 0; i < kQBlock; ++i) t += x[b * kQBlock + i];
    for (int64_t d = 0; d < digits; ++d) wide[static_cast<size_t>(k0 + d * sums + b)] = t;
  }
  const size_t padded = static_cast<size_t>(matvec_groups(nb) * kGroupBlocks);
  out.q.assign(padded * kQBlock, 0);
  out.scale.assign(padded, 0.0f);
  out.sum.assign(padded, 0.0f);
  for (int64_t b = 0; b < nb; ++b) {
    const float* v = wide.data() + b * kQBlock;
    float amax = 0.0f;
    for (int64_t i = 0; i < kQBlock; ++i) amax = std::max(amax, std::fabs(v[i]));
    const float inv = amax != 0.0f ? 127.0f / amax : 0.0f;
    int8_t* q = out.q.data() + b / 2 * 2 * kQBlock + (b % 2) * (kQBlock / 2);
    int32_t total = 0;
    for (int64_t i = 0; i < kQBlock; ++i) {
      const int32_t c = static_cast<int32_t>(std::nearbyint(v[i] * inv));
      q[(i % 2) * kQBlock + i / 2] = static_cast<int8_t>(c);
      total += c;
    }
    out.scale[static_cast<size_t>(lane_of(b))] = amax / 127.0f;
    out.sum[static_cast<size_t>(lane_of(b))] = static_cast<float>(total);
  }
}

struct MatVecJob {
  const QuantizedRow* row;
  const uint8_t* codes;
  const float* scales;
  const uint8_t* zero_points;  // may be null: 8
  const float* residual;  // may be null: added to the row's result (the residual stream)
  float* y;
  int64_t n, nb, zero_stride;
  int64_t whole;  // the columns before it may sum their last group whole (see BlockQMatMul)
};

inline int32_t zero_point(const MatVecJob& job, int64_t col, int64_t b) {
  if (job.zero_points == nullptr) return 8;
  return (job.zero_points[col * job.zero_stride + b / 2] >> ((b % 2) * 4)) & 0xf;
}

// Block b of column col: its codes' int32 dot product with x's block.
inline int32_t block_dot(const MatVecJob& job, int64_t col, int64_t b) {
  const uint8_t* c = job.codes + (col * job.nb + b) * (kQBlock / 2);
  const int8_t* xq = job.row->q.data() + b / 2 * 2 * kQBlock + (b % 2) * (kQBlock / 2);
#if defined(__AVX2__)
  const __m128i codes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(c)), low = _mm_set1_epi8(0x0f);
  const __m128i even = _mm_maddubs_epi16(_mm_and_si128(codes, low), _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq)));
  const __m128i odd = _mm_maddubs_epi16(_mm_and_si128(_mm_srli_epi16(codes, 4), low), _mm_loadu_si128(reinterpret_cast<const __m128i*>(xq + kQBlock)));
  __m128i d = _mm_madd_epi16(_mm_add_epi16(even, odd), _mm_set1_epi16(1));
  d = _mm_add_epi32(d, _mm_shuffle_epi32(d, 0x4e));
  return _mm_cvtsi128_si32(_mm_add_epi32(d, _mm_shuffle_epi32(d, 0xb1)));
#else
  int32_t dot = 0;
  for (int64_t i = 0; i < kQBlock / 2; ++i) dot += (c[i] & 0xf) * xq[i] + (c[i] >> 4) * xq[kQBlock + i];
  return dot;
#endif
}

// Blocks [b0, nb) of column col, one at a time.
float column_blocks(const MatVecJob& job, int64_t col, int64_t b0) {
  const QuantizedRow& x = *job.row;
  float total = 0.0f;
  for (int64_t b = b0; b < job.nb; ++b) {
    const size_t lane = static_cast<size_t>(lane_of(b));
    const float dot = static_cast<float>(block_dot(job, col, b)) - static_cast<float>(zero_point(job, col, b)) * x.sum[lane];
    total += job.scales[col * job.nb + b] * x.scale[lane] * dot;
  }
  return total;
}

// Column col: its blocks' int8 dot products, scaled and summed, kGroupBlocks at a time.
float column(const MatVecJob& job, int64_t col) {
#if defined(__AVX2__)
  const QuantizedRow& x = *job.row;
  const int64_t nb = job.nb;
  const int64_t groups = col < job.whole ? matvec_groups(nb) : nb / kGroupBlocks;
  const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
  const __m256i shifts = _mm256_setr_epi32(0, 8, 16, 24, 4, 12, 20, 28);  // lane l's zero-point nibble: block kLaneBlock[l]
  const uint8_t* codes = job.codes + col * nb * (kQBlock / 2);
  const float* scales = job.scales + col * nb;
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t b = g * kGroupBlocks;
    __m256i pair[kGroupBlocks / 2];
#pragma GCC unroll 4
    for (int p = 0; p < kGroupBlocks / 2; ++p) {
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + (b + 2 * p) * (kQBlock / 2)));
      const int8_t* xq = x.q.data() + (b + 2 * p) * kQBlock;
      const __m256i even = _mm256_maddubs_epi16(_mm256_and_si256(c, low), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq)));
      const __m256i odd = _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(c, 4), low),
                                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + kQBlock)));
      pair[p] = _mm256_madd_epi16(_mm256_add_epi16(even, odd), ones);
    }
    const __m256i dots = _mm256_hadd_epi32(_mm256_hadd_epi32(pair[0], pair[1]), _mm256_hadd_epi32(pair[2], pair[3]));
    __m256 z = _mm256_set1_ps(8.0f);
    if (job.zero_points != nullptr) {
      int32_t nibbles;
      std::memcpy(&nibbles, job.zero_points + col * job.zero_stride + b / 2, sizeof nibbles);
      z = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(nibbles), shifts), _mm256_set1_epi32(0xf)));
    }
    const __m256 scale = _mm256_mul_ps(_mm256_permutevar8x32_ps(_mm256_loadu_ps(scales + b), order), _mm256_loadu_ps(x.scale.data() + b));
    acc = _mm256_fmadd_ps(_mm256_fnmadd_ps(z, _mm256_loadu_ps(x.sum.data() + b), _mm256_cvtepi32_ps(dots)), scale, acc);
  }
  __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  h = _mm_add_ps(h, _mm_movehl_ps(h, h));
  const float total = _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
  return groups * kGroupBlocks >= nb ? total : total + column_blocks(job, col, groups * kGroupBlocks);
#else
  return column_blocks(job, col, 0);
#endif
}

void matvec_task(void* data, size_t t) {
  const MatVecJob& job = *static_cast<const MatVecJob*>(data);
  const int64_t c0 = static_cast<int64_t>(t) * kMatVecColumns, c1 = std::min(job.n, c0 + kMatVecColumns);
  if (job.residual == nullptr)
    for (int64_t c = c0; c < c1; ++c) job.y[c] = column(job, c);
  else
    for (int64_t c = c0; c < c1; ++c) job.y[c] = column(job, c) + job.residual[c];
}

// The columns at the end of a matrix of columns `stride` long that a read `over` past a column's end may leave it.
inline int64_t columns_past(int64_t over, int64_t stride) { return (over + stride - 1) / stride; }

struct MatVecKernel {
  int64_t k, n, digits;
  float epsilon = 0.0f;

  MatVecKernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    k = ki.GetAttribute<int64_t>("K");
    n = ki.GetAttribute<int64_t>("N");
    digits = attribute_or<int64_t>(ki, "digits", 0);
    epsilon = attribute_or<float>(ki, "epsilon", 0.0f);  // the optional norm's
    if (attribute_or<int64_t>(ki, "block_size", kQBlock) != kQBlock || k <= 0 || k % kQBlock != 0 || n <= 0 || digits < 0)
      throw Ort::Exception("BlockQMatMul: block_size must be 32, K a positive multiple of it, N positive and digits >= 0",
                           ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0), codes = ctx.GetInput(1), scales = ctx.GetInput(2);
    const OrtValue* zp_value = ctx.GetInputCount() > 3 ? static_cast<const OrtValue*>(ctx.GetInput(3)) : nullptr;
    const OrtValue* residual = ctx.GetInputCount() > 4 ? static_cast<const OrtValue*>(ctx.GetInput(4)) : nullptr;
    const OrtValue* norm = ctx.GetInputCount() > 5 ? static_cast<const OrtValue*>(ctx.GetInput(5)) : nullptr;
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t nb = k / kQBlock;
    const int64_t k0 = shape.empty() ? -1 : shape.back();
    const int64_t sums = k0 < 0 ? 0 : (k0 / kQBlock + kQBlock - 1) / kQBlock * kQBlock;
    if (k0 < 0 || k0 % kQBlock != 0 || k0 + digits * sums != k)
      throw Ort::Exception("BlockQMatMul: x must be [..., K0], K0 a multiple of 32 that its digits' block sums widen to K",
                           ORT_INVALID_ARGUMENT);
    const int64_t zero_stride = (nb + 1) / 2;
    if (codes.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * nb * kQBlock / 2) ||
        scales.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * nb) ||
        (zp_value != nullptr && Ort::ConstValue{zp_value}.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * zero_stride)))
      throw Ort::Exception("BlockQMatMul: codes must be [N, K / 32, 16], scales [N * K / 32] and zero_points [N * ceil(K / 64)]",
                           ORT_INVALID_ARGUMENT);
    if (norm != nullptr && Ort::ConstValue{norm}.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(k0))
      throw Ort::Exception("BlockQMatMul: norm (the RMS norm's weight) must be [K0], x's width", ORT_INVALID_ARGUMENT);
    const int64_t rows = leading_rows(shape);
    shape.back() = n;
    if (residual != nullptr && Ort::ConstValue{residual}.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(rows * n))
      throw Ort::Exception("BlockQMatMul: residual must have the result's shape [..., N]", ORT_INVALID_ARGUMENT);
    Ort::UnownedValue y = ctx.GetOutput(0, shape.data(), shape.size());
    thread_local QuantizedRow row;  // this thread's buffers, kept across calls (a decode step makes one a projection)
    thread_local std::vector<float> wide, normed;
    // the columns whose last group, read whole, stays inside the codes and scales: a column reaches reach - nb
    // blocks past its own nb. (Its zero points reach reach / 2 - ceil(nb / 2) bytes past its own ceil(nb / 2), no
    // more columns.)
    const int64_t reach = matvec_groups(nb) * kGroupBlocks;
    const int64_t whole = n - columns_past(reach - nb, nb);
    MatVecJob job{&row, codes.GetTensorData<uint8_t>(), scales.GetTensorData<float>(),
                  zp_value != nullptr ? Ort::ConstValue{zp_value}.GetTensorData<uint8_t>() : nullptr, nullptr, nullptr, n, nb, zero_stride,
                  whole};
    const size_t tasks = static_cast<size_t>((n + kMatVecColumns - 1) / kMatVecColumns);
    for (int64_t r = 0; r < rows; ++r) {
      const float* xr = x.GetTensorData<float>() + r * k0;
      if (norm != nullptr) {
        normed.resize(static_cast<size_t>(k0));
        rms_row(xr, Ort::ConstValue{norm}.GetTensorData<float>(), k0, epsilon, normed.data());
        xr = normed.data();
      }
      quantize_blocks(xr, k0, digits, nb, row, wide);
      job.y = y.GetTensorMutableData<float>() + r * n;
      job.residual = residual != nullptr ? Ort::ConstValue{residual}.GetTensorData<float>() + r * n : nullptr;
      if (tasks > 1 && static_cast<size_t>(n * k) >= kParallelWork)
        ctx.ParallelFor(matvec_task, tasks, 0, &job);
      else
        for (size_t t = 0; t < tasks; ++t) matvec_task(&job, t);
    }
  }
};

struct MatVecOp : Ort::CustomOpBase<MatVecOp, MatVecKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new MatVecKernel(api, info); }
  const char* GetName() const { return "BlockQMatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 6; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

// ---------------------------------------------------------------------------------------------------
// W8A8MatMul(x[..., K], w[K, N], w_scale[N] or [1], wt[K, N]?, residual[..., N]?, norm[K]?, wt_scale[N]?, hot_delta[H, N]?;
//            x_scale, x_zero_point, lo?, hi?, epsilon?, gate?, up?, hot_channels?) -> y[..., N]
//
//   y = residual + ((q(x) - x_zero_point) @ (w - w_zero_point) * x_scale * w_scale + (x - clip(x, lo, hi)) @ wt)
//
// With gate and up (SwiGLU's attributes, width K), x is [..., W], a gated MLP's fused gate/up projection, and the
// op reads SwiGLU's result silu(x[..., gate : gate + K]) * x[..., up : up + K] in its place (computed as SwiGLU
// computes it): the down projection without a SwiGLU op before it.
//
// A W8A8 projection with shadow outliers as one op, for the rows of a decode step: what the stock graph does with
// QuantizeLinear, MatMulIntegerToFloat (the QDQ MatMul fused) and ShadowCorrection. q(x) is x's uint8 codes as
// QuantizeLinear computes them (quantize_row); w is int8 (zero point 0) or uint8 (zero point 128, as memory-budgeted
// bundles store it); the int32 sums are exact and scaled as ONNX Runtime's MatMulIntegerToFloat scales them,
// float(sum) * (x_scale * w_scale[n]). wt is the table of the outlier correction (ShadowCorrection's, attributes lo
// and hi: the codes with wt_scale, often w and a per-column w_scale themselves, and hot_delta for the hot_channels);
// residual is added last. With norm, x is first RMS-normalised as RMSNorm does
// (attribute epsilon), and the codes and outliers are the normalised row's.
//
// The op is bound by reading w once, a byte a weight. Without the attribute pack (or without VNNI) it reads w as it is
// stored ([K, N]: no copy of the weights the chunk graphs' MatMulIntegerToFloat reads too; with pack, see W8Packed
// below). Whole rows are read in order: tasks on ONNX Runtime's threads are
// ranges of rows (w8_splits; the LM head's too), each summing its rows into int32 sums of all N columns, which are
// then added up and scaled. A range goes down its rows kW8Pairs pairs at a time, across all columns 64 at a time:
// two rows' bytes interleaved (unpack), multiplied by the two codes' parts and pair-added (vpmaddubsw, see w8_rows).
// Meanwhile the range's next block of rows (contiguous in memory) is fetched into cache in address order, a slice per
// 64 columns: the block's own loads go down its 8 or 16 rows at a time and keep fewer lines in flight than one linear
// stream.

// Row ranges of a matrix (their int32 sums added after): one for each of the machine's CPUs (ONNX Runtime's threads by
// default), so that a thread reads one range start to end and fetches each next block ahead; at most one per two
// blocks of rows (a range's first block is not fetched ahead). Measured on 2 CPUs (SmolLM2's decode), 2 ranges beat 4.
// LLMC_W8_SPLITS (1 to 64) sets the count instead, read when a kernel is made (for fewer threads than CPUs, and tests).
constexpr int64_t kW8MaxSplits = 64;

int64_t w8_splits() {
  if (const char* env = std::getenv("LLMC_W8_SPLITS")) {
    char* end = nullptr;
    const long v = std::strtol(env, &end, 10);
    if (end != env && *end == '\0' && v >= 1 && v <= kW8MaxSplits) return v;
  }
  return std::clamp<int64_t>(static_cast<int64_t>(std::thread::hardware_concurrency()), 2, kW8MaxSplits);
}

struct W8Job {
  const int16_t* a;      // the row's codes less the zero point, K rounded up to even (a zero after an odd K's last)
  const int16_t* parts;  // per pair of codes: their high parts ((a - lo) / 16, a byte each, the first low), their low parts (lo)
  const uint8_t* w;      // [K, N] bytes: int8, or uint8 offset by 128; each read as w + 128 (flip: int8's top bit turned)
  int32_t* partial;      // [splits, N]: each row range's sums of a * (w + 128), blocks of 64 columns in interleave order
  int64_t k, n, splits, split_pairs, flush;  // split_pairs: row pairs per range (the last may have fewer)
  uint8_t flip;
  int32_t total;  // sum(a)
  float x_scale;
  const float* w_scale;
  bool per_channel;
  float* y;  // the row's result
  // the outliers' rows of the correction's weight table (row_bytes each), which the ranges fetch into cache during
  // their last block, each its share of their lines, so that the correction after the sums reads them from cache
  const char* table = nullptr;
  const int32_t* channels = nullptr;
  int64_t outliers = 0, row_bytes = 0;
};

inline int32_t w8(const W8Job& job, int64_t k, int64_t c) { return job.w[k * job.n + c] ^ job.flip; }  // w + 128

constexpr int64_t kW8Pairs = 8;  // row pairs summed in int16 at most before they are widened (see w8_rows)

#if defined(__AVX2__)

// Row pairs [p0, p1) of columns [c0, c0 + 64), added to acc (int32, in the order the interleaves leave the columns:
// see w8_finish) or, first, stored there. Each code a (a - zero point) is split into a = 16 * hi + lo, lo in -8..7,
// and each weight read as the unsigned w + 128 (its top bit turned), so that a byte multiply-add of two rows' weights
// by two codes' parts (vpmaddubsw, unsigned by signed) cannot saturate: at most 2 * 255 * 16 (hi is in -8..8 for a
// zero point of 128, -16..16 at most). The pairs are summed in int16 (job.flush pairs at a time: 8, or 4 where hi
// can reach beyond 8), then lo + 16 * hi is widened to int32 (vpmaddwd by (1, 16)). Meanwhile the 2 * (p1 - p0)
// lines at next (the next block's slice for these columns, or none) are fetched into cache.
inline void w8_rows(const W8Job& job, int64_t p0, int64_t p1, int64_t c0, int32_t* acc, bool first, const char* next) {
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(job.flip));
  const int64_t n = job.n;
  __m256i s[8] = {};  // per 32 columns: the rows' low interleave by hi, by lo; their high interleave by hi, by lo
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t k = 2 * p;
    const uint8_t* r0 = job.w + k * n + c0;
    const uint8_t* r1 = k + 1 < job.k ? r0 + n : r0;  // an odd K's last row pairs with itself, times a zero code
    if (next != nullptr) {
      _mm_prefetch(next + 128 * (p - p0), _MM_HINT_T0);
      _mm_prefetch(next + 128 * (p - p0) + 64, _MM_HINT_T0);
    }
    const __m256i h = _mm256_set1_epi16(job.parts[2 * p]), l = _mm256_set1_epi16(job.parts[2 * p + 1]);
#pragma GCC unroll 2
    for (int g = 0; g < 2; ++g) {
      const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + 32 * g)), flip);
      const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + 32 * g)), flip);
      const __m256i u = _mm256_unpacklo_epi8(w0, w1);
      s[4 * g] = _mm256_add_epi16(s[4 * g], _mm256_maddubs_epi16(u, h));
      s[4 * g + 1] = _mm256_add_epi16(s[4 * g + 1], _mm256_maddubs_epi16(u, l));
      const __m256i v = _mm256_unpackhi_epi8(w0, w1);
      s[4 * g + 2] = _mm256_add_epi16(s[4 * g + 2], _mm256_maddubs_epi16(v, h));
      s[4 * g + 3] = _mm256_add_epi16(s[4 * g + 3], _mm256_maddubs_epi16(v, l));
    }
  }
  const __m256i weights = _mm256_set1_epi32(1 | 16 << 16);
  for (int v = 0; v < 4; ++v) {  // lo + 16 * hi, widened
    const __m256i hi = s[2 * v], lo = s[2 * v + 1];
    __m256i* a = reinterpret_cast<__m256i*>(acc + 16 * v);
    const __m256i low = _mm256_madd_epi16(_mm256_unpacklo_epi16(lo, hi), weights), high = _mm256_madd_epi16(_mm256_unpackhi_epi16(lo, hi), weights);
    _mm256_storeu_si256(a, first ? low : _mm256_add_epi32(_mm256_loadu_si256(a), low));
    _mm256_storeu_si256(a + 1, first ? high : _mm256_add_epi32(_mm256_loadu_si256(a + 1), high));
  }
}
#endif

// y[c] for the columns [c0, c1), c0 a multiple of 64: (the ranges' sums less 128 * sum(a)) * (x_scale * w_scale[c]),
// the sums of a * w scaled as MatMulIntegerToFloat scales them.
void w8_finish(const W8Job& job, int64_t c0, int64_t c1) {
  const auto scale = [&](int64_t c) { return job.x_scale * job.w_scale[job.per_channel ? c : 0]; };
  int64_t c = c0;
#if defined(__AVX2__)
  // per 32 columns the sums are 4 vectors: (rows' low interleave, high) x (unpacklo_epi16, unpackhi_epi16); vector
  // 2v + h has columns v * 8 + h * 4 + (0..3) in its low 128-bit lane and those + 16 in its high lane
  const __m256i bias = _mm256_set1_epi32(128 * job.total);
  const __m256 xs = _mm256_set1_ps(job.x_scale);
  for (; c + 32 <= c0 + (c1 - c0) / 64 * 64; c += 32) {
    __m256i v[4];
    for (int i = 0; i < 4; ++i) {
      v[i] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.partial + c + 8 * i));
      for (int64_t r = 1; r < job.splits; ++r)
        v[i] = _mm256_add_epi32(v[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(job.partial + r * job.n + c + 8 * i)));
    }
    for (int h = 0; h < 2; ++h)
      for (int half = 0; half < 2; ++half) {
        const int64_t at = c + 8 * h + 16 * half;
        const __m256 sums = _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_permute2x128_si256(v[2 * h], v[2 * h + 1], half ? 0x31 : 0x20), bias));
        const __m256 sc = job.per_channel ? _mm256_mul_ps(xs, _mm256_loadu_ps(job.w_scale + at)) : _mm256_set1_ps(scale(0));
        _mm256_storeu_ps(job.y + at, _mm256_mul_ps(sums, sc));
      }
  }
#endif
  for (; c < c1; ++c) {
    int32_t sum = -128 * job.total;
    for (int64_t r = 0; r < job.splits; ++r) sum += job.partial[r * job.n + c];
    job.y[c] = static_cast<float>(sum) * scale(c);
  }
}

// Task t: row range t, its sums into partial's row t.
void w8_task(void* data, size_t t) {
  const W8Job& job = *static_cast<const W8Job*>(data);
  const int64_t n = job.n, pairs = (job.k + 1) / 2;
  const int64_t q0 = static_cast<int64_t>(t) * job.split_pairs, q1 = std::min(pairs, q0 + job.split_pairs);
  int32_t* acc = job.partial + static_cast<int64_t>(t) * n;
  int64_t c = 0;
#if defined(__AVX2__)
  const int64_t whole = n / 64 * 64;
  // this range's share of the outliers' table lines: [l0, l1) of their row-major order
  const int64_t row_lines = (job.row_bytes + 63) / 64, lines = job.outliers * row_lines;
  const int64_t l0 = lines * static_cast<int64_t>(t) / job.splits, l1 = lines * (static_cast<int64_t>(t) + 1) / job.splits;
  for (int64_t p0 = q0; p0 < q1; p0 += job.flush) {  // job.flush pairs of rows across all columns, each row's bytes in order
    const int64_t p1 = std::min(q1, p0 + job.flush);
    // the range's next block, if it is whole (2 * flush rows, all inside w): its first 2 * flush * whole bytes in
    // whole / 64 slices of 128 * flush (the block's last 2 * flush * (n - whole) bytes are not fetched ahead)
    const char* next = p1 + job.flush <= q1 && 2 * (p1 + job.flush) <= job.k ? reinterpret_cast<const char*>(job.w + 2 * p1 * n) : nullptr;
    const bool last = p1 == q1 && l1 > l0;
    const int64_t slices = whole / 64, per = last && slices > 0 ? (l1 - l0 + slices - 1) / slices : 0;
    for (c = 0; c < whole; c += 64) {
      w8_rows(job, p0, p1, c, acc + c, p0 == q0, next != nullptr ? next + 2 * job.flush * c : nullptr);
      for (int64_t i = l0 + c / 64 * per, end = std::min(l1, i + per); i < end; ++i)  // the last block: the table's lines
        _mm_prefetch(job.table + job.channels[i / row_lines] * job.row_bytes + i % row_lines * 64, _MM_HINT_T0);
    }
  }
  c = whole;
#endif
  std::memset(acc + c, 0, sizeof(int32_t) * static_cast<size_t>(n - c));
  for (int64_t k = 2 * q0; k < std::min(job.k, 2 * q1); ++k)  // the columns past whole blocks of 64 (without AVX2, all)
    for (int64_t j = c; j < n; ++j) acc[j] += static_cast<int32_t>(job.a[k]) * w8(job, k, j);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define LLMC_W8_PACKED 1  // the packed layout below is built
// With AVX-512 VNNI, and the attribute pack, the op keeps its constant weights in a second layout, the one its loop
// reads in address order: blocks of 64 output columns, each its K rows in groups of four, a group's 64 columns of
// four bytes (a column's four rows together: vpdpbusd multiplies four unsigned codes by four signed bytes and adds
// them into an int32). A task is one block, its sums in registers and written out scaled once; the weights it reads
// are one address range (and the threads take the blocks in order), which the hardware fetches ahead (reading [K, N] a few rows at a time
// across the columns kept less of memory's bandwidth busy: 20-25% slower on SmolLM2's decode shapes, measured).
// The codes are multiplied as they are (0..255) and the zero point's share taken out after, as x_zero_point times
// the column's sum of weights, so the int32 sums are those of (codes - zero point) * w, as the [K, N] path's.
constexpr int64_t kW8Block = 64;  // output columns of a packed block
constexpr bool kW8Packs = true;

struct W8Packed {
  // [blocks, groups, 64, 4]: w[4g + i, 64b + j] at ((b * groups + g) * 64 + j) * 4 + i; 64-byte aligned, so that each
  // vector load is one cache line
  std::unique_ptr<int8_t, decltype(&std::free)> w{nullptr, &std::free};
  std::vector<int32_t> colsum;  // [blocks * 64]: each column's sum of w (zero past N)
  int64_t groups = 0, blocks = 0;
};

struct W8PackJob {
  const uint8_t* w;  // [K, N] as stored
  uint8_t flip;      // a stored byte ^ flip is w as int8 (0x80 for uint8 weights with zero point 128)
  int64_t k, n;
  W8Packed* out;
};

// Task t: block t of the packed layout and its columns' sums. A group's four rows of 64 bytes are interleaved into
// 64 columns of four bytes: unpacking bytes then words leaves, in each 128-bit lane, four columns per vector (vector v,
// lane l: columns 16l + 4v to 16l + 4v + 3), and a transpose of those 4 x 4 lanes puts the columns in order.
void w8_pack_task(void* data, size_t t) {
  const W8PackJob& job = *static_cast<const W8PackJob*>(data);
  W8Packed& p = *job.out;
  const int64_t b = static_cast<int64_t>(t), c0 = b * kW8Block, cols = std::min(kW8Block, job.n - c0);
  const __mmask64 in = cols == kW8Block ? ~static_cast<__mmask64>(0) : (static_cast<__mmask64>(1) << cols) - 1;
  const __m512i flip = _mm512_set1_epi8(static_cast<char>(job.flip)), ones = _mm512_set1_epi8(1);
  int8_t* dst = p.w.get() + b * p.groups * kW8Block * 4;
  __m512i sums[4] = {};
  for (int64_t g = 0; g < p.groups; ++g, dst += kW8Block * 4) {
    __m512i r[4];
    for (int64_t i = 0; i < 4; ++i) {
      const int64_t row = 4 * g + i;
      r[i] = row < job.k ? _mm512_maskz_mov_epi8(in, _mm512_xor_si512(_mm512_maskz_loadu_epi8(in, job.w + row * job.n + c0), flip))
                         : _mm512_setzero_si512();
    }
    const __m512i t0 = _mm512_unpacklo_epi8(r[0], r[1]), t1 = _mm512_unpackhi_epi8(r[0], r[1]);
    const __m512i t2 = _mm512_unpacklo_epi8(r[2], r[3]), t3 = _mm512_unpackhi_epi8(r[2], r[3]);
    const __m512i u0 = _mm512_unpacklo_epi16(t0, t2), u1 = _mm512_unpackhi_epi16(t0, t2);
    const __m512i u2 = _mm512_unpacklo_epi16(t1, t3), u3 = _mm512_unpackhi_epi16(t1, t3);
    const __m512i x0 = _mm512_shuffle_i32x4(u0, u1, 0x44), x1 = _mm512_shuffle_i32x4(u2, u3, 0x44);  // lanes 0, 1 of each
    const __m512i x2 = _mm512_shuffle_i32x4(u0, u1, 0xee), x3 = _mm512_shuffle_i32x4(u2, u3, 0xee);  // lanes 2, 3
    const __m512i o[4] = {_mm512_shuffle_i32x4(x0, x1, 0x88), _mm512_shuffle_i32x4(x0, x1, 0xdd),
                          _mm512_shuffle_i32x4(x2, x3, 0x88), _mm512_shuffle_i32x4(x2, x3, 0xdd)};
    for (int v = 0; v < 4; ++v) {
      _mm512_storeu_si512(dst + 64 * v, o[v]);
      sums[v] = _mm512_dpbusd_epi32(sums[v], ones, o[v]);  // each column's four bytes, added
    }
  }
  for (int v = 0; v < 4; ++v) _mm512_storeu_si512(p.colsum.data() + c0 + 16 * v, sums[v]);
}

constexpr int64_t kCorrectionColumns = 1024;

struct W8PackedJob {
  const W8Packed* p;
  const uint8_t* codes;  // the row's uint8 codes, four per group of rows (zero past K)
  int32_t zero_point;
  float x_scale;
  const float* w_scale;
  bool per_channel;
  int64_t n;
  float* y;  // the row's result
  // One decode row's shadow correction (ShadowCorrection's tasks, run_task, over a Job without base or residual, into
  // a buffer the caller adds after the loop), as the loop's first `corrections` tasks, of kCorrectionColumns columns
  // each; the packed blocks follow, so that one thread reads the table rows while the other streams the weights. On
  // its own thread after the sums it waited on each table row's first lines from memory (2-4 us a projection for
  // SmolLM2, the other thread idle); as ShadowCorrection's 16 tasks, both threads read the table first (0-5% slower).
  void (*correction)(void*, size_t) = nullptr;
  void* correction_job = nullptr;
  int64_t corrections = 0;
};

inline int32_t four_codes(const uint8_t* codes, int64_t g) {
  int32_t v;
  std::memcpy(&v, codes + 4 * g, sizeof v);
  return v;
}

// Task t: packed block t's 64 columns of y, (sum(codes * w) - zero_point * colsum) * (x_scale * w_scale).
void w8_packed_task(void* data, size_t t) {
  const W8PackedJob& job = *static_cast<const W8PackedJob*>(data);
  if (static_cast<int64_t>(t) < job.corrections) {
    job.correction(job.correction_job, t);
    return;
  }
  t -= static_cast<size_t>(job.corrections);
  const W8Packed& p = *job.p;
  const int64_t b = static_cast<int64_t>(t), c0 = b * kW8Block;
  const int8_t* src = p.w.get() + b * p.groups * kW8Block * 4;
  __m512i acc[2][4] = {};  // two groups at a time, each its own sums (added after: int32, exact in any order)
  int64_t g = 0;
  for (; g + 2 <= p.groups; g += 2, src += 2 * kW8Block * 4)
    for (int h = 0; h < 2; ++h) {
      const __m512i codes = _mm512_set1_epi32(four_codes(job.codes, g + h));
      for (int v = 0; v < 4; ++v)
        acc[h][v] = _mm512_dpbusd_epi32(acc[h][v], codes, _mm512_loadu_si512(src + (h * kW8Block + 16 * v) * 4));
    }
  if (g < p.groups) {
    const __m512i codes = _mm512_set1_epi32(four_codes(job.codes, g));
    for (int v = 0; v < 4; ++v) acc[0][v] = _mm512_dpbusd_epi32(acc[0][v], codes, _mm512_loadu_si512(src + 16 * v * 4));
  }
  const __m512i zp = _mm512_set1_epi32(job.zero_point);
  const __m512 xs = _mm512_set1_ps(job.x_scale);
  for (int v = 0; v < 4; ++v) {
    const int64_t c = c0 + 16 * v;
    if (c >= job.n) break;
    const __mmask16 m = job.n - c >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << (job.n - c)) - 1);
    const __m512i sums = _mm512_sub_epi32(_mm512_add_epi32(acc[0][v], acc[1][v]),
                                          _mm512_mullo_epi32(zp, _mm512_loadu_si512(p.colsum.data() + c)));
    const __m512 sc = job.per_channel ? _mm512_mul_ps(xs, _mm512_maskz_loadu_ps(m, job.w_scale + c)) : _mm512_set1_ps(job.x_scale * job.w_scale[0]);
    _mm512_mask_storeu_ps(job.y + c, m, _mm512_mul_ps(_mm512_cvtepi32_ps(sums), sc));
  }
}
#else
constexpr bool kW8Packs = false;
struct W8Packed {};
#endif

constexpr int64_t kW8Finish = 4096;  // columns a task of w8_finish_task scales

void w8_finish_task(void* data, size_t t) {
  const W8Job& job = *static_cast<const W8Job*>(data);
  const int64_t c0 = static_cast<int64_t>(t) * kW8Finish;
  w8_finish(job, c0, std::min(job.n, c0 + kW8Finish));
}

struct W8Kernel {
  Quantizer quant;  // x's codes: x_scale, x_zero_point
  float lo = 0.0f, hi = 0.0f, epsilon;
  int64_t gate = -1, up = -1;  // with both: x holds the gate and up columns of the SwiGLU whose result the op reads
  int64_t max_splits = w8_splits();  // row ranges of a large matrix
  // With the attribute pack (1) and AVX-512 VNNI: the constant weights in the packed layout (W8Packed), made by the
  // first call. LLMC_W8_PACK=0 turns it off (read when a kernel is made).
  bool pack = false;
  std::mutex pack_mutex;  // an uncontended lock a call (tens of nanoseconds), held while the first call makes them
  std::unique_ptr<W8Packed> packed;
  // What the weight inputs (w, w_scale and the optional wt and norm) are. The checks of those that are the graph's
  // constants pass once and later calls reuse their facts (a decode step's ops are short, and each shape query of the
  // C API allocates); the others (a weight table the runtime feeds, say) are checked on every call.
  struct Weights {
    int64_t k = 0, n = 0;
    ONNXTensorElementDataType wtype{}, wt_type = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
    size_t scales = 0;
  };
  std::array<bool, 8> constant{};  // by input index
  int64_t hot = 0;                 // the correction's hot channels (attribute hot_channels), their hot_delta rows by channel
  std::vector<int32_t> hot_pos;
  std::atomic<bool> checked{false};  // a call's checks have passed: facts holds them
  Weights facts;
  std::mutex facts_mutex;

  W8Kernel(const OrtApi&, const OrtKernelInfo* info) {
    Ort::ConstKernelInfo ki(info);
    for (size_t i : {1, 2, 3, 5, 6, 7})
      if (i < ki.GetInputCount() && !ki.GetInputName(i).empty()) {
        int is_constant = 0;
        ki.GetTensorConstantInput(i, &is_constant);
        constant[i] = is_constant != 0;
      }
    quant.scale = ki.GetAttribute<float>("x_scale");
    const int64_t zero_point = ki.GetAttribute<int64_t>("x_zero_point");
    if (!(quant.scale > 0.0f) || zero_point < 0 || zero_point > 255)
      throw Ort::Exception("W8A8MatMul: x_scale must be positive and x_zero_point in 0..255", ORT_INVALID_ARGUMENT);
    quant.zero_point = static_cast<int32_t>(zero_point);
    lo = attribute_or<float>(ki, "lo", 0.0f);  // the correction's, when it has a weight table
    hi = attribute_or<float>(ki, "hi", 0.0f);
    epsilon = attribute_or<float>(ki, "epsilon", 0.0f);  // the optional norm's
    gate = attribute_or<int64_t>(ki, "gate", -1);
    up = attribute_or<int64_t>(ki, "up", -1);
    if ((gate < 0) != (up < 0))
      throw Ort::Exception("W8A8MatMul: gate and up come together (SwiGLU's columns of x), or neither", ORT_INVALID_ARGUMENT);
    if (gate >= 0 && ki.GetInputCount() > 5 && !ki.GetInputName(5).empty())
      throw Ort::Exception("W8A8MatMul: a SwiGLU input (gate, up) and a norm do not combine", ORT_INVALID_ARGUMENT);
    const std::vector<int64_t> channels = ints_or_empty(ki, "hot_channels");
    hot = static_cast<int64_t>(channels.size());
    hot_pos = hot_positions(channels, "W8A8MatMul");
    const char* env = std::getenv("LLMC_W8_PACK");
    pack = kW8Packs && constant[1] && attribute_or<int64_t>(ki, "pack", 0) != 0 && !(env != nullptr && std::strcmp(env, "0") == 0);
  }

#if LLMC_W8_PACKED
  // The packed weights of w [k, n] (made by the first call; a call that fails to make them leaves them to the next).
  const W8Packed* packed_weights(Ort::KernelContext& ctx, Ort::ConstValue w, int64_t k, int64_t n, ONNXTensorElementDataType wtype) {
    std::lock_guard<std::mutex> lock(pack_mutex);
    if (packed == nullptr) {
      auto p = std::make_unique<W8Packed>();
      p->groups = (k + 3) / 4;
      p->blocks = (n + kW8Block - 1) / kW8Block;
      p->w.reset(static_cast<int8_t*>(std::aligned_alloc(64, static_cast<size_t>(std::max<int64_t>(1, p->blocks * p->groups) * kW8Block * 4))));
      if (p->w == nullptr) throw Ort::Exception("W8A8MatMul: out of memory for the packed weights", ORT_FAIL);
      p->colsum.resize(static_cast<size_t>(p->blocks * kW8Block));
      W8PackJob job{static_cast<const uint8_t*>(w.GetTensorRawData()), static_cast<uint8_t>(wtype == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8 ? 0x80 : 0), k, n, p.get()};
      ctx.ParallelFor(w8_pack_task, static_cast<size_t>(p->blocks), 0, &job);
      packed = std::move(p);
    }
    return packed.get();
  }
#endif

  // w's and w_scale's facts into f.
  static void check_matrix(Ort::ConstValue w, Ort::ConstValue w_scale, Weights& f) {
    const Ort::TensorTypeAndShapeInfo wi = w.GetTensorTypeAndShapeInfo();
    const std::vector<int64_t> ws = wi.GetShape();
    f.wtype = wi.GetElementType();
    if (f.wtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 && f.wtype != ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8)
      throw Ort::Exception("W8A8MatMul: w must be int8 (zero point 0) or uint8 (zero point 128)", ORT_INVALID_ARGUMENT);
    if (ws.size() != 2)
      throw Ort::Exception("W8A8MatMul: x must be [..., K] and w [K, N] with the same K", ORT_INVALID_ARGUMENT);
    f.k = ws[0];
    f.n = ws[1];
    f.scales = w_scale.GetTensorTypeAndShapeInfo().GetElementCount();
    if (f.scales != 1 && f.scales != static_cast<size_t>(f.n))
      throw Ort::Exception("W8A8MatMul: w_scale must be [N] (per output column) or [1]", ORT_INVALID_ARGUMENT);
  }

  // wt's element type into f, after check_matrix, and its scales' and hot rows' checks (table_of's).
  void check_table(const OrtValue* wt_value, const OrtValue* scale_value, const OrtValue* hot_value, Weights& f) const {
    const Ort::TensorTypeAndShapeInfo ti = Ort::ConstValue{wt_value}.GetTensorTypeAndShapeInfo();
    f.wt_type = ti.GetElementType();
    if (ti.GetShape() != std::vector<int64_t>{f.k, f.n})
      throw Ort::Exception("W8A8MatMul: wt (the outliers' weight table) must be [K, N], as w", ORT_INVALID_ARGUMENT);
    table_of(Ort::ConstValue{wt_value}, scale_value, hot_value, hot_pos, hot, f.k, f.n, "W8A8MatMul");
  }

  static void check_norm(const OrtValue* norm_value, const Weights& f) {
    if (Ort::ConstValue{norm_value}.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(f.k))
      throw Ort::Exception("W8A8MatMul: norm (the RMS norm's weight) must be [K], x's width", ORT_INVALID_ARGUMENT);
  }

  void Compute(OrtKernelContext* context) {
    Ort::KernelContext ctx(context);
    Ort::ConstValue x = ctx.GetInput(0), w = ctx.GetInput(1), w_scale = ctx.GetInput(2);
    const auto optional = [&](size_t i) { return ctx.GetInputCount() > i ? static_cast<const OrtValue*>(ctx.GetInput(i)) : nullptr; };
    const OrtValue *wt_value = optional(3), *residual_value = optional(4), *norm_value = optional(5);
    const OrtValue *scale_value = optional(6), *hot_value = optional(7);
    std::vector<int64_t> shape = x.GetTensorTypeAndShapeInfo().GetShape();
    Weights f;
    const bool known = checked.load(std::memory_order_acquire);
    if (known) f = facts;  // the constant inputs' facts; the others are checked again below
    const bool matrix = known && constant[1] && constant[2];  // wt's and norm's checks compare with w's shape
    if (!matrix) check_matrix(w, w_scale, f);
    if (wt_value != nullptr && !(matrix && constant[3] && (scale_value == nullptr || constant[6]) && (hot_value == nullptr || constant[7])))
      check_table(wt_value, scale_value, hot_value, f);
    if (norm_value != nullptr && !(matrix && constant[5])) check_norm(norm_value, f);
    if (!known) {  // the first call's facts, written once (calls on other threads read them without the lock)
      std::lock_guard<std::mutex> lock(facts_mutex);
      if (!checked.load(std::memory_order_relaxed)) {
        facts = f;
        checked.store(true, std::memory_order_release);
      }
    }
    const bool gated = gate >= 0;
    if (gated && (shape.empty() || std::max(gate, up) > shape.back() - f.k))
      throw Ort::Exception("W8A8MatMul: x must be [..., W] with the gate and up columns (K of each) inside W", ORT_INVALID_ARGUMENT);
    if (!gated && (shape.empty() || shape.back() != f.k))
      throw Ort::Exception("W8A8MatMul: x must be [..., K] and w [K, N] with the same K", ORT_INVALID_ARGUMENT);
    const int64_t k = f.k, n = f.n, rows = leading_rows(shape), width = shape.empty() ? 0 : shape.back();
    const size_t scales = f.scales;
    const ONNXTensorElementDataType wtype = f.wtype;
    Table table;  // the correction's (checked by check_table)
    if (wt_value != nullptr) {
      table.data = Ort::ConstValue{wt_value}.GetTensorRawData();
      table.type = f.wt_type;
      if (table.codes()) table.scale = Ort::ConstValue{scale_value}.GetTensorData<float>();
      if (hot > 0) {
        table.hot_delta = Ort::ConstValue{hot_value}.GetTensorData<float>();
        table.hot_pos = hot_pos.data();
        table.hot_n = static_cast<int64_t>(hot_pos.size());
      }
    }
    shape.back() = n;
    if (residual_value != nullptr && Ort::ConstValue{residual_value}.GetTensorTypeAndShapeInfo().GetShape() != shape)
      throw Ort::Exception("W8A8MatMul: residual must have the result's shape [..., N]", ORT_INVALID_ARGUMENT);
    Ort::UnownedValue y = ctx.GetOutput(0, shape.data(), shape.size());
    float* out = y.GetTensorMutableData<float>();
    const float* residual = residual_value != nullptr ? Ort::ConstValue{residual_value}.GetTensorData<float>() : nullptr;

    // this thread's buffers, kept across calls and grown, never shrunk (a std::vector grown again would zero what it adds:
    // the LM head's sums are 400 KB a token)
    thread_local std::vector<float> normed;
    thread_local std::vector<uint8_t> codes;
    thread_local std::vector<int16_t> a, parts;
    thread_local std::vector<int32_t> partial;
    thread_local Outliers outliers;
    const float* xs = x.GetTensorData<float>();
    if (norm_value != nullptr || gated) {  // the row the op reads: x normalised, or SwiGLU's of x
      grow(normed, rows * k);
      for (int64_t r = 0; r < rows; ++r)
        if (gated)
          swiglu_row(xs + r * width + gate, xs + r * width + up, k, normed.data() + r * k);
        else
          rms_row(xs + r * k, Ort::ConstValue{norm_value}.GetTensorData<float>(), k, epsilon, normed.data() + r * k);
      xs = normed.data();
    }
    grow(codes, k);
#if LLMC_W8_PACKED
    const W8Packed* pw = pack ? packed_weights(ctx, w, k, n, wtype) : nullptr;
    if (pw != nullptr) {
      grow(codes, 4 * pw->groups);
      std::fill(codes.begin() + k, codes.begin() + 4 * pw->groups, 0);  // the last group's rows past K
    }
#else
    const void* pw = nullptr;
#endif
    if (pw == nullptr) {  // the [K, N] path's buffers
      grow(a, k + k % 2);
      grow(parts, k + k % 2);
      if (k % 2 != 0) a[static_cast<size_t>(k)] = 0;  // an odd K's last code pairs with a zero
    }
    // the codes' high parts: (a - lo) / 16 for a in -zero_point..255 - zero_point; 8 at most in magnitude when the zero
    // point is 120..136, and then a pair's sum, 2 * 255 * 8 at most, can be added 8 times in int16
    const int64_t flush = quant.zero_point >= 120 && quant.zero_point <= 136 ? kW8Pairs : kW8Pairs / 2;
    // ranges of whole rows (one for a small matrix), so that there are tasks for the threads and each reads whole rows
    // of weights in order: max_splits at most, two blocks of rows each at least, and none empty (every range's sums
    // are added up, so an empty one would add stale ones)
    const int64_t pairs = (k + 1) / 2;
    const bool parallel = static_cast<size_t>(n * k) >= kParallelWork;
    int64_t splits = parallel ? std::clamp<int64_t>(pairs / (2 * flush), 1, max_splits) : 1;
    const int64_t split_pairs = (pairs + splits - 1) / splits;
    splits = (pairs + split_pairs - 1) / split_pairs;
    if (pw == nullptr) grow(partial, splits * n);
    W8Job job{a.data(), parts.data(), static_cast<const uint8_t*>(w.GetTensorRawData()), partial.data(), k, n, splits, split_pairs, flush,
              static_cast<uint8_t>(wtype == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 ? 0x80 : 0), 0, quant.scale,
              w_scale.GetTensorData<float>(), scales != 1, nullptr};
    if (wt_value != nullptr) {
      find_outliers(xs, rows, k, lo, hi, outliers);
      if (rows == 1) {  // one row (decode): its outliers' table rows are fetched during the sums (see W8Job)
        job.table = static_cast<const char*>(Ort::ConstValue{wt_value}.GetTensorRawData());
        job.channels = outliers.channel.data();
        job.outliers = static_cast<int64_t>(outliers.channel.size());
        job.row_bytes = n * static_cast<int64_t>(table.element_bytes());
      }
    }
    const size_t finishes = static_cast<size_t>((n + kW8Finish - 1) / kW8Finish);
    for (int64_t r = 0; r < rows; ++r) {
      quantize_row(xs + r * k, k, quant, codes.data());
#if LLMC_W8_PACKED
      if (pw != nullptr) {
        W8PackedJob pj{pw, codes.data(), quant.zero_point, quant.scale, w_scale.GetTensorData<float>(), scales != 1, n, out + r * n};
        if (rows == 1 && parallel && wt_value != nullptr && (!outliers.channel.empty() || residual != nullptr)) {
          // decode: the correction's columns are tasks of the loop, and y = residual + (sums + correction) after it
          thread_local std::vector<float> sums;
          grow(sums, n);
          Tiling tiling = correction_tiling(1, n, false);  // its tiles, in groups of about kCorrectionColumns columns
          tiling.group_tiles = std::max<int64_t>(1, kCorrectionColumns / tiling.width);
          tiling.groups = (tiling.tiles + tiling.group_tiles - 1) / tiling.group_tiles;
          tiling.tasks = static_cast<size_t>(tiling.groups);
          auto half = decode_job<uint16_t>(outliers, xs, k, lo, hi, table, sums.data(), n, tiling);
          auto single = decode_job<float>(outliers, xs, k, lo, hi, table, sums.data(), n, tiling);
          auto signed_codes = decode_job<int8_t>(outliers, xs, k, lo, hi, table, sums.data(), n, tiling);
          auto unsigned_codes = decode_job<uint8_t>(outliers, xs, k, lo, hi, table, sums.data(), n, tiling);
          if (outliers.channel.empty()) {
            std::fill(sums.begin(), sums.begin() + n, 0.0f);
          } else if (table.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16) {
            pj.correction = run_task<uint16_t>;
            pj.correction_job = &half;
          } else if (table.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8) {
            pj.correction = run_task<int8_t>;
            pj.correction_job = &signed_codes;
          } else if (table.type == ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8) {
            pj.correction = run_task<uint8_t>;
            pj.correction_job = &unsigned_codes;
          } else {
            pj.correction = run_task<float>;
            pj.correction_job = &single;
          }
          if (pj.correction != nullptr) pj.corrections = static_cast<int64_t>(tiling.tasks);
          ctx.ParallelFor(w8_packed_task, static_cast<size_t>(pj.corrections + pw->blocks), 0, &pj);
          int64_t j = 0;
          for (; j + kNative <= n; j += kNative) {
            const NVec v = nload(out + j) + nload(sums.data() + j);
            nstore(out + j, residual != nullptr ? nload(residual + j) + v : v);
          }
          for (; j < n; ++j) {
            const float v = out[j] + sums[static_cast<size_t>(j)];
            out[j] = residual != nullptr ? residual[j] + v : v;
          }
          return;
        }
        if (parallel)
          ctx.ParallelFor(w8_packed_task, static_cast<size_t>(pw->blocks), 0, &pj);
        else
          for (int64_t b = 0; b < pw->blocks; ++b) w8_packed_task(&pj, static_cast<size_t>(b));
        continue;
      }
#endif
      job.total = 0;
      for (int64_t i = 0; i < k; ++i) {
        a[static_cast<size_t>(i)] = static_cast<int16_t>(codes[static_cast<size_t>(i)] - quant.zero_point);
        job.total += a[static_cast<size_t>(i)];
      }
      for (int64_t i = 0; i < k; i += 2) {  // (a - lo) / 16 and lo, lo in -8..7, for each pair of codes (see w8_rows)
        const int32_t a0 = a[static_cast<size_t>(i)], a1 = a[static_cast<size_t>(i + 1)];
        const int32_t l0 = ((a0 + 8) & 15) - 8, l1 = ((a1 + 8) & 15) - 8;
        parts[static_cast<size_t>(i)] = static_cast<int16_t>(((a0 - l0) >> 4 & 0xff) | ((a1 - l1) >> 4) << 8);
        parts[static_cast<size_t>(i + 1)] = static_cast<int16_t>((l0 & 0xff) | l1 << 8);
      }
      job.y = out + r * n;
      if (splits > 1)
        ctx.ParallelFor(w8_task, static_cast<size_t>(splits), 0, &job);
      else
        w8_task(&job, 0);
      if (parallel && finishes > 1)
        ctx.ParallelFor(w8_finish_task, finishes, 0, &job);
      else
        w8_finish(job, 0, n);
    }
    if (wt_value != nullptr) {  // y = residual + (y + the outliers' correction)
      if (!outliers.channel.empty() || residual != nullptr) {
        correct(ctx, &outliers, xs, k, lo, hi, table, out, residual, out, rows, n);
      }
    } else if (residual != nullptr) {
      for (int64_t i = 0; i < rows * n; ++i) out[i] = residual[i] + out[i];
    }
  }
};

struct W8Op : Ort::CustomOpBase<W8Op, W8Kernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new W8Kernel(api, info); }
  const char* GetName() const { return "W8A8MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 8; }
  ONNXTensorElementDataType GetInputType(size_t i) const {  // w: int8 or uint8, wt: any of a table's (checked when it runs)
    return i == 1 || i == 3 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i >= 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain> domains;  // alive as long as the library: sessions refer to them

}  // namespace

// What this build does beyond the portable paths (llmc.runtime.native.features): bit 0, W8A8MatMul's packed copy
// (pack=1; AVX-512 VNNI); bit 1, chunk attention's bfloat16 products (bf16=1; AVX512_BF16).
extern "C" __attribute__((visibility("default"))) unsigned llmc_features() {
  unsigned features = 0;
#if LLMC_W8_PACKED
  features |= 1u;
#endif
#if LLMC_BF16_CHUNKS
  features |= 2u;
#endif
  return features;
}

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static const ShadowCorrectionOp shadow_correction;
  static const DecodeAttentionOp<float> decode_attention;
  static const DecodeAttentionOp<int8_t> decode_attention_int8;
  static const DecodeAttentionOp<uint16_t> decode_attention_float16;
  static const SwigluOp swiglu;
  static const NormOp rms_norm;
  static const MatVecOp block_q_matmul;
  static const W8Op w8a8_matmul;
  try {
    Ort::CustomOpDomain domain{"ai.llmc"};
    domain.Add(&shadow_correction);
    domain.Add(&decode_attention);
    domain.Add(&decode_attention_int8);
    domain.Add(&decode_attention_float16);
    domain.Add(&swiglu);
    domain.Add(&rms_norm);
    domain.Add(&block_q_matmul);
    domain.Add(&w8a8_matmul);
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
