// The GEMM tester: every backend this CPU can run (ours, oneDNN, the
// reference loops) against a double-precision reference, at tile-edge shapes,
// in the four operand layouts the LM-head step uses (A row-major or
// transposed x B row-major or transposed), with padded leading dimensions
// whose padding holds NaN (a read outside a view shows up as NaN), overwrite
// and accumulate, with and without bias, f32, bf16 and f16 outputs, bf16 and
// f32 inputs and the f16 models' mixes (f16 x f16, f32 x f16, f16 x f32);
// each backend serves exactly the specs its table row says, no fewer, no
// more. An f16 C saturates at +-65504, counted (take_f16_saturations). Then
// the backends that claim batch invariance are held to it bitwise. The amx
// backend's code runs on emulated tiles too wherever the CPU has AVX-512
// (gemm_amx_emulated.hpp), so a CPU without AMX still tests it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "baseline/baseline_gemm.hpp"
#include "gemm_amx_emulated.hpp"
#include "kernels/cpu.hpp"
#include "kernels/f16.hpp"
#include "kernels/gemm.hpp"
#include "kernels/gemm_backend.hpp"

namespace grpo::kernels {
namespace {

std::uint16_t bf16_bits(float v) {
  std::uint32_t b = 0;
  std::memcpy(&b, &v, 4);
  return static_cast<std::uint16_t>(b >> 16);  // v is already a bf16 value
}
float from_bf16(std::uint16_t h) {
  const std::uint32_t b = static_cast<std::uint32_t>(h) << 16;
  float v = 0.0F;
  std::memcpy(&v, &b, 4);
  return v;
}
// A random value exactly representable in bf16 (so every backend multiplies the same numbers).
float bf16_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0F, 2.0F);
  return from_bf16(bf16_bits(u(rng)));
}
// The same for f16 (11 significant bits: a product of two is exact in f32).
float f16_value(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(-2.0F, 2.0F);
  return f16_to_float(float_to_f16(u(rng)));
}

constexpr std::uint16_t kBf16Nan = 0x7fc0;
constexpr std::uint16_t kF16Nan = 0x7e00;

// A matrix in memory: rows x cols with element (i, j) at i * rs + j * cs,
// every element of the allocation outside the view set to NaN.
struct Buffer {
  DType dtype = DType::bf16;
  GemmOperand op;
  std::vector<float> f32;
  std::vector<std::uint16_t> b16;  // bf16 or f16
  void* data() { return dtype == DType::f32 ? static_cast<void*>(f32.data()) : static_cast<void*>(b16.data()); }
  std::size_t index(std::int64_t i, std::int64_t j) const {
    return static_cast<std::size_t>(i * op.row_stride + j * op.col_stride);
  }
  float at(std::int64_t i, std::int64_t j) const {
    const std::size_t k = index(i, j);
    return dtype == DType::f32 ? f32[k] : dtype == DType::f16 ? f16_to_float(b16[k]) : from_bf16(b16[k]);
  }
  void set(std::int64_t i, std::int64_t j, float v) {  // v representable in dtype
    const std::size_t k = index(i, j);
    if (dtype == DType::f32) {
      f32[k] = v;
    } else {
      b16[k] = dtype == DType::f16 ? float_to_f16(v) : bf16_bits(v);
    }
  }
};

Buffer make(DType dtype, std::int64_t rows, std::int64_t cols, bool transposed, std::int64_t pad, std::mt19937& rng) {
  Buffer b;
  b.dtype = dtype;
  // Row-major: ld = cols + pad; transposed (column-major): ld = rows + pad.
  const std::int64_t ld = (transposed ? rows : cols) + pad;
  b.op = transposed ? GemmOperand{dtype, rows, cols, 1, ld} : GemmOperand{dtype, rows, cols, ld, 1};
  const std::int64_t size = (transposed ? cols : rows) * ld;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  if (dtype == DType::f32) {
    b.f32.assign(static_cast<std::size_t>(size), nan);
  } else {
    b.b16.assign(static_cast<std::size_t>(size), dtype == DType::f16 ? kF16Nan : kBf16Nan);
  }
  for (std::int64_t i = 0; i < rows; ++i) {
    for (std::int64_t j = 0; j < cols; ++j) b.set(i, j, dtype == DType::f16 ? f16_value(rng) : bf16_value(rng));
  }
  return b;
}

struct Case {
  std::int64_t m, n, k;
  bool a_t, b_t;  // transposed (column-major) operands
  bool accumulate;
  int bias;  // 0 none, 1 f32, 2 bf16, 3 f16
  DType c_dtype;
  DType a_dtype = DType::bf16;
  DType b_dtype = DType::bf16;
};

DType bias_dtype(int bias) { return bias == 2 ? DType::bf16 : bias == 3 ? DType::f16 : DType::f32; }

std::string name(const Case& c) {
  const std::string inputs = c.a_dtype == DType::bf16 && c.b_dtype == DType::bf16 ? ""
                             : c.a_dtype == DType::f32 && c.b_dtype == DType::f32
                                 ? "_inf32"
                                 : std::string("_in") + to_string(c.a_dtype) + "x" + to_string(c.b_dtype);
  return "M" + std::to_string(c.m) + "N" + std::to_string(c.n) + "K" + std::to_string(c.k) + (c.a_t ? "_At" : "_A") +
         (c.b_t ? "Bt" : "B") + (c.accumulate ? "_acc" : "") +
         (c.bias == 0 ? "" : std::string("_bias") + to_string(bias_dtype(c.bias))) + "_" + to_string(c.c_dtype) +
         inputs;
}

// A backend under test: one of the library's, or (emulated) the amx
// backend's code on emulated AMX tiles (gemm_amx_emulated.hpp), which runs
// on every CPU with AVX-512, AMX or not.
struct Tested {
  GemmBackendKind kind = GemmBackendKind::reference;
  bool emulated = false;
};
std::string to_string(const Tested& t) { return t.emulated ? "amx (emulated tiles)" : to_string(t.kind); }

