// kernels::Gemm: the backend gemm_backend.hpp's table picks for a spec, and
// the size query that picks the same one without building it.
#include "kernels/gemm.hpp"

#include <cstdlib>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace grpo::kernels {

const char* forced_gemm_backend() {
  const char* v = std::getenv("GRPO_GEMM");
  return v != nullptr && *v != '\0' ? v : nullptr;
}

namespace {

// take_f16_saturations()'s count: a thread's own, as our backends run on the
// calling thread and a driver takes it on the thread that ran the GEMM.
thread_local std::int64_t f16_saturations = 0;

// The backends a Gemm of the default list, or of GRPO_GEMM, tries in order:
// the table's default list; or the forced backend, then onednn, then
// reference (amx heads the default list: forcing it keeps the list).
std::vector<const GemmBackendEntry*> candidates(const GemmSpec& spec) {
  std::vector<const GemmBackendEntry*> out;
  const char* forced = forced_gemm_backend();
  if (forced == nullptr || std::string_view(forced) == "amx") {
    for (const GemmBackendEntry& e : gemm_backends()) {
      if (e.in_default_list(spec)) out.push_back(&e);
    }
    return out;
  }
  const GemmBackendEntry* named = find_gemm_backend(forced);
  if (named == nullptr) {
    std::string names;
    for (const GemmBackendEntry& e : gemm_backends()) names += std::string(names.empty() ? "" : ", ") + e.name;
    throw Error("GRPO_GEMM", "unknown GEMM backend '" + std::string(forced) + "' (" + names + ")");
  }
  out.push_back(named);
  for (const GemmBackendKind fallback : {GemmBackendKind::onednn, GemmBackendKind::reference}) {
    if (named->kind != fallback) out.push_back(&gemm_backend(fallback));
  }
  return out;
}

}  // namespace

std::int64_t take_f16_saturations() { return std::exchange(f16_saturations, 0); }

void detail::add_f16_saturations(std::int64_t n) { f16_saturations += n; }

GemmTraits gemm_traits(const GemmSpec& spec) {
  for (const GemmBackendEntry* e : candidates(spec)) {
    if (e->fixed_traits != nullptr) return e->fixed_traits();
    const std::unique_ptr<GemmBackend> b = e->make(nullptr, spec, nullptr);  // ours are cheap to build
    if (b != nullptr) return b->traits();
  }
  return {};
}

GemmSizes gemm_sizes(const GemmEngine& engine, const GemmSpec& spec) {
  for (const GemmBackendEntry* e : candidates(spec)) {
    if (e->kind == GemmBackendKind::onednn) {
      try {
        const std::size_t bytes = detail::onednn_scratchpad_bytes(engine, spec);
        return {e->kind, bytes, 0, bytes, e->fixed_traits()};
      } catch (const Error&) {
        continue;  // as the Gemm: on to the reference loops
      }
    }
    const std::unique_ptr<GemmBackend> b = e->make(&engine, spec, nullptr);
    if (b != nullptr) {
      return {b->kind(), b->scratchpad_bytes(), b->shared_packed_bytes(), b->scratchpad_bytes_with_packed(),
              b->traits()};
    }
  }
  return {};
}

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec) : spec_(spec) {
  for (const GemmBackendEntry* e : candidates(spec)) {
    backend_ = e->make(&engine, spec, nullptr);
    if (backend_ != nullptr) return;
  }
}

Gemm::Gemm(const GemmEngine& engine, const GemmSpec& spec, GemmBackendKind backend) : spec_(spec) {
  const GemmBackendEntry& e = gemm_backend(backend);
  std::string why_not;
  backend_ = e.make(&engine, spec, &why_not);
  if (backend_ != nullptr) return;
  if (why_not.empty()) {
    const char* cpu = e.unusable();
    why_not =
        std::string("the ") + e.name + " backend cannot serve this GEMM: " +
        (cpu == nullptr ? "it does not take these dtypes or strides (gemm_backend.hpp says which it takes)" : cpu);
  }
  throw Error("gemm", why_not, ErrorKind::unsupported);
}

Gemm::~Gemm() = default;
Gemm::Gemm(Gemm&&) noexcept = default;
Gemm& Gemm::operator=(Gemm&&) noexcept = default;

}  // namespace grpo::kernels
