// grpo._core: the nanobind binding of the C++ library.
//
// Arrays arrive through DLPack (any framework: torch, numpy, ...) and are
// viewed in place: no copy. This layer checks what DLPack can tell (device,
// dtype, rank, inner stride, contiguity) and names the argument when it
// refuses; the library validates the rest before it writes any output. The
// GIL is released while a plan is built and while it executes.
//
// Exceptions: grpo::Error becomes grpo.Error (a ValueError), or
// grpo.UnsupportedError (a NotImplementedError) / MemoryError for the
// library's "unsupported" / "out of memory" refusals; a wrong dtype is a
// grpo.ArgumentTypeError (a TypeError). Each carries .argument, the name of
// the offending argument.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>

#include "grpo/grpo.hpp"

namespace nb = nanobind;
using namespace nb::literals;

// The one declared list of the C++ option structs' fields Python can set.
// Each list drives the binding (def_rw per field) and is exported as
// LossConfig.fields / LmHeadOptions.fields, from which grpo.torch builds its
// configurations, its plan-cache keys and the names its refusals give
// (python/grpo/_fields.py); python/tests/test_fields.py walks the C++ headers
// and fails on a field that is in neither a list nor LmHeadOptions' unbound
// ones below.
// clang-format off
#define GRPO_LOSS_CONFIG_FIELDS(X) \
  X(loss_type)                     \
  X(importance_sampling_level)     \
  X(epsilon_low)                   \
  X(epsilon_high)                  \
  X(delta)                         \
  X(beta)                          \
  X(kl_bias_correction)            \
  X(kl_estimator)                  \
  X(kl_clamp)                      \
  X(temperature)                   \
  X(temperature_on_logp)           \
  X(max_completion_length)         \
  X(num_items_in_batch)            \
  X(sapo_tau_pos)                  \
  X(sapo_tau_neg)                  \
  X(vespo_k_pos)                   \
  X(vespo_lambda_pos)              \
  X(vespo_k_neg)                   \
  X(vespo_lambda_neg)              \
  X(off_policy_mask_threshold)     \
  X(clip_ratio_c)                  \
  X(entropy_coef)                  \
  X(top_entropy_quantile)          \
  X(logit_softcap)                 \
  X(logit_scale)
#define GRPO_LM_HEAD_OPTIONS_FIELDS(X) \
  X(token_block)                       \
  X(vocab_tile)                        \
  X(workspace_budget)                  \
  X(max_threads)                       \
  X(forward_only)                      \
  X(dweight_dtype)                     \
  X(dhidden_dtype)                     \
  X(accumulate_weight_grads)           \
  X(frozen_weight)                     \
  X(grad_filter)
// clang-format on
// LmHeadOptions fields with no field binding: Python plans use the default
// allocator; scale_out's groups are LmHeadLossPlan's and LmHeadLogProbPlan's
// vocab_group / data_group keywords (Communicator objects, kept alive by the plan).
constexpr const char* kUnboundOptions[] = {"allocator", "scale_out"};

namespace {

// A wrong element type, translated to grpo.ArgumentTypeError (a TypeError).
struct ArgumentTypeError {
  std::string argument;
  std::string message;
};

using Array = nb::ndarray<>;
using OptArray = std::optional<Array>;

PyObject* g_error = nullptr;              // grpo.Error(ValueError)
PyObject* g_unsupported_error = nullptr;  // grpo.UnsupportedError(NotImplementedError)
PyObject* g_type_error = nullptr;         // grpo.ArgumentTypeError(TypeError)

[[noreturn]] void refuse(const std::string& argument, const std::string& message) {
  throw grpo::Error(argument, message);
}

bool is_f32(nb::dlpack::dtype d) { return d == nb::dtype<float>(); }
bool is_f16(nb::dlpack::dtype d) {
  return d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Float) && d.bits == 16 && d.lanes == 1;
}
bool is_bf16(nb::dlpack::dtype d) {
  return d.code == static_cast<std::uint8_t>(nb::dlpack::dtype_code::Bfloat) && d.bits == 16 && d.lanes == 1;
}

std::string dtype_name(nb::dlpack::dtype d) {
  static const char* const codes[] = {"int", "uint", "float", "opaque", "bfloat", "complex", "bool"};
  const std::string code = d.code < 7 ? codes[d.code] : "code" + std::to_string(d.code);
  return code + std::to_string(d.bits) + (d.lanes != 1 ? "x" + std::to_string(d.lanes) : "");
}