// The table's backends this CPU runs, the emulated amx beside the amx row.
std::vector<Tested> runnable_backends() {
  std::vector<Tested> kinds;
  for (const GemmBackendEntry& e : gemm_backends()) {
    if (e.unusable() == nullptr) kinds.push_back({e.kind});
    if (e.kind == GemmBackendKind::amx && testing::amx_emulation_runs()) kinds.push_back({e.kind, true});
  }
  return kinds;
}

std::unique_ptr<GemmBackend> make_backend(const Tested& t, const GemmSpec& spec) {
  if (t.emulated) return testing::make_emulated_amx_gemm(spec);
  // oneDNN runs through kernels::Gemm (it needs the engine: see run_on).
  if (t.kind == GemmBackendKind::onednn) return nullptr;
  return gemm_backend(t.kind).make(nullptr, spec, nullptr);
}

// oneDNN 2.6 has no bf16 matmul without AVX-512.
bool onednn_has_bf16() { return cpu_features().cpuid_avx512f && cpu_features().os_zmm; }

// Our blocked microkernel backends (gemm_blocked.hpp).
bool blocked_microkernel(const Tested& t) {
  const GemmBackendKind kind = t.kind;
  return kind == GemmBackendKind::amx || kind == GemmBackendKind::avx512_bf16 || kind == GemmBackendKind::avx512_fma ||
         kind == GemmBackendKind::avx2;
}

bool has_f16(const GemmSpec& spec) {
  return spec.a.dtype == DType::f16 || spec.b.dtype == DType::f16 || spec.c.dtype == DType::f16 ||
         (spec.has_bias && spec.bias_dtype == DType::f16);
}

// Whether a runnable backend takes spec, by its table row (gemm_backend.hpp):
// amx and avx512bf16 bf16 A and B; avx512fma those and any mix of f32, bf16
// and f16 with an f16 A or B (never f32 x f32); avx2 any mix; onednn no f16
// anywhere (and it may refuse bf16 where the CPU has no AVX-512, and f32
// inputs with a bf16 bias or output: `either`); the reference loops all.
enum class Serves : std::uint8_t { yes, no, either };
Serves should_serve(const Tested& t, const GemmSpec& spec) {
  const bool bf16_inputs = spec.a.dtype == DType::bf16 && spec.b.dtype == DType::bf16;
  const bool f16_input = spec.a.dtype == DType::f16 || spec.b.dtype == DType::f16;
  const auto yes_if = [](bool v) { return v ? Serves::yes : Serves::no; };
  switch (t.kind) {
    case GemmBackendKind::amx:
    case GemmBackendKind::avx512_bf16: return yes_if(bf16_inputs);
    case GemmBackendKind::avx512_fma: return yes_if(bf16_inputs || f16_input);
    case GemmBackendKind::avx2:
    case GemmBackendKind::reference: return Serves::yes;
    case GemmBackendKind::onednn: {
      if (has_f16(spec)) return Serves::no;
      const bool any_bf16 = spec.a.dtype == DType::bf16 || spec.c.dtype == DType::bf16 ||
                            (spec.has_bias && spec.bias_dtype == DType::bf16);
      const bool may_refuse = any_bf16 && (!onednn_has_bf16() || spec.a.dtype == DType::f32);
      return may_refuse ? Serves::either : Serves::yes;
    }
  }
  return Serves::either;
}

// The runnable ones of them (the emulated amx among them where it runs).
std::vector<Tested> microkernel_backends() {
  std::vector<Tested> ours;
  for (const Tested& k : runnable_backends()) {
    if (blocked_microkernel(k)) ours.push_back(k);
  }
  return ours;
}

// Runs spec on one backend; returns false when it does not serve the spec.
bool run_on(const Tested& kind, const GemmEngine& engine, const GemmSpec& spec, const void* a, const void* b, void* c,
            const void* bias) {
  std::vector<std::byte> scratch;
  auto aligned = [&](std::size_t bytes) {
    // All ones: NaN as bf16 and as f32, so a backend that reads scratch it
    // did not write (a packing tail taken as zero) gives NaN, not a pass.
    scratch.assign(bytes + 64, std::byte{0xff});
    auto p = reinterpret_cast<std::uintptr_t>(scratch.data());
    return reinterpret_cast<void*>((p + 63) / 64 * 64);
  };
  if (kind.kind == GemmBackendKind::onednn) {
    // Through oneDNN directly: kernels::Gemm would pick ours first.
    std::unique_ptr<Gemm> g;
    try {
      g = std::make_unique<Gemm>(engine, spec, GemmBackendKind::onednn);
    } catch (const Error& e) {
      if (should_serve(kind, spec) == Serves::yes) ADD_FAILURE() << "oneDNN refused: " << e.what();
      EXPECT_EQ(e.kind(), ErrorKind::unsupported) << e.what();
      return false;
    }
    g->run(a, b, c, bias, aligned(g->scratchpad_bytes()));
    return true;
  }
  const std::unique_ptr<GemmBackend> be = make_backend(kind, spec);
  if (be == nullptr) return false;
  be->run(a, b, c, bias, aligned(be->scratchpad_bytes()), nullptr);
  return true;
}

