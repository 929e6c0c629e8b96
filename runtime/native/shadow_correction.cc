// llmc's native CPU kernels: an ONNX Runtime custom-op library (domain "ai.llmc").
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

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

namespace {

constexpr int64_t kTile = 256;  // output columns per task: 1 KiB of a weight row, of an output row

constexpr int64_t kScan = 64;  // x entries checked at once for an outlier (a vectorised test)
constexpr int64_t kBlockRows = 32;  // a task's rows: blocks of at least this many, at most 8 blocks
constexpr size_t kParallelWork = 1 << 16;  // multiply-adds below which one thread does it all

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
    // row blocks of about kBlockRows rows, so that even a few column tiles make enough tasks for the pool
    const int64_t row_blocks = std::max<int64_t>(1, std::min<int64_t>(rows / kBlockRows, 8));
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

std::mutex domains_mutex;
std::vector<Ort::CustomOpDomain> domains;  // alive as long as the library: sessions refer to them

}  // namespace

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  Ort::InitApi(api_base->GetApi(ORT_API_VERSION));
  static const ShadowCorrectionOp shadow_correction;
  try {
    Ort::CustomOpDomain domain{"ai.llmc"};
    domain.Add(&shadow_correction);
    Ort::UnownedSessionOptions(options).Add(domain);
    std::lock_guard<std::mutex> lock(domains_mutex);
    domains.push_back(std::move(domain));
  } catch (const Ort::Exception& e) {
    return Ort::Status(e).release();
  }
  return nullptr;
}
