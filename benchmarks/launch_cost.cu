// What one kernel launch costs the host on this machine, by kind of launch and size of the argument
// struct: the floor under every op's host time (issue 13: a static dispatch+combine pair is a handful of
// launches). Each variant is issued 200 times while a spin kernel queued ahead keeps the GPU busy, so
// nothing waits and the launch queue never drains; median µs per launch.
//
//   nvcc -O2 -arch=sm_90 -o /tmp/launch_cost benchmarks/launch_cost.cu && /tmp/launch_cost
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <vector>

template <int Bytes>
struct Blob {
  unsigned char b[Bytes];
};

__global__ void spin(long long cycles) {
  const long long start = clock64();
  while (clock64() - start < cycles) {
  }
}

template <int Bytes>
__global__ void empty_kernel(Blob<Bytes> a) {
  if (a.b[0] == 255 && threadIdx.x == 1000) printf("never\n");
}

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <typename F>
static double median_us(cudaStream_t s, F&& launch) {
  constexpr int kIters = 200;
  check(cudaStreamSynchronize(s), "sync");
  spin<<<1, 1, 0, s>>>(400LL * 1000 * 1000);  // ~0.2 s at ~2 GHz: longer than all the launches below
  std::vector<double> t(kIters);
  for (int i = 0; i < kIters; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    launch();
    t[i] = std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0).count();
  }
  check(cudaGetLastError(), "launch");
  check(cudaStreamSynchronize(s), "sync");
  std::sort(t.begin(), t.end());
  return t[kIters / 2];
}

template <int Bytes>
static void row(cudaStream_t s, int blocks, bool coop) {
  Blob<Bytes> a = {};
  const double us = median_us(s, [&] {
    cudaLaunchConfig_t config = {};
    config.gridDim = dim3(blocks);
    config.blockDim = dim3(512);
    config.stream = s;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeCooperative;
    attr[0].val.cooperative = 1;
    config.attrs = attr;
    config.numAttrs = coop ? 1 : 0;
    cudaLaunchKernelEx(&config, empty_kernel<Bytes>, a);
  });
  std::printf("| cudaLaunchKernelEx | %5d | %3d | %-3s | %.2f |\n", Bytes, blocks, coop ? "yes" : "no", us);
}

int main() {
  cudaStream_t s;
  check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cudaDeviceProp p;
  check(cudaGetDeviceProperties(&p, 0), "props");
  std::printf("%s\n\n| launch | argument bytes | blocks | cooperative | host µs (median of 200) |\n|---|---|---|---|---|\n",
              p.name);
  row<16>(s, 1, false);  // warm-up of the module's kernels
  row<16>(s, 1, false);
  row<16>(s, 1, true);
  row<16>(s, 24, true);
  row<1024>(s, 1, false);
  row<3072>(s, 1, false);
  row<3072>(s, 1, true);
  row<3072>(s, 24, false);
  row<3072>(s, 24, true);
  Blob<16> small = {};
  std::printf("| <<<1, 512>>> | 16 | 1 | no | %.2f |\n", median_us(s, [&] { empty_kernel<16><<<1, 512, 0, s>>>(small); }));
  void *src, *dst;
  check(cudaMalloc(&src, 1 << 20), "malloc");
  check(cudaMalloc(&dst, 1 << 20), "malloc");
  std::printf("| cudaMemcpyAsync D2D 1 MiB | — | — | — | %.2f |\n",
              median_us(s, [&] { cudaMemcpyAsync(dst, src, 1 << 20, cudaMemcpyDeviceToDevice, s); }));
  int dev = 0;
  std::printf("| cudaGetDevice (no launch) | — | — | — | %.2f |\n", median_us(s, [&] { cudaGetDevice(&dev); }));
  return 0;
}