// Every backend of `backends` against the double reference on one case.
void expect_matches_reference(const Case& cs, const std::vector<Tested>& backends) {
  const unsigned seed = 1234U + static_cast<unsigned>(cs.m * 7919 + cs.n * 131 + cs.k);
  std::mt19937 rng(seed);
  Buffer a = make(cs.a_dtype, cs.m, cs.k, cs.a_t, 3, rng);
  Buffer b = make(cs.b_dtype, cs.k, cs.n, cs.b_t, 5, rng);
  Buffer c0 = make(cs.c_dtype, cs.m, cs.n, false, 2, rng);  // the accumulated-into values
  Buffer bias = make(bias_dtype(cs.bias), 1, cs.n, false, 0, rng);
  GemmSpec spec;
  spec.a = a.op;
  spec.b = b.op;
  spec.c = c0.op;
  spec.accumulate = cs.accumulate;
  spec.has_bias = cs.bias != 0;
  spec.bias_dtype = bias.dtype;
  const GemmEngine engine;
  for (const Tested& kind : backends) {
    Buffer c = c0;
    const Serves expected = should_serve(kind, spec);
    if (!run_on(kind, engine, spec, a.data(), b.data(), c.data(), cs.bias != 0 ? bias.data() : nullptr)) {
      if (expected == Serves::yes) ADD_FAILURE() << to_string(kind) << " refused " << name(cs) << ", which it serves";
      continue;
    }
    if (expected == Serves::no) ADD_FAILURE() << to_string(kind) << " served " << name(cs) << ", which it must not";
    int bad = 0;
    for (std::int64_t i = 0; i < cs.m && bad < 5; ++i) {
      for (std::int64_t j = 0; j < cs.n && bad < 5; ++j) {
        double ref = 0.0;
        double mag = 0.0;  // sum |a b| (+ |bias| + |c0|): the scale of the f32 summation error
        for (std::int64_t k = 0; k < cs.k; ++k) {
          const double p = static_cast<double>(a.at(i, k)) * static_cast<double>(b.at(k, j));
          ref += p;
          mag += std::abs(p);
        }
        if (cs.bias != 0) {
          ref += bias.at(0, j);
          mag += std::abs(bias.at(0, j));
        }
        if (cs.accumulate) {
          ref += c0.at(i, j);
          mag += std::abs(c0.at(i, j));
        }
        // f32 summation of k + 2 terms in any order: |err| <= (k + 2) u sum|terms|
        // (u = 2^-24, first order; every product of the inputs' values is
        // exact in f32: at most 11 + 11 significant bits); a bf16 output adds
        // its rounding to nearest, at most bf16's unit roundoff 2^-8 relative
        // (8 significant bits); an f16 output 2^-11 relative (11 bits), or
        // below 2^-14, where f16's subnormals lie 2^-24 apart, 2^-25 absolute.
        double tol = static_cast<double>(cs.k + 2) * std::ldexp(1.0, -24) * mag;
        if (cs.c_dtype == DType::bf16) tol += std::ldexp(1.0, -8) * (std::abs(ref) + tol);
        if (cs.c_dtype == DType::f16) tol += std::ldexp(1.0, -11) * (std::abs(ref) + tol) + std::ldexp(1.0, -25);
        const double got = c.at(i, j);
        if (!(std::abs(got - ref) <= tol)) {
          ++bad;
          ADD_FAILURE() << to_string(kind) << " " << name(cs) << " seed " << seed << " C(" << i << "," << j
                        << ") = " << got << ", reference " << ref << ", tolerance " << tol;
        }
      }
    }
    // Padding between rows (NaN) must be untouched.
    for (std::int64_t i = 0; i < cs.m; ++i) {
      for (std::int64_t j = cs.n; j < c.op.row_stride; ++j) {
        const std::int64_t k = i * c.op.row_stride + j;
        const bool nan = cs.c_dtype == DType::f32   ? std::isnan(c.f32[k])
                         : cs.c_dtype == DType::f16 ? c.b16[k] == kF16Nan
                                                    : c.b16[k] == kBf16Nan;
        if (!nan) ADD_FAILURE() << to_string(kind) << " " << name(cs) << " wrote C padding (" << i << "," << j << ")";
      }
    }
  }
}

class GemmTester : public ::testing::TestWithParam<Case> {};

TEST_P(GemmTester, EveryBackendMatchesDoubleReference) { expect_matches_reference(GetParam(), runnable_backends()); }

// 1, e - 1, e, e + 1 and 2 e + 1 for a tile edge e (the positive ones, once each).
std::vector<std::int64_t> edges_of(std::int64_t e) {
  std::vector<std::int64_t> out;
  for (const std::int64_t v : {std::int64_t{1}, e - 1, e, e + 1, 2 * e + 1}) {
    if (v > 0 && std::find(out.begin(), out.end(), v) == out.end()) out.push_back(v);
  }
  return out;
}

// The A x B dtypes of the GEMMs: bf16 models', and f16 models' (the
// forward's f16 x f16, dhidden's and dW's f32 dlogits x f16, and the mirror).
struct InputDtypes {
  DType a, b;
};
constexpr InputDtypes kInputDtypes[] = {
    {DType::bf16, DType::bf16}, {DType::f16, DType::f16}, {DType::f32, DType::f16}, {DType::f16, DType::f32}};

// XNNPACK's tester: each backend with a register block of its own (tile())
// at shapes around its own mr (M), nr (N) and kr (K), every combination,
// for each A x B dtype pair it serves, the four layouts, accumulate, bias
// and C dtype taken in turn (the shapes above follow the AMX tiles and the
// blocking; these follow each micro).
TEST(GemmTester, EachMicroAtItsOwnTileEdges) {
  GemmSpec probe;
  probe.a = {DType::bf16, 1, 1, 1, 1};
  probe.b = {DType::bf16, 1, 1, 1, 1};
  probe.c = {DType::f32, 1, 1, 1, 1};
  int micros = 0;
  int shapes = 0;
  for (const Tested& t : runnable_backends()) {
    const std::unique_ptr<GemmBackend> be = make_backend(t, probe);
    if (be == nullptr) continue;  // oneDNN: no register block of ours
    const GemmTile tile = be->tile();
    if (tile.mr == 1 && tile.nr == 1 && tile.kr == 1) continue;  // the reference loops
    ++micros;
    SCOPED_TRACE(to_string(t) + " mr " + std::to_string(tile.mr) + " nr " + std::to_string(tile.nr) + " kr " +
                 std::to_string(tile.kr));
    int i = 0;
    for (const InputDtypes in : kInputDtypes) {
      GemmSpec typed = probe;
      typed.a.dtype = in.a;
      typed.b.dtype = in.b;
      if (should_serve(t, typed) != Serves::yes) continue;
      for (const std::int64_t m : edges_of(tile.mr)) {
        for (const std::int64_t n : edges_of(tile.nr)) {
          for (const std::int64_t k : edges_of(tile.kr)) {
            const DType c = i % 5 == 0 ? DType::bf16 : i % 5 == 2 ? DType::f16 : DType::f32;
            expect_matches_reference({m, n, k, i % 2 == 1, (i / 2) % 2 == 1, i % 3 == 0, i % 4, c, in.a, in.b}, {t});
            ++i;
            ++shapes;
          }
        }
      }
    }
  }
  if (micros == 0) GTEST_SKIP() << "no backend with a register block of ours runs on this CPU";
  RecordProperty("micros", micros);
  RecordProperty("shapes", shapes);
}

