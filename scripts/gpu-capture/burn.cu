// Keeps one GPU busy for argv[1] seconds with FMA chains, holding argv[2] GiB of device memory (cudaMalloc, never
// managed memory), so that NVML shows utilization, power above idle and a per-process memory figure.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cuda_runtime.h>

__global__ void burn(float* x, int iters) {
  size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
  float a = x[i], b = 1.0001f;
  for (int k = 0; k < iters; k++) {
    a = fmaf(a, b, 0.0001f);
    b = fmaf(b, 0.9999f, 0.0001f);
  }
  x[i] = a;
}

#define CHECK(call)                                                           \
  do {                                                                        \
    cudaError_t e = (call);                                                   \
    if (e != cudaSuccess) {                                                   \
      fprintf(stderr, "%s: %s\n", #call, cudaGetErrorString(e));              \
      return 1;                                                               \
    }                                                                         \
  } while (0)

int main(int argc, char** argv) {
  double seconds = argc > 1 ? atof(argv[1]) : 20.0;
  size_t gib = argc > 2 ? strtoull(argv[2], nullptr, 10) : 4;
  size_t bytes = gib << 30;
  float* x = nullptr;
  CHECK(cudaMalloc(&x, bytes));
  CHECK(cudaMemset(x, 0, bytes));
  const size_t threads = 132 * 2048 * 4;  // H200: 132 SMs, 2048 threads each, 4 waves
  auto t0 = std::chrono::steady_clock::now();
  long launches = 0;
  for (;;) {
    double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (dt >= seconds) break;
    burn<<<threads / 256, 256>>>(x, 200000);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    launches++;
  }
  printf("burn: %ld launches in %.1f s, %zu GiB held\n", launches, seconds, gib);
  CHECK(cudaFree(x));
  return 0;
}