void check_cpu(const Array& a, const char* name) {
  if (a.device_type() != nb::device::cpu::value) {
    refuse(name, "is not a CPU array (DLPack device type " + std::to_string(a.device_type()) + ")");
  }
}

grpo::DType float_dtype(const Array& a, const char* name) {
  if (is_f32(a.dtype())) return grpo::DType::f32;
  if (is_bf16(a.dtype())) return grpo::DType::bf16;
  if (is_f16(a.dtype())) return grpo::DType::f16;
  throw ArgumentTypeError{name, "must be float32, bfloat16 or float16, got " + dtype_name(a.dtype())};
}

// The row stride the plan is keyed on: stride(0), or cols for a single row
// (whose stride is meaningless). grpo/_views.py computes the same.
std::int64_t row_stride(const Array& a) { return a.shape(0) > 1 ? a.stride(0) : static_cast<std::int64_t>(a.shape(1)); }

// A 2-D array with unit inner stride and any row stride >= cols.
template <typename View, typename Ptr>
View matrix(const Array& a, const char* name, Ptr data) {
  check_cpu(a, name);
  if (a.ndim() != 2) refuse(name, "must be 2-D, got " + std::to_string(a.ndim()) + " dimensions");
  if (a.shape(1) > 1 && a.stride(1) != 1) {
    refuse(name, "must have unit inner stride, got " + std::to_string(a.stride(1)));
  }
  const std::int64_t ld = row_stride(a);
  if (ld < static_cast<std::int64_t>(a.shape(1))) {
    refuse(name,
           "row stride " + std::to_string(ld) + " is smaller than its " + std::to_string(a.shape(1)) + " columns");
  }
  return {data, float_dtype(a, name), static_cast<std::int64_t>(a.shape(0)), static_cast<std::int64_t>(a.shape(1)), ld};
}

grpo::MatrixView in_matrix(const Array& a, const char* name) { return matrix<grpo::MatrixView>(a, name, a.data()); }
grpo::MutMatrixView out_matrix(const std::optional<Array>& a, const char* name) {
  if (!a) return {};
  return matrix<grpo::MutMatrixView>(*a, name, a->data());
}

// A C-contiguous array of any rank, viewed as a flat span of T.
template <typename T>
std::span<T> flat(const OptArray& a, const char* name) {
  if (!a) return {};
  check_cpu(*a, name);
  using Elem = std::remove_const_t<T>;
  if (a->dtype() != nb::dtype<Elem>()) {
    const char* want = std::is_same_v<Elem, float> ? "float32" : std::is_same_v<Elem, std::int32_t> ? "int32" : "int64";
    throw ArgumentTypeError{name, std::string("must be ") + want + ", got " + dtype_name(a->dtype())};
  }
  std::int64_t expected = 1;
  for (std::size_t i = a->ndim(); i-- > 0;) {
    if (a->shape(i) != 1 && a->stride(i) != expected) refuse(name, "must be contiguous");
    expected *= static_cast<std::int64_t>(a->shape(i));
  }
  return {static_cast<T*>(a->data()), a->size()};
}

// A grpo::Communicator whose collectives are a Python object's methods
// (grpo.distributed.TorchCommunicator runs them on a torch.distributed
// process group): rank() and size() are read once, allgather(send, recv) and
// alltoall(send, recv) are called with uint8 NumPy views of the library's
// buffers (valid for the call only), the GIL taken for the call. A Python
// exception propagates out of the plan's constructor or execute().
class PyCommunicator final : public grpo::Communicator {
 public:
  explicit PyCommunicator(nb::object impl)
      : impl_(std::move(impl)), rank_(nb::cast<int>(impl_.attr("rank")())), size_(nb::cast<int>(impl_.attr("size")())) {
    if (size_ < 1 || rank_ < 0 || rank_ >= size_) {
      throw grpo::Error("communicator", "rank() must lie in [0, size()) and size() >= 1");
    }
  }
  PyCommunicator(const PyCommunicator&) = delete;
  PyCommunicator& operator=(const PyCommunicator&) = delete;
  ~PyCommunicator() override {
    nb::gil_scoped_acquire gil;
    impl_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const nb::object& impl() const { return impl_; }

  void allgather(const void* send, void* recv, std::size_t bytes) const override {
    call("allgather", send, bytes, recv, bytes * static_cast<std::size_t>(size_));
  }
  void alltoall(const void* send, void* recv, std::size_t bytes) const override {
    const std::size_t all = bytes * static_cast<std::size_t>(size_);
    call("alltoall", send, all, recv, all);
  }

 private:
  using Bytes = nb::ndarray<nb::numpy, std::uint8_t, nb::ndim<1>>;
  void call(const char* method, const void* send, std::size_t send_bytes, void* recv, std::size_t recv_bytes) const {
    nb::gil_scoped_acquire gil;
    // send may lie inside recv (an in-place allgather): both are plain views.
    // rv_policy::reference: views of the library's memory (an ndarray without an owner is otherwise copied).
    Bytes send_view(const_cast<void*>(send), {send_bytes}, nb::handle());
    Bytes recv_view(recv, {recv_bytes}, nb::handle());
    impl_.attr(method)(nb::cast(send_view, nb::rv_policy::reference), nb::cast(recv_view, nb::rv_policy::reference));
  }

  nb::object impl_;
  int rank_;
  int size_;
};

// The workspace every plan of a cache shares: 64-byte aligned, grown to the
// largest plan's size and never shrunk, so a training loop allocates it once.
// The mutex serializes the executes that share it.
class Workspace {
 public:
  Workspace() = default;
  Workspace(const Workspace&) = delete;
  Workspace& operator=(const Workspace&) = delete;

