// Programmatic dependent launch (PDL) between consecutive kernels of one stream.
//
// A kernel launched with the programmatic-stream-serialization attribute (launch_attrs below)
// may start while the kernel before it on the stream still runs, once every CTA of that
// kernel has called launch_dependents() or exited. It must call wait_for_prerequisites()
// before it reads anything the earlier kernel writes, or writes anything that kernel reads:
// the wait returns once the earlier kernel has completed and its memory is visible. Without
// the attribute both calls are no-ops, so a kernel can always contain them.
//
// The rule for the chain of kernels of a layer: a dependent launch waits at its top and only
// then lets its own dependents start (wait, then launch_dependents), so that when a kernel
// starts, every kernel before its predecessor has completed. The grouped GEMM is the one
// exception (it triggers at once; see offsets_ready in gemm/moe_gemm_sm90.h).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "hopper_moe/common/settings.h"

namespace hopper_moe::pdl {

// Lets the next kernel on the stream (if launched with the attribute) start its CTAs.
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Waits until the previous kernel on the stream has completed and its writes are visible.
__device__ __forceinline__ void wait_for_prerequisites() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

// The launch attribute that allows the overlap (one attribute; pass attrs and 1 to
// cudaLaunchConfig_t).
inline cudaLaunchAttribute programmatic_serialization(bool enabled) {
  cudaLaunchAttribute attr{};
  attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr.val.programmaticStreamSerializationAllowed = enabled ? 1 : 0;
  return attr;
}

// Launches kernel<<<grid, block, smem, stream>>>(args...) as a dependent launch (unless
// settings::pdl_enabled() is false); the kernel must follow the rule above. Returns the
// launch's error.
template <class... Params, class... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attr = programmatic_serialization(settings::pdl_enabled());
  config.attrs = &attr;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace hopper_moe::pdl
