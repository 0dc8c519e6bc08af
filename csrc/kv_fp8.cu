// FP8 packing of 512-dim K=V rows for a compact V4 cache: 448 "nope" values as e4m3 with one
// power-of-two (ue8m0) scale per 64-value tile, the 64 rope values kept in bf16.
// Row layout (584 bytes): [0, 448) e4m3 codes | [448, 576) rope bf16 | [576, 583) tile exponents + 127 | pad.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

constexpr int kDim = 512, kNope = 448, kRope = 64, kTile = 64, kTiles = 7, kRowBytes = 584;
constexpr int kScaleAt = kNope + 2 * kRope;

// Exponent e of the smallest power of two 2^e with amax / 2^e <= 448 (0 for an all-zero tile).
__device__ __forceinline__ int scale_exponent(float amax) {
  if (!(amax > 0.f)) return 0;
  int e;
  const float m = frexpf(amax / 448.f, &e);  // amax/448 = m * 2^e, m in [0.5, 1); IEEE division
  e = (m == 0.5f) ? e - 1 : e;
  return max(-127, min(127, e));
}

// One block of 64 threads per row: thread i owns column i of every 64-wide tile (coalesced).
__global__ void pack_kernel(const __nv_bfloat16* __restrict__ x, int64_t stride_x, uint8_t* __restrict__ out) {
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const __nv_bfloat16* xr = x + row * stride_x;
  uint8_t* o = out + row * kRowBytes;
  __shared__ float part[2][kTiles];
  float v[kTiles];
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    v[t] = __bfloat162float(xr[t * kTile + tid]);
    float a = fabsf(v[t]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) a = fmaxf(a, __shfl_xor_sync(0xffffffffu, a, off));
    if (lane == 0) part[warp][t] = a;
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    const int e = scale_exponent(fmaxf(part[0][t], part[1][t]));
    const __nv_fp8_e4m3 q(ldexpf(v[t], -e));  // exact scaling, then round-to-nearest-even, saturating
    o[t * kTile + tid] = q.__x;
    if (tid == 0) o[kScaleAt + t] = static_cast<uint8_t>(e + 127);
  }
  reinterpret_cast<__nv_bfloat16*>(o + kNope)[tid] = xr[kNope + tid];
  if (tid == 0) o[kRowBytes - 1] = 0;
}

__global__ void unpack_kernel(const uint8_t* __restrict__ in, __nv_bfloat16* __restrict__ x, int64_t stride_x) {
  const int64_t row = blockIdx.x;
  const int tid = threadIdx.x;
  const uint8_t* r = in + row * kRowBytes;
  __nv_bfloat16* xr = x + row * stride_x;
#pragma unroll
  for (int t = 0; t < kTiles; ++t) {
    __nv_fp8_e4m3 q;
    q.__x = r[t * kTile + tid];
    xr[t * kTile + tid] = __float2bfloat16(ldexpf(static_cast<float>(q), static_cast<int>(r[kScaleAt + t]) - 127));
  }
  xr[kNope + tid] = reinterpret_cast<const __nv_bfloat16*>(r + kNope)[tid];
}

}  // namespace

torch::Tensor kv_fp8_pack(const torch::Tensor& rows) {
  TORCH_CHECK(rows.is_cuda(), "kv_fp8_pack: rows must be a CUDA tensor");
  TORCH_CHECK(rows.scalar_type() == at::kBFloat16, "kv_fp8_pack: rows must be bfloat16, got ", rows.scalar_type());
  TORCH_CHECK(rows.dim() == 2 && rows.size(1) == kDim, "kv_fp8_pack: rows must be [N, 512], got ", rows.sizes());
  TORCH_CHECK(rows.stride(1) == 1, "kv_fp8_pack: rows must be contiguous in the last dim");
  auto out = torch::empty({rows.size(0), kRowBytes}, rows.options().dtype(at::kByte));
  if (rows.size(0) == 0) return out;
  pack_kernel<<<rows.size(0), 64, 0, c10::cuda::getCurrentCUDAStream()>>>(
      reinterpret_cast<const __nv_bfloat16*>(rows.data_ptr<at::BFloat16>()), rows.stride(0), out.data_ptr<uint8_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

torch::Tensor kv_fp8_unpack(const torch::Tensor& packed) {
  TORCH_CHECK(packed.is_cuda(), "kv_fp8_unpack: packed must be a CUDA tensor");
  TORCH_CHECK(packed.scalar_type() == at::kByte, "kv_fp8_unpack: packed must be uint8, got ", packed.scalar_type());
  TORCH_CHECK(packed.dim() == 2 && packed.size(1) == kRowBytes && packed.is_contiguous(),
              "kv_fp8_unpack: packed must be contiguous [N, 584], got ", packed.sizes());
  auto out = torch::empty({packed.size(0), kDim}, packed.options().dtype(at::kBFloat16));
  if (packed.size(0) == 0) return out;
  unpack_kernel<<<packed.size(0), 64, 0, c10::cuda::getCurrentCUDAStream()>>>(
      packed.data_ptr<uint8_t>(), reinterpret_cast<__nv_bfloat16*>(out.data_ptr<at::BFloat16>()), out.stride(0));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("kv_fp8_pack", &kv_fp8_pack, "bf16 [N, 512] -> packed FP8 rows [N, 584] (uint8)");
  m.def("kv_fp8_unpack", &kv_fp8_unpack, "packed FP8 rows [N, 584] -> bf16 [N, 512]");
}
