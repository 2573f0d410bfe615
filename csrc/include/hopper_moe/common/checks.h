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

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>
#include <c10/util/SmallVector.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <initializer_list>
#include <optional>
#include <string>
#include <type_traits>
#include <utility>
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
  HM_CHECK(op, t.is_contiguous(), name,
           " must be contiguous: the op indexes it as a dense array, so broadcast (stride-0) "
           "or strided views need .contiguous() (shape ",
           t.sizes(), ", strides ", t.strides(), ")");
}

// The kernels read and write a row's elements as unit-stride vectors, so a broadcast (stride-0)
// last dimension is rejected too, read-only or not; leading dimensions may have any stride.
inline void check_last_dim_contiguous_named(const char* op, const at::Tensor& t,
                                            const char* name) {
  HM_CHECK(op, t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, name,
           " must have stride 1 in its last dimension: the kernels access its rows as "
           "unit-stride vectors (strides ", t.strides(), ")");
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

// The bytes [lo, hi) a non-empty tensor can touch: data_ptr (storage offset included) plus the
// smallest and largest element offsets its sizes and strides reach (negative strides handled,
// zero strides allowed), plus one element.
struct ByteSpan {
  uintptr_t lo = 0, hi = 0;
};

inline ByteSpan byte_span(const at::Tensor& t) {
  int64_t min_off = 0, max_off = 0;
  for (int64_t d = 0; d < t.dim(); ++d) {
    if (t.size(d) <= 1) continue;
    const int64_t reach = t.stride(d) * (t.size(d) - 1);
    (reach < 0 ? min_off : max_off) += reach;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data_ptr());
  const auto item = static_cast<int64_t>(t.element_size());
  return {base + static_cast<uintptr_t>(min_off * item),
          base + static_cast<uintptr_t>((max_off + 1) * item)};
}

// `out` (written by the op) and `in` must not share memory. The rule is about the memory spans
// the two can touch (byte_span), not only their first numel elements, so strided or
// interleaved views of one buffer are rejected too: conservative, never a silent race.
inline void check_no_overlap_named(const char* op, const at::Tensor& out, const char* out_name,
                                   const at::Tensor& in, const char* in_name) {
  if (out.numel() == 0 || in.numel() == 0) return;
  const ByteSpan o = byte_span(out), i = byte_span(in);
  HM_CHECK(op, o.hi <= i.lo || i.hi <= o.lo, out_name, " must not overlap ", in_name,
           " (their memory spans intersect: ", out_name, " shape ", out.sizes(), ", strides ",
           out.strides(), "; ", in_name, " shape ", in.sizes(), ", strides ", in.strides(), ")");
}

// A tensor the op writes: every element must be its own memory. No dimension of size > 1 may
// have stride 0 (a broadcast output), and, with the dimensions of size > 1 taken in order of
// their strides, each stride must exceed the span of the dimensions with smaller strides (rows
// that overlap, as as_strided can make them, are rejected too). Otherwise several threads
// would write one element: a race on the GPU, an arbitrary result on the CPU. Conservative:
// an interleaving of non-overlapping elements that this order does not show is rejected.
inline void check_output_elements_distinct_named(const char* op, const at::Tensor& t,
                                                 const char* name) {
  c10::SmallVector<std::pair<int64_t, int64_t>, 4> dims;  // (stride, size), dims of size > 1
  for (int64_t d = 0; d < t.dim(); ++d) {
    HM_CHECK(op, t.size(d) <= 1 || t.stride(d) != 0, name,
             " is written by the op and must not have stride 0 in a dimension of size > 1 "
             "(a broadcast output; shape ",
             t.sizes(), ", strides ", t.strides(), ")");
    if (t.size(d) > 1) dims.emplace_back(t.stride(d), t.size(d));
  }
  std::sort(dims.begin(), dims.end());
  int64_t span = 0;  // the largest offset the smaller-stride dims reach
  for (const auto& [stride, size] : dims) {
    HM_CHECK(op, stride > span, name,
             " is written by the op and its elements must not overlap (each stride must "
             "exceed the span of the dimensions with smaller strides; shape ",
             t.sizes(), ", strides ", t.strides(), ")");
    span += stride * (size - 1);
  }
}

// A tensor argument with its name; an empty optional is skipped.
struct Named {
  const at::Tensor* t;
  const char* name;
  Named(const at::Tensor& tensor, const char* n) : t(&tensor), name(n) {}
  Named(const std::optional<at::Tensor>& tensor, const char* n)
      : t(tensor.has_value() ? &*tensor : nullptr), name(n) {}
};

// Every output must be disjoint from every other output and from every input.
inline void check_outputs_disjoint(const char* op, std::initializer_list<Named> outputs,
                                   std::initializer_list<Named> inputs) {
  const Named* outs = outputs.begin();
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (!outs[i].t) continue;
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      if (outs[j].t) check_no_overlap_named(op, *outs[i].t, outs[i].name, *outs[j].t, outs[j].name);
    }
    for (const Named& in : inputs) {
      if (in.t) check_no_overlap_named(op, *outs[i].t, outs[i].name, *in.t, in.name);
    }
  }
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
#define HM_CHECK_OUTPUT_DISTINCT(op, t) \
  ::hopper_moe::check_output_elements_distinct_named(op, t, #t)

// Float inputs the activation and routing ops accept.
#define HM_FLOAT_DTYPES {at::kFloat, at::kHalf, at::kBFloat16}
// Index tensors: int32 or int64 (topk ids also come as uint32 in some engines).
#define HM_INDEX_DTYPES {at::kInt, at::kLong}

}  // namespace hopper_moe