  // Holds the lock for the duration of one execute.
  std::span<std::byte> acquire(std::size_t bytes, std::unique_lock<std::mutex>& lock) {
    lock = std::unique_lock<std::mutex>(mutex_);
    if (bytes > size_) {
      const std::size_t rounded = (bytes + kAlign - 1) / kAlign * kAlign;
      buffer_.reset(static_cast<std::byte*>(std::aligned_alloc(kAlign, rounded)));
      if (!buffer_) {
        size_ = 0;
        throw std::bad_alloc();
      }
      size_ = rounded;
      ++allocations_;
    }
    return {buffer_.get(), size_};
  }

  std::size_t size() const { return size_; }
  std::int64_t allocations() const { return allocations_; }

 private:
  static constexpr std::size_t kAlign = 64;  // what LmHeadLossPlan::execute requires
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::mutex mutex_;
  std::unique_ptr<std::byte, Free> buffer_;
  std::size_t size_ = 0;
  std::int64_t allocations_ = 0;
};

// What one execute / forward / backward did: the library's LmHeadStepStats
// and the wall time of the C++ call (GIL released, validation included), so a
// benchmark can print kernel time beside the Python call's time.
struct StepStats {
  grpo::LmHeadStepStats step;
  double kernel_s = 0.0;
};

template <typename Call>
void timed(StepStats* stats, Call&& call) {
  const auto t0 = std::chrono::steady_clock::now();
  call(stats != nullptr ? &stats->step : nullptr);
  if (stats != nullptr) {
    stats->kernel_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

// The arrays are keyword-only in Python (plan.execute(workspace, hidden=..., ...)): the required ones first, the
// optional ones (None by default) after.
grpo::Metrics execute_lm_head(const grpo::LmHeadLossPlan& plan, Workspace* workspace, const Array& hidden,
                              const Array& weight, const Array& ids, const Array& mask, const Array& advantages,
                              const Array& logp, const OptArray& bias, const OptArray& old_logp,
                              const OptArray& ref_logp, const OptArray& is_weight, const OptArray& sequence_offsets,
                              const OptArray& entropy, const OptArray& kl, const OptArray& dhidden,
                              const OptArray& dweight, const OptArray& dbias, double grad_scale, StepStats* stats) {
  grpo::LmHeadInputs in;
  in.grad_scale = grad_scale;
  in.hidden = in_matrix(hidden, "hidden");
  in.weight = in_matrix(weight, "weight");
  if (bias) {
    check_cpu(*bias, "bias");
    if (bias->ndim() != 1) refuse("bias", "must be 1-D");
    if (bias->shape(0) > 1 && bias->stride(0) != 1) refuse("bias", "must be contiguous");
    in.bias = {bias->data(), float_dtype(*bias, "bias"), static_cast<std::int64_t>(bias->shape(0))};
  }
  in.batch.ids = flat<const std::int32_t>(ids, "ids");
  in.batch.mask = flat<const float>(mask, "mask");
  in.batch.advantages = flat<const float>(advantages, "advantages");
  in.batch.old_logp = flat<const float>(old_logp, "old_logp");
  in.batch.ref_logp = flat<const float>(ref_logp, "ref_logp");
  in.batch.is_weight = flat<const float>(is_weight, "is_weight");
  in.batch.sequence_offsets = flat<const std::int64_t>(sequence_offsets, "sequence_offsets");

  grpo::Metrics metrics;
  grpo::LmHeadOutputs out;
  out.tokens.logp = flat<float>(logp, "logp");
  out.tokens.entropy = flat<float>(entropy, "entropy");
  out.tokens.kl = flat<float>(kl, "kl");
  out.dhidden = out_matrix(dhidden, "dhidden");
  out.dweight = out_matrix(dweight, "dweight");
  out.dbias = flat<float>(dbias, "dbias");
  out.metrics = &metrics;

  nb::gil_scoped_release release;
  timed(stats, [&](grpo::LmHeadStepStats* step) {
    out.stats = step;
    if (workspace != nullptr) {
      std::unique_lock<std::mutex> lock;
      plan.execute(in, out, workspace->acquire(plan.workspace_size(), lock));
    } else {
      plan.execute(in, out);
    }
  });
  return metrics;
}

// hidden / weight / bias / ids / mask of a log-prob head call.
grpo::LogProbInputs log_prob_inputs(const Array& hidden, const Array& weight, const OptArray& bias, const Array& ids,
                                    const OptArray& mask) {
  grpo::LogProbInputs in;
  in.hidden = in_matrix(hidden, "hidden");
  in.weight = in_matrix(weight, "weight");
  if (bias) {
    check_cpu(*bias, "bias");
    if (bias->ndim() != 1) refuse("bias", "must be 1-D");
    if (bias->shape(0) > 1 && bias->stride(0) != 1) refuse("bias", "must be contiguous");
    in.bias = {bias->data(), float_dtype(*bias, "bias"), static_cast<std::int64_t>(bias->shape(0))};
  }
  in.ids = flat<const std::int32_t>(ids, "ids");
  in.mask = flat<const float>(mask, "mask");
  return in;
}

template <typename Call>
void with_workspace(Workspace* workspace, std::size_t bytes, Call&& call) {
  nb::gil_scoped_release release;
  if (workspace != nullptr) {
    std::unique_lock<std::mutex> lock;
    call(workspace->acquire(bytes, lock));
  } else {
    call(std::span<std::byte>{});
  }
}

StepStats log_prob_forward(const grpo::LmHeadLogProbPlan& plan, Workspace* workspace, const Array& hidden,
                           const Array& weight, const Array& ids, const Array& logp, const OptArray& bias,
                           const OptArray& mask, const OptArray& entropy) {
  const grpo::LogProbInputs in = log_prob_inputs(hidden, weight, bias, ids, mask);
  StepStats stats;
  grpo::LogProbOutputs out;
  out.logp = flat<float>(logp, "logp");
  out.entropy = flat<float>(entropy, "entropy");
  out.stats = &stats.step;
  with_workspace(workspace, plan.workspace_size(), [&](std::span<std::byte> ws) {
    timed(&stats, [&](grpo::LmHeadStepStats*) { plan.forward(in, out, ws); });
  });
  return stats;
}

StepStats log_prob_backward(const grpo::LmHeadLogProbPlan& plan, Workspace* workspace, const Array& hidden,
                            const Array& weight, const Array& ids, const Array& dlogp, const Array& dhidden,
                            const OptArray& bias, const OptArray& mask, const OptArray& dentropy,
                            const OptArray& dweight, const OptArray& dbias) {
  const grpo::LogProbInputs in = log_prob_inputs(hidden, weight, bias, ids, mask);
  StepStats stats;
  grpo::LogProbUpstream up;
  up.dlogp = flat<const float>(dlogp, "dlogp");
  up.dentropy = flat<const float>(dentropy, "dentropy");
  grpo::LogProbGradients grads;
  grads.dhidden = out_matrix(dhidden, "dhidden");
  grads.dweight = out_matrix(dweight, "dweight");
  grads.dbias = flat<float>(dbias, "dbias");
  grads.stats = &stats.step;
  with_workspace(workspace, plan.workspace_size(), [&](std::span<std::byte> ws) {
    timed(&stats, [&](grpo::LmHeadStepStats*) { plan.backward(in, up, grads, ws); });
  });
  return stats;
}

void raise_with_argument(PyObject* type, const std::string& argument, const char* message) {
  nb::object instance = nb::steal(PyObject_CallFunction(type, "s", message));
  if (!instance.is_valid()) return;  // the call set its own Python error
  nb::setattr(instance, "argument", nb::str(argument.c_str()));
  PyErr_SetObject(type, instance.ptr());
}

// The library's refusal kinds, when it has them (grpo::Error::kind() is newer
// than some trees this binds against).
template <typename E>
PyObject* error_type(const E& e) {
  if constexpr (requires { e.kind(); }) {
    if (e.kind() == decltype(e.kind())::unsupported) return g_unsupported_error;
    if (e.kind() == decltype(e.kind())::out_of_memory) return PyExc_MemoryError;
  }
  return g_error;
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const grpo::Error& e) {
    PyObject* type = error_type(e);
    if (type == PyExc_MemoryError) {
      PyErr_SetString(type, e.what());
    } else {
      raise_with_argument(type, e.argument(), e.what());
    }
  } catch (const ArgumentTypeError& e) {
    raise_with_argument(g_type_error, e.argument,
                        ("grpo: invalid argument '" + e.argument + "': " + e.message).c_str());
  }
}

}  // namespace

NB_MODULE(_core, m) {
  m.doc() = "grpo: the fused GRPO LM-head loss (C++ core). See grpo.torch for the PyTorch module.";
  m.attr("__version__") = GRPO_VERSION_STRING;
  m.def("version", &grpo::version, "The version of the linked C++ library.");
  m.def("simd_path", &grpo::simd_path, "The SIMD path the stage kernels dispatch to: 'avx512', 'avx2' or 'scalar'.");

  g_error = PyErr_NewExceptionWithDoc("grpo.Error", "A refusal of the grpo library; .argument names the argument.",
                                      PyExc_ValueError, nullptr);
  g_unsupported_error =
      PyErr_NewExceptionWithDoc("grpo.UnsupportedError", "A valid request grpo cannot serve; .argument names it.",
                                PyExc_NotImplementedError, nullptr);
  g_type_error = PyErr_NewExceptionWithDoc(
      "grpo.ArgumentTypeError", "An array of the wrong element type; .argument names it.", PyExc_TypeError, nullptr);
  m.attr("Error") = nb::handle(g_error);
  m.attr("UnsupportedError") = nb::handle(g_unsupported_error);
  m.attr("ArgumentTypeError") = nb::handle(g_type_error);
  nb::register_exception_translator(translate);

  nb::enum_<grpo::DType>(m, "DType")
      .value("f32", grpo::DType::f32)
      .value("bf16", grpo::DType::bf16)
      .value("f16", grpo::DType::f16);
  nb::enum_<grpo::LossType>(m, "LossType")
      .value("grpo", grpo::LossType::grpo)
      .value("bnpo", grpo::LossType::bnpo)
      .value("dr_grpo", grpo::LossType::dr_grpo)
      .value("dapo", grpo::LossType::dapo)
      .value("cispo", grpo::LossType::cispo)
      .value("sapo", grpo::LossType::sapo)
      .value("luspo", grpo::LossType::luspo)
      .value("vespo", grpo::LossType::vespo);
  nb::enum_<grpo::IsLevel>(m, "IsLevel")
      .value("token", grpo::IsLevel::token)
      .value("sequence", grpo::IsLevel::sequence);
  nb::enum_<grpo::WeightLayout>(m, "WeightLayout")
      .value("vocab_major", grpo::WeightLayout::vocab_major)
      .value("hidden_major", grpo::WeightLayout::hidden_major);

  nb::enum_<grpo::KlEstimator>(m, "KlEstimator")
      .value("k3", grpo::KlEstimator::k3)
      .value("k1", grpo::KlEstimator::k1)
      .value("abs", grpo::KlEstimator::abs)
      .value("k2", grpo::KlEstimator::k2)
      .value("k1_plus", grpo::KlEstimator::k1_plus)
      .value("abs_plus", grpo::KlEstimator::abs_plus)
      .value("k3_plus", grpo::KlEstimator::k3_plus);

  {
    auto config = nb::class_<grpo::LossConfig>(m, "LossConfig", "The GRPO loss configuration (grpo::LossConfig).");
    config.def(nb::init<>());
    nb::list names;
#define GRPO_BIND_FIELD(name)                    \
  config.def_rw(#name, &grpo::LossConfig::name); \
  names.append(#name);
    GRPO_LOSS_CONFIG_FIELDS(GRPO_BIND_FIELD)
#undef GRPO_BIND_FIELD
    config.attr("fields") = nb::tuple(names);
  }

  nb::class_<PyCommunicator>(m, "Communicator",
                             "grpo::Communicator over a Python object with rank(), size(), allgather(send, recv) and "
                             "alltoall(send, recv) (uint8 NumPy views; see grpo.distributed.TorchCommunicator).")
      .def(nb::init<nb::object>(), "impl"_a)
      .def_prop_ro("rank", &PyCommunicator::rank)
      .def_prop_ro("size", &PyCommunicator::size)
      .def_prop_ro("impl", &PyCommunicator::impl);

  nb::class_<grpo::LmHeadShape>(m, "LmHeadShape", "Shape, dtypes and strides of an LM-head plan (grpo::LmHeadShape).")
      .def(nb::init<>())
      .def_rw("vocab_offset", &grpo::LmHeadShape::vocab_offset)
      .def_rw("global_vocab", &grpo::LmHeadShape::global_vocab)
      .def_rw("batch", &grpo::LmHeadShape::batch)
      .def_rw("seq_len", &grpo::LmHeadShape::seq_len)
      .def_rw("hidden", &grpo::LmHeadShape::hidden)
      .def_rw("vocab", &grpo::LmHeadShape::vocab)
      .def_rw("dtype", &grpo::LmHeadShape::dtype)
      .def_rw("layout", &grpo::LmHeadShape::layout)
      .def_rw("has_bias", &grpo::LmHeadShape::has_bias)
      .def_rw("bias_dtype", &grpo::LmHeadShape::bias_dtype)
      .def_rw("hidden_ld", &grpo::LmHeadShape::hidden_ld)
      .def_rw("weight_ld", &grpo::LmHeadShape::weight_ld)
      .def_rw("dweight_ld", &grpo::LmHeadShape::dweight_ld);

  {
    auto options =
        nb::class_<grpo::LmHeadOptions>(m, "LmHeadOptions", "Schedule and output options (grpo::LmHeadOptions).");
    options.def(nb::init<>());
    nb::list names;
#define GRPO_BIND_FIELD(name)                        \
  options.def_rw(#name, &grpo::LmHeadOptions::name); \
  names.append(#name);
    GRPO_LM_HEAD_OPTIONS_FIELDS(GRPO_BIND_FIELD)
#undef GRPO_BIND_FIELD
    options.attr("fields") = nb::tuple(names);
    nb::list unbound;
    for (const char* name : kUnboundOptions) unbound.append(name);
    options.attr("unbound_fields") = nb::tuple(unbound);
  }
  // LmHeadOptions::grad_filter's automatic threshold (eps(weight dtype) / 32);
  // grpo.torch spells it grad_filter="auto".
  m.attr("GRAD_FILTER_AUTO") = grpo::kGradFilterAuto;

  nb::class_<grpo::Metrics>(m, "Metrics", "Masked means over the valid rows of one execute (grpo::Metrics).")
      .def_ro("loss", &grpo::Metrics::loss)
      .def_ro("clip_ratio_low", &grpo::Metrics::clip_ratio_low)
      .def_ro("clip_ratio_high", &grpo::Metrics::clip_ratio_high)
      .def_ro("clip_ratio_region", &grpo::Metrics::clip_ratio_region)
      .def_ro("kl_mean", &grpo::Metrics::kl_mean)
      .def_ro("entropy_mean", &grpo::Metrics::entropy_mean)
      .def_ro("num_valid", &grpo::Metrics::num_valid);

  nb::class_<Workspace>(m, "Workspace",
                        "64-byte aligned scratch memory shared by the plans of a cache; grows to the largest "
                        "plan's size, never shrinks. Executes sharing it are serialized.")
      .def(nb::init<>())
      .def_prop_ro("size", &Workspace::size)
      .def_prop_ro("allocations", &Workspace::allocations, "How many times the buffer was (re)allocated.");

  nb::class_<grpo::LmHeadLossPlan>(m, "LmHeadLossPlan", "A validated fused LM-head GRPO plan (grpo::LmHeadLossPlan).")
      .def(
          "__init__",
          [](grpo::LmHeadLossPlan* self, const grpo::LmHeadShape& shape, const grpo::LossConfig& config,
             grpo::LmHeadOptions options, const PyCommunicator* vocab_group, const PyCommunicator* data_group,
             bool global_num_items) {
            options.scale_out.vocab_group = vocab_group;
            options.scale_out.data_group = data_group;
            options.scale_out.global_num_items = global_num_items;
            nb::gil_scoped_release release;  // a communicator takes it back for its collectives
            new (self) grpo::LmHeadLossPlan(shape, config, options);
          },
          "shape"_a, "config"_a, "options"_a = grpo::LmHeadOptions{}, nb::kw_only(),
          "vocab_group"_a.none() = nb::none(), "data_group"_a.none() = nb::none(), "global_num_items"_a = false,
          nb::keep_alive<1, 5>(), nb::keep_alive<1, 6>(),
          "Builds the plan (collective over its groups when given: every rank of a group builds it, in the same "
          "order; the plan keeps its communicators alive).")
      .def_prop_ro("workspace_size", &grpo::LmHeadLossPlan::workspace_size)
      .def_prop_ro(
          "gemm_count", [](const grpo::LmHeadLossPlan& p) { return p.schedule().gemm_count; },
          "GEMM objects the plan holds (LmHeadSchedule::gemm_count)")
      .def_prop_ro(
          "plan_bytes", [](const grpo::LmHeadLossPlan& p) { return p.schedule().plan_bytes; },
          "memory the plan's GEMMs hold beside the workspace, measured when it was built (an estimate: "
          "LmHeadSchedule::plan_bytes)")
      .def("describe", &grpo::LmHeadLossPlan::describe)
      .def("execute", &execute_lm_head,
           "Validates, then computes (GIL released). Arrays are DLPack CPU arrays viewed in place: hidden [N, H] and "
           "weight (f32, bf16 or f16, unit inner stride, the plan's row strides), bias [V], ids int32 [N], mask / "
           "advantages / old_logp / ref_logp / is_weight float32 (contiguous), sequence_offsets int64 [S + 1] "
           "(packed sequences, grpo::BatchInputs::sequence_offsets); outputs logp / entropy / kl float32 "
           "[N], dhidden, dweight (the options' dtypes), dbias float32 [V]. grad_scale multiplies every gradient "
           "(grpo::LmHeadInputs::grad_scale); stats, a StepStats, receives what the step executed and its wall time. "
           "Returns the Metrics; on a refusal no output was written.",
           "workspace"_a.none(), nb::kw_only(), "hidden"_a, "weight"_a, "ids"_a, "mask"_a, "advantages"_a, "logp"_a,
           "bias"_a.none() = nb::none(), "old_logp"_a.none() = nb::none(), "ref_logp"_a.none() = nb::none(),
           "is_weight"_a.none() = nb::none(), "sequence_offsets"_a.none() = nb::none(), "entropy"_a.none() = nb::none(),
           "kl"_a.none() = nb::none(), "dhidden"_a.none() = nb::none(), "dweight"_a.none() = nb::none(),
           "dbias"_a.none() = nb::none(), "grad_scale"_a = 1.0, "stats"_a.none() = nb::none());

  nb::class_<StepStats>(m, "StepStats",
                        "What one C++ call executed (grpo::LmHeadStepStats: GEMM rows, padding included, active rows, "
                        "row x vocab columns the filtered backward left out of the dhidden / dW GEMMs, "
                        "per-phase thread-seconds) and kernel_s, its wall time (GIL released, validation included).")
      .def(nb::init<>())
      .def_prop_ro("logits_gemm_rows", [](const StepStats& s) { return s.step.logits_gemm_rows; })
      .def_prop_ro("dhidden_gemm_rows", [](const StepStats& s) { return s.step.dhidden_gemm_rows; })
      // The former name of dhidden_gemm_rows, kept for existing callers.
      .def_prop_ro("backward_gemm_rows", [](const StepStats& s) { return s.step.dhidden_gemm_rows; })
      .def_prop_ro("dweight_gemm_rows", [](const StepStats& s) { return s.step.dweight_gemm_rows; })
      .def_prop_ro("active_rows", [](const StepStats& s) { return s.step.active_rows; })
      .def_prop_ro("dhidden_skipped_row_columns", [](const StepStats& s) { return s.step.dhidden_skipped_row_columns; })
      .def_prop_ro("dweight_skipped_row_columns", [](const StepStats& s) { return s.step.dweight_skipped_row_columns; })
      .def_prop_ro("filter_guard_blocks", [](const StepStats& s) { return s.step.filter_guard_blocks; })
      .def_prop_ro("filter_lowered_blocks", [](const StepStats& s) { return s.step.filter_lowered_blocks; })
      .def_prop_ro("f16_saturated", [](const StepStats& s) { return s.step.f16_saturated; })
      .def_prop_ro("forward_gemm_s", [](const StepStats& s) { return s.step.forward_gemm_s; })
      .def_prop_ro("forward_stage_s", [](const StepStats& s) { return s.step.forward_stage_s; })
      .def_prop_ro("dlogits_s", [](const StepStats& s) { return s.step.dlogits_s; })
      .def_prop_ro("dweight_gemm_s", [](const StepStats& s) { return s.step.dweight_gemm_s; })
      .def_prop_ro("dhidden_gemm_s", [](const StepStats& s) { return s.step.dhidden_gemm_s; })
      .def_ro("kernel_s", &StepStats::kernel_s);

  nb::class_<grpo::LogProbConfig>(m, "LogProbConfig", "The log-prob head's configuration (grpo::LogProbConfig).")
      .def(nb::init<>())
      .def_rw("temperature", &grpo::LogProbConfig::temperature)
      .def_rw("temperature_on_logp", &grpo::LogProbConfig::temperature_on_logp)
      .def_rw("logit_softcap", &grpo::LogProbConfig::logit_softcap)
      .def_rw("logit_scale", &grpo::LogProbConfig::logit_scale);

  nb::class_<grpo::LmHeadLogProbPlan>(
      m, "LmHeadLogProbPlan",
      "The generic log-prob head (grpo::LmHeadLogProbPlan): per-token logp / entropy of hidden x W without [N, V] "
      "logits, and the gradients of hidden / weight / bias from any upstream dL/dlogp, dL/dentropy.")
      .def(
          "__init__",
          [](grpo::LmHeadLogProbPlan* self, const grpo::LmHeadShape& shape, const grpo::LogProbConfig& config,
             grpo::LmHeadOptions options, const PyCommunicator* vocab_group, const PyCommunicator* data_group) {
            options.scale_out.vocab_group = vocab_group;
            options.scale_out.data_group = data_group;
            nb::gil_scoped_release release;  // a communicator takes it back for its collectives
            new (self) grpo::LmHeadLogProbPlan(shape, config, options);
          },
          "shape"_a, "config"_a = grpo::LogProbConfig{}, "options"_a = grpo::LmHeadOptions{}, nb::kw_only(),
          "vocab_group"_a.none() = nb::none(), "data_group"_a.none() = nb::none(), nb::keep_alive<1, 5>(),
          nb::keep_alive<1, 6>(),
          "Builds the plan (collective over its groups when given, as LmHeadLossPlan's; forward() and backward() are "
          "then collective too: every rank of a group calls them, in the same order).")
      .def_prop_ro("workspace_size", &grpo::LmHeadLogProbPlan::workspace_size)
      .def_prop_ro(
          "gemm_count", [](const grpo::LmHeadLogProbPlan& p) { return p.schedule().gemm_count; },
          "GEMM objects the plan holds")
      .def_prop_ro(
          "plan_bytes", [](const grpo::LmHeadLogProbPlan& p) { return p.schedule().plan_bytes; },
          "memory the plan's GEMMs hold beside the workspace (an estimate)")
      .def("describe", &grpo::LmHeadLogProbPlan::describe)
      .def("forward", &log_prob_forward,
           "Validates, then writes logp (and entropy) float32 [N] (GIL released). hidden [N, H], weight, bias [V] "
           "as LmHeadLossPlan.execute; ids int32 [N]; mask float32 [N] of 0 / 1 or None (every row valid). Returns "
           "the StepStats; on a refusal nothing was written.",
           "workspace"_a.none(), nb::kw_only(), "hidden"_a, "weight"_a, "ids"_a, "logp"_a, "bias"_a.none() = nb::none(),
           "mask"_a.none() = nb::none(), "entropy"_a.none() = nb::none())
      .def("backward", &log_prob_backward,
           "Validates, then writes dhidden [N, H], dweight (weight's layout; the options' dtypes) and dbias float32 "
           "[V] (when the plan has a bias) from dlogp float32 [N] and dentropy float32 [N] or None (GIL released). "
           "Every gradient buffer the plan has is required (dweight and dbias are None with frozen_weight). Returns "
           "the StepStats.",
           "workspace"_a.none(), nb::kw_only(), "hidden"_a, "weight"_a, "ids"_a, "dlogp"_a, "dhidden"_a,
           "bias"_a.none() = nb::none(), "mask"_a.none() = nb::none(), "dentropy"_a.none() = nb::none(),
           "dweight"_a.none() = nb::none(), "dbias"_a.none() = nb::none());
}
