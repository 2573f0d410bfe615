// Argument checks shared by every op and every device.
//
// Each check raises a RuntimeError (c10::Error) whose message names the op, the argument and
// the rule it broke, e.g. "hopper_moe::moe_sum: output must have dtype BFloat16 (got Float)".
// Every op calls its family's check function (csrc/checks/) before touching memory, from both
// its CPU and its CUDA implementation, so both devices reject exactly the same inputs.
//
// The macros take the argument itself and print its spelling; the *_named functions take the
// name explicitly, for optionals and derived tensors:
//   HM_CHECK_DTYPE(kOp, topk_weights, at::kFloat);
//   if (bias) check_dtype_named(kOp, *bias, "bias", at::kFloat);
#pragma once

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

namespace hopper_moe {

// Messages are assembled here into one std::string (numbers through std::to_string, shapes and
// devices through their own formatting) and only that string is handed to TORCH_CHECK. No
// number is ever written to a C++ stream by this library: an extension built by a compiler that
// links its own copy of libstdc++ crashes on stream number formatting inside PyTorch's process.
namespace detail {
inline std::string to_msg(const char* s) { return s; }
inline std::string to_msg(const std::string& s) { return s; }
inline std::string to_msg(bool b) { return b ? "true" : "false"; }
inline std::string to_msg(char c) { return std::string(1, c); }
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool> &&
                                           !std::is_same_v<T, char>, int> = 0>
std::string to_msg(T v) {
  return std::to_string(v);
}
template <typename T, std::enable_if_t<std::is_floating_point_v<T>, int> = 0>
std::string to_msg(T v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  return buf;
}
inline std::string to_msg(const void* p) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%p", p);
  return buf;
}
inline std::string to_msg(at::IntArrayRef a) {
  std::string s = "[";
  for (size_t i = 0; i < a.size(); ++i) s += (i ? ", " : "") + std::to_string(a[i]);
  return s + "]";
}
inline std::string to_msg(const std::vector<int64_t>& v) { return to_msg(at::IntArrayRef(v)); }
inline std::string to_msg(c10::ScalarType t) { return c10::toString(t); }
inline std::string to_msg(const c10::Device& d) { return d.str(); }

template <typename... Args>
std::string cat(const Args&... args) {
  std::string s;
  (s += ... += to_msg(args));
  return s;
}
}  // namespace detail

#define HM_CHECK(op, cond, ...) \
  TORCH_CHECK((cond), ::hopper_moe::detail::cat("hopper_moe::", op, ": ", __VA_ARGS__))

inline std::string dtype_list(std::initializer_list<at::ScalarType> dtypes) {
  std::string s;
  size_t i = 0;
  for (auto d : dtypes) {
    if (i > 0) s += (i + 1 == dtypes.size()) ? " or " : ", ";
    s += c10::toString(d);
    ++i;
  }
  return s;
}

inline void check_dtype_named(const char* op, const at::Tensor& t, const char* name,
                              std::initializer_list<at::ScalarType> dtypes) {
  bool ok = false;
  for (auto d : dtypes) ok = ok || t.scalar_type() == d;
  HM_CHECK(op, ok, name, " must have dtype ", dtype_list(dtypes), " (got ",
           c10::toString(t.scalar_type()), ")");
}

inline void check_dtype_named(const char* op, const at::Tensor& t, const char* name,
                              at::ScalarType dtype) {
  check_dtype_named(op, t, name, {dtype});
}

inline void check_dim_named(const char* op, const at::Tensor& t, const char* name, int64_t nd) {
  HM_CHECK(op, t.dim() == nd, name, " must be ", nd, "-D (got ", t.dim(), "-D with shape ",
           t.sizes(), ")");
}

inline void check_size_named(const char* op, const at::Tensor& t, const char* name, int64_t d,
                             int64_t n, const char* what = nullptr) {
  HM_CHECK(op, t.size(d) == n, name, ".size(", d, ") must be ", n,
           what ? std::string(" (") + what + ")" : std::string(), ", got ", t.size(d),
           " (shape ", t.sizes(), ")");
}