std::vector<Case> cases() {
  std::vector<Case> out;
  // Tile edges of the AMX kernel (16-row tiles, 32-wide panels, k steps of 32)
  // and of the k / n blocking (K > kc splits the reduction; see gemm_amx.cpp).
  const std::int64_t mn[] = {1, 15, 16, 17, 33, 64};
  const std::int64_t ks[] = {1, 31, 32, 33, 96};
  for (const bool a_t : {false, true}) {
    for (const bool b_t : {false, true}) {
      for (const std::int64_t m : mn) {
        for (const std::int64_t k : ks) {
          const std::int64_t n = mn[(m + k) % 6];
          out.push_back({m, n, k, a_t, b_t, (m + k) % 2 == 1, static_cast<int>((m + n + k) % 3),
                         k % 2 == 0 ? DType::f32 : DType::bf16});
        }
      }
      // The step's own kinds of shape, scaled down: a reduction split into k
      // blocks (K = 3000 over N = 256 takes a 2048-deep block and the rest),
      // a wide N split into column blocks, both at once with several X
      // panels and a tail (X packed as first needed and kept for the later
      // column blocks), and the forward's 160 rows; a wide Y packed whole
      // across its columns (dhidden's W chunk) in k blocks with partial sums
      // (N = 2000: k blocks of 1024 and 476; in one block at 40 x 600 x 2100;
      // N = 3000, too wide for a 1024-deep block, in L2 column blocks).
      out.push_back({33, 256, 3000, a_t, b_t, true, 0, DType::f32});
      out.push_back({17, 2000, 1500, a_t, b_t, false, 1, DType::f32});
      out.push_back({17, 3000, 1500, a_t, b_t, false, 1, DType::f32});
      out.push_back({40, 600, 2100, a_t, b_t, true, 2, DType::f32});
      out.push_back({40, 1100, 640, a_t, b_t, true, 0, DType::bf16});
      out.push_back({160, 300, 256, a_t, b_t, false, 1, DType::f32});
      // f32 A and B (the f32 models' GEMMs), edges and a split reduction.
      out.push_back({17, 33, 31, a_t, b_t, true, 2, DType::f32, DType::f32, DType::f32});
      out.push_back({7, 16, 1, a_t, b_t, false, 1, DType::bf16, DType::f32, DType::f32});
      out.push_back({33, 256, 3000, a_t, b_t, true, 0, DType::f32, DType::f32, DType::f32});
      // The f16 models' GEMMs (f16 x f16, f32 x f16 and f16 x f32 in turn)
      // at the tile edges above, with f16, f32 and bf16 C and every bias
      // dtype in turn; then the step's kinds of shape: dW's split reduction
      // into an f16 C, the forward's 160 rows with an f16 bias and C,
      // dhidden's wide Y in k blocks, column blocks with X kept.
      for (const std::int64_t m : mn) {
        for (const std::int64_t k : ks) {
          const std::int64_t n = mn[(m + 2 * k) % 6];
          const InputDtypes in = kInputDtypes[1 + (m + k) % 3];
          const DType c = (m + n + k) % 3 == 0 ? DType::f32 : (m + n + k) % 3 == 1 ? DType::f16 : DType::bf16;
          out.push_back({m, n, k, a_t, b_t, (m + k) % 2 == 0, static_cast<int>((m + 2 * k) % 4), c, in.a, in.b});
        }
      }
      out.push_back({33, 256, 3000, a_t, b_t, true, 0, DType::f16, DType::f32, DType::f16});
      out.push_back({160, 300, 256, a_t, b_t, false, 3, DType::f16, DType::f16, DType::f16});
      out.push_back({17, 2000, 1500, a_t, b_t, false, 1, DType::f32, DType::f32, DType::f16});
      out.push_back({40, 600, 2100, a_t, b_t, true, 3, DType::f16, DType::f16, DType::f32});
      out.push_back({40, 1100, 640, a_t, b_t, true, 0, DType::f32, DType::f16, DType::f16});
    }
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Shapes, GemmTester, ::testing::ValuesIn(cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return name(i.param); });

// A row's result does not depend on the rows computed with it: rows 0-6 of a
// 7-row call equal rows 0-6 of a 160-row call bitwise, and rows 100-106 of the
// 160-row call equal a 7-row call over those rows, for every backend whose
// traits say so (our AMX, AVX512-BF16, AVX-512 FMA and AVX2 backends), for
// the bf16 models' GEMMs and the f16 models' (f16 x f16 and f32 x f16, into
// an f32 or an f16 C). oneDNN's says not.
TEST(GemmTester, BatchInvariantBackendsAreBitwiseInvariant) {
  std::mt19937 rng(77);
  const std::int64_t k = 4096;
  const std::int64_t n = 384;
  struct Dtypes {
    DType a, b, c;
  };
  for (const Dtypes dt : {Dtypes{DType::bf16, DType::bf16, DType::f32}, Dtypes{DType::f16, DType::f16, DType::f32},
                          Dtypes{DType::f32, DType::f16, DType::f32}, Dtypes{DType::f16, DType::f16, DType::f16}}) {
    const std::size_t c_elem = size_of(dt.c);
    Buffer a = make(dt.a, 160, k, false, 0, rng);
    for (const bool b_t : {false, true}) {
      Buffer b = make(dt.b, k, n, b_t, 0, rng);
      const auto a_rows = [&](std::int64_t r0) {
        return static_cast<const std::byte*>(a.data()) + static_cast<std::size_t>(r0 * k) * size_of(dt.a);
      };
      const std::string what = std::string(to_string(dt.a)) + " x " + to_string(dt.b) + " -> " + to_string(dt.c) +
                               " b_t " + std::to_string(b_t);
      for (const Tested& kind : runnable_backends()) {
        // Ours (the reference is invariant by its loops; oneDNN is not).
        if (!blocked_microkernel(kind)) continue;
        GemmSpec probe;
        probe.a = {dt.a, 160, k, k, 1};
        probe.b = b.op;
        probe.c = {dt.c, 160, n, n, 1};
        if (should_serve(kind, probe) != Serves::yes) continue;
        auto run_rows = [&](std::int64_t r0, std::int64_t rows) {
          GemmSpec spec = probe;
          spec.a.rows = rows;
          spec.c.rows = rows;
          const std::unique_ptr<GemmBackend> be = make_backend(kind, spec);
          EXPECT_TRUE(be->traits().m_independent);
          std::vector<std::byte> scratch(be->scratchpad_bytes() + 64);
          auto p = reinterpret_cast<std::uintptr_t>(scratch.data());
          std::vector<std::byte> c(static_cast<std::size_t>(rows * n) * c_elem);
          be->run(a_rows(r0), b.data(), c.data(), nullptr, reinterpret_cast<void*>((p + 63) / 64 * 64), nullptr);
          return c;
        };
        const std::vector<std::byte> all = run_rows(0, 160);
        const std::vector<std::byte> head = run_rows(0, 7);
        const std::vector<std::byte> mid = run_rows(100, 7);
        EXPECT_EQ(0, std::memcmp(all.data(), head.data(), head.size())) << to_string(kind) << " " << what;
        EXPECT_EQ(0, std::memcmp(all.data() + 100 * n * c_elem, mid.data(), mid.size()))
            << to_string(kind) << " " << what;
        // The unfused baseline splits C's columns over its threads for our
        // backends (baseline_gemm.hpp): the same bits on any count.
        if (!kind.emulated) {
          for (const int threads : {2, 3, 7}) {
            GemmSpec spec = probe;
            spec.threads = threads;
            const GemmEngine engine;
            const grpo::detail::BaselineGemm split(engine, spec, kind.kind);
            std::vector<std::byte> scratch(split.scratchpad_bytes() + 64);
            auto p = reinterpret_cast<std::uintptr_t>(scratch.data());
            std::vector<std::byte> c(all.size());
            split.run(a.data(), b.data(), c.data(), nullptr, reinterpret_cast<void*>((p + 63) / 64 * 64));
            EXPECT_EQ(0, std::memcmp(all.data(), c.data(), all.size()))
                << to_string(kind) << " split over " << threads << " threads, " << what;
          }
        }
      }
    }
  }
}

// One GEMM of a tested backend: through kernels::Gemm (and a GemmBinding for
// a packed operand) for the library's, directly for the emulated one.
class TestedGemm {
 public:
  TestedGemm(const Tested& t, const GemmEngine& engine, const GemmSpec& spec) {
    if (t.emulated) {
      own_ = make_backend(t, spec);
    } else {
      gemm_ = std::make_unique<Gemm>(engine, spec, t.kind);
    }
  }
  std::size_t scratchpad_bytes() const { return own_ ? own_->scratchpad_bytes() : gemm_->scratchpad_bytes(); }
  std::size_t shared_packed_bytes() const { return own_ ? own_->shared_packed_bytes() : gemm_->shared_packed_bytes(); }
  std::size_t scratchpad_bytes_with_packed() const {
    return own_ ? own_->scratchpad_bytes_with_packed() : gemm_->scratchpad_bytes_with_packed();
  }
  void pack_shared(const void* operand, void* packed) const {
    own_ ? own_->pack_shared(operand, packed) : gemm_->pack_shared(operand, packed);
  }
  void run(const void* a, const void* b, void* c, void* scratch, const void* packed = nullptr) const {
    if (own_) {
      own_->run(a, b, c, nullptr, scratch, packed);
    } else if (packed == nullptr) {
      gemm_->run(a, b, c, nullptr, scratch);
    } else {
      GemmBinding(*gemm_).run(a, b, c, nullptr, scratch, packed);
    }
  }

 private:
  std::unique_ptr<Gemm> gemm_;
  std::unique_ptr<GemmBackend> own_;
};

// A shared operand packed once (Gemm::pack_shared) and handed to run() gives
// bitwise the result of the call that packs it itself, and of the same GEMM
// without a shared operand (blocked differently: the shared Y may be taken
// whole), for either operand, both layouts, and shapes that split K and N
// into blocks (K = 4200 is past the shared Y's k block; 4096 x 1100 bf16 is
// past the 8 MiB of a shared Y taken whole).
TEST(GemmTester, SharedOperandPackedOnceIsBitwiseTheSame) {
  const std::vector<Tested> ours = microkernel_backends();
  if (ours.empty()) GTEST_SKIP() << "no microkernel backend runs on this CPU: " << amx_unusable_reason();
  const GemmEngine engine;
  std::mt19937 rng(91);
  struct Shape {
    std::int64_t m, n, k;
  };
  for (const Shape sh : {Shape{160, 300, 256}, Shape{40, 1100, 640}, Shape{33, 256, 3000}, Shape{40, 600, 2100},
                         Shape{17, 40, 4200}, Shape{17, 1100, 4096}, Shape{17, 5, 33}}) {
    for (const SharedOperand shared : {SharedOperand::a, SharedOperand::b}) {
      for (const bool t : {false, true}) {
        // The shared operand bf16, f16 or f32 (an f16 model's dW shares its
        // f16 hidden rows beside f32 dlogits; the mirror packs f32).
        for (const InputDtypes in : kInputDtypes) {
          Buffer a = make(in.a, sh.m, sh.k, t, 1, rng);
          Buffer b = make(in.b, sh.k, sh.n, !t, 2, rng);
          GemmSpec spec;
          spec.a = a.op;
          spec.b = b.op;
          spec.c = {DType::f32, sh.m, sh.n, sh.n, 1};
          spec.shared = shared;
          for (const Tested& kind : ours) {
            if (should_serve(kind, spec) != Serves::yes) continue;
            const TestedGemm g(kind, engine, spec);
            ASSERT_GT(g.shared_packed_bytes(), 0U);
            std::vector<std::byte> scratch(g.scratchpad_bytes() + 64);
            std::vector<std::byte> packed(g.shared_packed_bytes() + 64);
            // Given the packed operand, a run takes less scratch (no Y block of
            // its own to pack into): that much, NaN-filled (a read of scratch
            // it did not write shows in C), then a guard it must not touch.
            const std::size_t with_packed = g.scratchpad_bytes_with_packed();
            ASSERT_LT(with_packed, g.scratchpad_bytes());
            constexpr std::size_t kGuard = 1 << 16;
            std::vector<std::byte> packed_scratch(with_packed + 64 + kGuard, std::byte{0xff});
            const auto align = [](std::vector<std::byte>& v) {
              return reinterpret_cast<void*>((reinterpret_cast<std::uintptr_t>(v.data()) + 63) / 64 * 64);
            };
            std::vector<float> plain(static_cast<std::size_t>(sh.m * sh.n));
            std::vector<float> reused(plain.size());
            g.run(a.data(), b.data(), plain.data(), align(scratch));
            g.pack_shared(shared == SharedOperand::a ? a.data() : b.data(), align(packed));
            // The shared operand's own pointer is not needed once packed.
            g.run(shared == SharedOperand::a ? nullptr : a.data(), shared == SharedOperand::b ? nullptr : b.data(),
                  reused.data(), align(packed_scratch), align(packed));
            const auto* guard = static_cast<const std::byte*>(align(packed_scratch)) + with_packed;
            EXPECT_EQ(std::count(guard, guard + kGuard, std::byte{0xff}), static_cast<std::ptrdiff_t>(kGuard))
                << "a run given the packed operand wrote past scratchpad_bytes_with_packed()";
            EXPECT_EQ(0, std::memcmp(plain.data(), reused.data(), plain.size() * sizeof(float)))
                << "M" << sh.m << " N" << sh.n << " K" << sh.k << " shared " << (shared == SharedOperand::a ? "a" : "b")
                << " transposed " << t << " " << to_string(kind) << " " << to_string(in.a) << " x " << to_string(in.b);
            GemmSpec unshared_spec = spec;
            unshared_spec.shared = SharedOperand::none;
            const TestedGemm u(kind, engine, unshared_spec);
            std::vector<std::byte> u_scratch(u.scratchpad_bytes() + 64);
            std::vector<float> unshared(plain.size());
            u.run(a.data(), b.data(), unshared.data(), align(u_scratch));
            EXPECT_EQ(0, std::memcmp(plain.data(), unshared.data(), plain.size() * sizeof(float)))
                << "unshared: M" << sh.m << " N" << sh.n << " K" << sh.k << " shared "
                << (shared == SharedOperand::a ? "a" : "b") << " transposed " << t << " " << to_string(kind);
          }
        }
      }
    }
  }
}

// The forward's spec (the block's hidden rows shared, a 2048-column W tile,
// H = 4096): every microkernel backend caps the rows of a call
// (GemmTraits::max_shared_rows) so that a call at the cap keeps its scratch
// (packed panels, partial sums) within 16 MiB: 1024 rows for avx512bf16 (its
// shared Y taken whole, 8 MiB), 512 for avx512fma (f32), 640 for amx (Y in
// L2 blocks, 5 MiB of partial sums), 608 for avx2 (the same, its 2048 X rows
// padded to panels of 24).
TEST(GemmTester, SharedRowCapBoundsACallsScratch) {
  const std::vector<Tested> ours = microkernel_backends();
  if (ours.empty()) GTEST_SKIP() << "no microkernel backend runs on this CPU: " << amx_unusable_reason();
  const auto spec_of = [](std::int64_t rows) {
    GemmSpec spec;
    spec.a = {DType::bf16, rows, 4096, 4096, 1};
    spec.b = {DType::bf16, 4096, 2048, 1, 4096};
    spec.c = {DType::f32, rows, 2048, 2048, 1};
    spec.shared = SharedOperand::a;
    return spec;
  };
  for (const Tested& kind : ours) {
    SCOPED_TRACE(to_string(kind));
    const std::int64_t cap = make_backend(kind, spec_of(160))->traits().max_shared_rows;
    const std::int64_t expected = kind.kind == GemmBackendKind::amx          ? 640
                                  : kind.kind == GemmBackendKind::avx2       ? 608
                                  : kind.kind == GemmBackendKind::avx512_fma ? 512
                                                                             : 1024;
    EXPECT_EQ(cap, expected);
    EXPECT_LE(make_backend(kind, spec_of(cap))->scratchpad_bytes(), std::size_t{16} << 20);
  }
}

// The size query (gemm_sizes) names the backend a Gemm of the spec takes and
// its bytes, without building it; oneDNN's from its primitive descriptor.
TEST(GemmTester, SizeQueryMatchesTheBuiltGemm) {
  const GemmEngine engine;
  for (const InputDtypes in : {InputDtypes{DType::bf16, DType::bf16}, InputDtypes{DType::f32, DType::f32},
                               InputDtypes{DType::f16, DType::f16}, InputDtypes{DType::f32, DType::f16}}) {
    for (const SharedOperand shared : {SharedOperand::none, SharedOperand::a}) {
      GemmSpec spec;
      spec.a = {in.a, 160, 3000, 3000, 1};
      spec.b = {in.b, 3000, 700, 1, 3000};
      spec.c = {DType::f32, 160, 700, 700, 1};
      spec.shared = shared;
      const GemmSizes sizes = gemm_sizes(engine, spec);
      const Gemm gemm(engine, spec);
      SCOPED_TRACE(gemm.implementation());
      EXPECT_EQ(sizes.backend, gemm.backend());
      EXPECT_EQ(sizes.scratchpad_bytes, gemm.scratchpad_bytes());
      EXPECT_EQ(sizes.shared_packed_bytes, gemm.shared_packed_bytes());
      EXPECT_EQ(sizes.scratchpad_bytes_with_packed, gemm.scratchpad_bytes_with_packed());
      EXPECT_EQ(sizes.traits.m_independent, gemm.traits().m_independent);
      EXPECT_EQ(sizes.traits.max_shared_rows, gemm.traits().max_shared_rows);
      if (has_f16(spec)) {
        // oneDNN's size query refuses what its Gemm refuses.
        EXPECT_THROW(detail::onednn_scratchpad_bytes(engine, spec), Error);
      } else if (in.a == DType::f32 || onednn_has_bf16()) {
        EXPECT_EQ(detail::onednn_scratchpad_bytes(engine, spec),
                  Gemm(engine, spec, GemmBackendKind::onednn).scratchpad_bytes());
      }
    }
  }
}

// An f16 C saturates (f16.hpp's float_to_f16_saturated, docs/semantics.md
// "fp16"): an entry whose f32 value would round to an fp16 infinity (|v| >=
// 65520) is written as +-65504 (0x7bff / 0xfbff) and counted by
// take_f16_saturations(); 65504 <= |v| < 65520 rounds to 65504 and is not
// counted; a NaN stays NaN. The inputs are small integers, so every backend's
// f32 sums are exact in any order and each entry's bits are known: integers
// up to 256 into overflowing products (overwrite), and into C values next to
// 65504 that small sums (and an f16 bias) push across 65520 or not
// (accumulate); a NaN in A's row 2. Every backend that serves the spec, in
// the four layouts (so both orientations of the blocked GEMM), bf16 inputs
// too (amx's and avx512bf16's epilogue).
TEST(GemmTester, F16OutputSaturatesAtItsLargestFiniteAndCounts) {
  const GemmEngine engine;
  std::mt19937 rng(4242);
  const std::int64_t m = 19, n = 37, k = 3;
  int swapped_runs = 0;
  for (const InputDtypes in : {InputDtypes{DType::f16, DType::f16}, InputDtypes{DType::f32, DType::f16},
                               InputDtypes{DType::f16, DType::f32}, InputDtypes{DType::bf16, DType::bf16}}) {
    for (const bool accumulate : {false, true}) {
      for (int layout = 0; layout < 4; ++layout) {
        const bool a_t = layout % 2 == 1;
        const bool b_t = layout / 2 == 1;
        // Overwrite: |products| up to 2^16 (past 65504), sums of three up to
        // 3 * 2^16 (exact in f32). Accumulate: sums of at most 3 * 36 onto
        // C values within 64 of +-65504.
        const int big = accumulate ? 6 : 256;
        std::uniform_int_distribution<int> value(-big, big);
        Buffer a = make(in.a, m, k, a_t, 3, rng);
        Buffer b = make(in.b, k, n, b_t, 5, rng);
        Buffer c0 = make(DType::f16, m, n, false, 2, rng);
        Buffer bias = make(DType::f16, 1, n, false, 0, rng);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t kk = 0; kk < k; ++kk) a.set(i, kk, static_cast<float>(value(rng)));
        }
        for (std::int64_t kk = 0; kk < k; ++kk) {
          for (std::int64_t j = 0; j < n; ++j) b.set(kk, j, static_cast<float>(value(rng)));
        }
        const float near_max[] = {65504.0F, -65504.0F, 65472.0F, -65472.0F, 65440.0F, -65440.0F, 1000.0F};
        std::uniform_int_distribution<int> pick(0, std::size(near_max) - 1);
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) c0.set(i, j, near_max[pick(rng)]);
        }
        std::uniform_int_distribution<int> small(-4, 4);
        for (std::int64_t j = 0; j < n; ++j) bias.set(0, j, static_cast<float>(small(rng)));
        const float nan = std::numeric_limits<float>::quiet_NaN();
        a.set(2, 0, in.a == DType::f32 ? nan : in.a == DType::f16 ? f16_to_float(kF16Nan) : from_bf16(kBf16Nan));
        GemmSpec spec;
        spec.a = a.op;
        spec.b = b.op;
        spec.c = c0.op;
        spec.accumulate = accumulate;
        spec.has_bias = accumulate;
        spec.bias_dtype = DType::f16;
        // The expected bits: the exact sum (an integer below 2^24, so the
        // f32 every backend computes) through float_to_f16_saturated.
        std::vector<std::uint16_t> want(c0.b16.size());
        std::int64_t want_saturated = 0;
        int in_band = 0;  // entries in [65504, 65520): rounded to 65504, not counted
        for (std::int64_t i = 0; i < m; ++i) {
          for (std::int64_t j = 0; j < n; ++j) {
            double sum = 0.0;
            for (std::int64_t kk = 0; kk < k; ++kk) sum += static_cast<double>(a.at(i, kk)) * b.at(kk, j);
            if (accumulate) sum += static_cast<double>(bias.at(0, j)) + c0.at(i, j);
            const double mag = std::abs(sum);
            if (mag >= 65504.0 && mag < 65520.0) ++in_band;
            want[c0.index(i, j)] = float_to_f16_saturated(static_cast<float>(sum), &want_saturated);
          }
        }
        ASSERT_GT(want_saturated, 0) << "the inputs must overflow somewhere";
        if (accumulate) EXPECT_GT(in_band, 0) << "the inputs should land in [65504, 65520) somewhere";
        for (const Tested& kind : runnable_backends()) {
          const Serves expected = should_serve(kind, spec);
          if (expected == Serves::no) continue;
          SCOPED_TRACE(to_string(kind) + " " + to_string(in.a) + " x " + to_string(in.b) + " layout " +
                       std::to_string(layout) + (accumulate ? " accumulate" : "") + " (seed 4242)");
          Buffer c = c0;
          take_f16_saturations();  // from zero
          if (!run_on(kind, engine, spec, a.data(), b.data(), c.data(), accumulate ? bias.data() : nullptr)) {
            if (expected == Serves::yes) ADD_FAILURE() << "refused a spec it serves";
            continue;
          }
          if (const std::unique_ptr<GemmBackend> be = make_backend(kind, spec); be != nullptr) {
            if (std::string(be->implementation()).find("swapped") != std::string::npos) ++swapped_runs;
          }
          EXPECT_EQ(take_f16_saturations(), want_saturated);
          EXPECT_EQ(take_f16_saturations(), 0) << "the call resets the count";
          int bad = 0;
          for (std::int64_t i = 0; i < m && bad < 5; ++i) {
            for (std::int64_t j = 0; j < n && bad < 5; ++j) {
              const std::uint16_t got = c.b16[c.index(i, j)];
              const std::uint16_t w = want[c0.index(i, j)];
              // A NaN's sign and payload are the arithmetic's; NaN it must be.
              const bool is_nan = (w & 0x7fffU) > 0x7c00U;
              if (is_nan ? (got & 0x7fffU) <= 0x7c00U : got != w) {
                ++bad;
                ADD_FAILURE() << "C(" << i << "," << j << ") = 0x" << std::hex << got << ", want 0x" << w;
              }
              if ((got & 0x7fffU) == 0x7c00U) ADD_FAILURE() << "C(" << i << "," << j << ") is an infinity";
            }
          }
        }
      }
    }
  }
  if (avx512_fma_usable() || avx2_gemm_usable()) EXPECT_GT(swapped_runs, 0) << "no run took the swapped store";
}