inline void check_numel_named(const char* op, const at::Tensor& t, const char* name, int64_t n,
                              const char* what = nullptr) {
  HM_CHECK(op, t.numel() == n, name, " must have ", n, " elements",
           what ? std::string(" (") + what + ")" : std::string(), ", got ", t.numel(),
           " (shape ", t.sizes(), ")");
}

inline void check_contiguous_named(const char* op, const at::Tensor& t, const char* name) {
  HM_CHECK(op, t.is_contiguous(), name, " must be contiguous (shape ", t.sizes(), ", strides ",
           t.strides(), ")");
}

inline void check_last_dim_contiguous_named(const char* op, const at::Tensor& t,
                                            const char* name) {
  HM_CHECK(op, t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, name,
           " must have stride 1 in its last dimension (strides ", t.strides(), ")");
}

inline void check_same_device_named(const char* op, const at::Tensor& t, const char* name,
                                    const at::Tensor& ref, const char* ref_name) {
  HM_CHECK(op, t.device() == ref.device(), name, " must be on the same device as ", ref_name,
           " (", ref.device(), "), got ", t.device());
}

inline void check_same_shape_named(const char* op, const at::Tensor& t, const char* name,
                                   const at::Tensor& ref, const char* ref_name) {
  HM_CHECK(op, t.sizes() == ref.sizes(), name, " must have the same shape as ", ref_name, " (",
           ref.sizes(), "), got ", t.sizes());
}

inline void check_no_overlap_named(const char* op, const at::Tensor& out, const char* out_name,
                                   const at::Tensor& in, const char* in_name) {
  if (out.numel() == 0 || in.numel() == 0) return;
  const auto* o0 = static_cast<const char*>(out.data_ptr());
  const auto* o1 = o0 + out.nbytes();
  const auto* i0 = static_cast<const char*>(in.data_ptr());
  const auto* i1 = i0 + in.nbytes();
  HM_CHECK(op, o1 <= i0 || i1 <= o0, out_name, " must not overlap ", in_name);
}

// 16-byte alignment of the data pointer, as vectorized (and TMA) accesses need.
inline void check_aligned16_named(const char* op, const at::Tensor& t, const char* name) {
  HM_CHECK(op, reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
           " must be 16-byte aligned (data pointer ", t.data_ptr(), ")");
}

#define HM_CHECK_DTYPE(op, t, ...) ::hopper_moe::check_dtype_named(op, t, #t, __VA_ARGS__)
#define HM_CHECK_DIM(op, t, nd) ::hopper_moe::check_dim_named(op, t, #t, nd)
#define HM_CHECK_SIZE(op, t, d, ...) ::hopper_moe::check_size_named(op, t, #t, d, __VA_ARGS__)
#define HM_CHECK_NUMEL(op, t, ...) ::hopper_moe::check_numel_named(op, t, #t, __VA_ARGS__)
#define HM_CHECK_CONTIGUOUS(op, t) ::hopper_moe::check_contiguous_named(op, t, #t)
#define HM_CHECK_LAST_DIM_CONTIGUOUS(op, t) \
  ::hopper_moe::check_last_dim_contiguous_named(op, t, #t)
#define HM_CHECK_SAME_DEVICE(op, t, ref) \
  ::hopper_moe::check_same_device_named(op, t, #t, ref, #ref)
#define HM_CHECK_SAME_SHAPE(op, t, ref) ::hopper_moe::check_same_shape_named(op, t, #t, ref, #ref)
#define HM_CHECK_NO_OVERLAP(op, out, in) \
  ::hopper_moe::check_no_overlap_named(op, out, #out, in, #in)

// Float inputs the activation and routing ops accept.
#define HM_FLOAT_DTYPES {at::kFloat, at::kHalf, at::kBFloat16}
// Index tensors: int32 or int64 (topk ids also come as uint32 in some engines).
#define HM_INDEX_DTYPES {at::kInt, at::kLong}

}  // namespace hopper_moe