// A GEMM with an f16 operand goes to ours: oneDNN refuses f16 anywhere (A,
// B, C or bias: its f16 matmul needs AVX512-FP16), cleanly (Error
// unsupported, no primitive), and the default list gives an f16 A or B to
// avx512fma on an AVX-512 CPU, to avx2 on an AVX2 one; the bf16 and f32
// GEMMs keep the backends they had.
TEST(GemmTester, F16GemmsGoToOursAndOneDnnRefusesThem) {
  const GemmEngine engine;
  const auto spec_of = [](DType a, DType b, DType c, DType bias) {
    GemmSpec spec;
    spec.a = {a, 64, 256, 256, 1};
    spec.b = {b, 256, 96, 1, 256};
    spec.c = {c, 64, 96, 96, 1};
    spec.has_bias = true;
    spec.bias_dtype = bias;
    return spec;
  };
  const GemmSpec f16_specs[] = {spec_of(DType::f16, DType::f16, DType::f32, DType::f32),
                                spec_of(DType::f32, DType::f16, DType::f16, DType::f32),
                                spec_of(DType::f16, DType::f32, DType::f32, DType::f16),
                                spec_of(DType::bf16, DType::bf16, DType::f16, DType::f32),
                                spec_of(DType::f32, DType::f32, DType::f32, DType::f16)};
  for (const GemmSpec& spec : f16_specs) {
    SCOPED_TRACE(std::string(to_string(spec.a.dtype)) + " x " + to_string(spec.b.dtype) + " -> " +
                 to_string(spec.c.dtype) + " + " + to_string(spec.bias_dtype) + " bias");
    try {
      const Gemm g(engine, spec, GemmBackendKind::onednn);
      ADD_FAILURE() << "onednn served an f16 spec: " << g.implementation();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::unsupported) << e.what();
      EXPECT_NE(std::string(e.what()).find("f16"), std::string::npos) << e.what();
    }
    EXPECT_THROW(detail::onednn_scratchpad_bytes(engine, spec), Error);
    if (forced_gemm_backend() != nullptr) continue;  // GRPO_GEMM picks, not the default list
    const Gemm g(engine, spec);
    EXPECT_NE(g.backend(), GemmBackendKind::onednn) << g.implementation();
    EXPECT_EQ(gemm_sizes(engine, spec).backend, g.backend());
    if (spec.a.dtype == DType::f16 || spec.b.dtype == DType::f16) {
      if (avx512_fma_usable()) {
        EXPECT_EQ(g.backend(), GemmBackendKind::avx512_fma) << g.implementation();
      } else if (avx2_gemm_usable()) {
        EXPECT_EQ(g.backend(), GemmBackendKind::avx2) << g.implementation();
      }
    }
  }
  if (forced_gemm_backend() != nullptr) GTEST_SKIP() << "GRPO_GEMM is set: the default list was not checked";
  // Unchanged by f16: on an AMD CPU with AVX512-BF16 (no AMX) the bf16 GEMMs
  // stay with avx512bf16, and on any AVX-512 CPU the f32 ones with oneDNN.
  const GemmSpec bf16 = spec_of(DType::bf16, DType::bf16, DType::f32, DType::f32);
  if (avx512_bf16_usable() && !amx_usable() && !cpu_features().intel) {
    EXPECT_EQ(Gemm(engine, bf16).backend(), GemmBackendKind::avx512_bf16);
  }
  const GemmSpec f32 = spec_of(DType::f32, DType::f32, DType::f32, DType::f32);
  if (avx512_fma_usable()) EXPECT_EQ(Gemm(engine, f32).backend(), GemmBackendKind::onednn);
}

TEST(GemmTester, SaysWhichBackendsThisCpuSkips) {
  std::string skipped;
  for (const GemmBackendEntry& e : gemm_backends()) {
    const char* why = e.unusable();
    if (why == nullptr) continue;
    const bool emulated = e.kind == GemmBackendKind::amx && testing::amx_emulation_runs();
    skipped += std::string(e.name) + " (" + why + (emulated ? "; its code ran on emulated tiles) " : ") ");
  }
  if (!onednn_has_bf16()) skipped += "onednn on bf16 (oneDNN 2.6 has no bf16 matmul without AVX-512)";
  if (!skipped.empty()) GTEST_SKIP() << "backends not tested on this CPU: " << skipped;
  SUCCEED();
}

}  // namespace
}  // namespace grpo::kernels
