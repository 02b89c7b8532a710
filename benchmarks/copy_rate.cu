// How fast a budget of SMs can move rows (issue 14, item 5: the HT kernels' local share at the copy
// rate). The HT kernels run on 24 blocks of 512 threads; a warp copies a row through registers, so what
// one SM keeps in flight is bounded by its registers. This times, for DeepEP's HT rows (4096 rows of
// 7168 bf16, 58.7 MB in and out), a plain device copy against row copies on G blocks:
//   reg<U, threads>: a warp per row, U 16-byte loads per lane in flight before the stores (the kernels'
//                    warp_copy_row is reg<8, 512>);
//   bulk<I, S, CB>:  I issuing threads per block, each with S stages of CB bytes of shared memory: bulk
//                    (TMA) loads global -> shared completing on an mbarrier, bulk stores shared -> global
//                    (sm_90; no registers hold the data, so S - 1 chunks per issuer stay in flight).
// Median of 20 timed runs each (CUDA events), GB/s counting bytes read + written.
//
//   nvcc -O2 -std=c++17 -arch=sm_90 -o /tmp/copy_rate benchmarks/copy_rate.cu && /tmp/copy_rate
//   /tmp/copy_rate two     # two GPUs: pushes, pulls and the dispatch's pattern over NVLink
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <string>
#include <cstdint>
#include <cstdio>
#include <vector>

static void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "%s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

template <int U, int TH>
__global__ void __launch_bounds__(TH) reg_copy(int4* dst, int4* dst2, const int4* src, int rows, int units) {
  const int lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int r = blockIdx.x * warps + threadIdx.x / 32; r < rows; r += gridDim.x * warps) {
    const int4* s = src + static_cast<int64_t>(r) * units;
    int4* d = dst + static_cast<int64_t>(r) * units;
    int4* d2 = dst2 ? dst2 + static_cast<int64_t>(r) * units : nullptr;
    int i = lane;
    for (; i + (U - 1) * 32 < units; i += U * 32) {
      int4 v[U];
#pragma unroll
      for (int u = 0; u < U; ++u) v[u] = s[i + u * 32];
#pragma unroll
      for (int u = 0; u < U; ++u) d[i + u * 32] = v[u];
      if (d2) {
#pragma unroll
        for (int u = 0; u < U; ++u) d2[i + u * 32] = v[u];
      }
    }
    for (; i < units; i += 32) {
      d[i] = s[i];
      if (d2) d2[i] = s[i];
    }
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void bulk_load(void* sdst, const void* gsrc, uint32_t bytes, uint64_t* bar) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes));
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_addr(sdst)),
      "l"(gsrc), "r"(bytes), "r"(smem_addr(bar))
      : "memory");
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n .reg .pred p;\n W: mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W;\n}" ::"r"(
          smem_addr(bar)),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void bulk_store(void* gdst, const void* ssrc, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gdst), "r"(smem_addr(ssrc)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}

// Issuer i of block b takes chunks c = (b * I + i) + k * (G * I); chunk c is bytes [c * CB, + CB).
template <int I, int S, int CB>
__global__ void __launch_bounds__(I * 32) bulk_copy(char* dst, char* dst2, const char* src, int64_t bytes) {
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) uint64_t bars[I][S];
  const int issuer = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  char* stage = smem + static_cast<int64_t>(issuer) * S * CB;
  for (int s = 0; s < S; ++s) mbar_init(&bars[issuer][s]);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int64_t chunks = (bytes + CB - 1) / CB;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * I + issuer, step = static_cast<int64_t>(gridDim.x) * I;
  const int64_t mine = first < chunks ? (chunks - first + step - 1) / step : 0;
  auto at = [&](int64_t k) { return (first + k * step) * CB; };
  auto len = [&](int64_t k) { return static_cast<uint32_t>(bytes - at(k) < CB ? bytes - at(k) : CB); };
  for (int64_t k = 0; k < mine && k < S; ++k) bulk_load(stage + k * CB, src + at(k), len(k), &bars[issuer][k]);
  for (int64_t k = 0; k < mine; ++k) {
    const int s = static_cast<int>(k % S);
    mbar_wait(&bars[issuer][s], static_cast<uint32_t>((k / S) & 1));
    bulk_store(dst + at(k), stage + s * CB, len(k));
    if (dst2) bulk_store(dst2 + at(k), stage + s * CB, len(k));
    bulk_commit();
    // The stage of chunk k - 1 is free once its store has read it: load chunk k - 1 + S there.
    if (k >= 1 && k - 1 + S < mine) {
      bulk_wait_read<1>();
      const int sp = static_cast<int>((k - 1) % S);
      bulk_load(stage + sp * CB, src + at(k - 1 + S), len(k - 1 + S), &bars[issuer][sp]);
    }
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

struct Timer {
  cudaEvent_t a, b;
  Timer() { cudaEventCreate(&a); cudaEventCreate(&b); }
  template <typename F>
  float median_us(F&& f) {
    std::vector<float> ms;
    f();
    check(cudaDeviceSynchronize(), "warm-up");
    for (int i = 0; i < 20; ++i) {
      cudaEventRecord(a);
      f();
      cudaEventRecord(b);
      check(cudaEventSynchronize(b), "run");
      float t = 0;
      cudaEventElapsedTime(&t, a, b);
      ms.push_back(t);
    }
    std::sort(ms.begin(), ms.end());
    return ms[ms.size() / 2] * 1000.0f;
  }
};

// Two GPUs (peer access over NVLink): GB/s over the link, one direction, for the patterns of the HT
// kernels: push (a rank stores into its peer's memory), both ranks pushing at once, pull (a rank loads
// from its peer: the combine), and the dispatch's (every row read once, stored locally AND to the peer,
// both ranks at once). Wall time of launch + completion on both GPUs, median of 20.
using Variant = std::function<void(char* dst, char* dst2, const char* src, int64_t bytes, int blocks, cudaStream_t)>;

template <int U, int TH>
Variant reg_variant() {
  return [](char* dst, char* dst2, const char* src, int64_t bytes, int blocks, cudaStream_t st) {
    const int units = 7168 * 2 / 16, rows = static_cast<int>(bytes / (units * 16));
    reg_copy<U, TH><<<blocks, TH, 0, st>>>(reinterpret_cast<int4*>(dst), reinterpret_cast<int4*>(dst2),
                                           reinterpret_cast<const int4*>(src), rows, units);
  };
}
template <int I, int S, int CB>
Variant bulk_variant() {
  return [](char* dst, char* dst2, const char* src, int64_t bytes, int blocks, cudaStream_t st) {
    bulk_copy<I, S, CB><<<blocks, I * 32, I * S * CB, st>>>(dst, dst2, src, bytes);
  };
}

static void two_gpus() {
  const int rows = 4096, row_bytes = 7168 * 2;
  const int64_t bytes = static_cast<int64_t>(rows) * row_bytes;
  char *src[2], *loc[2], *in[2];
  cudaStream_t st[2];
  for (int d = 0; d < 2; ++d) {
    check(cudaSetDevice(d), "device");
    check(cudaDeviceEnablePeerAccess(1 - d, 0), "peer access");
    check(cudaMalloc(&src[d], bytes), "malloc");
    check(cudaMalloc(&loc[d], bytes), "malloc");
    check(cudaMalloc(&in[d], bytes), "malloc");
    check(cudaMemset(src[d], d + 1, bytes), "memset");
    check(cudaStreamCreateWithFlags(&st[d], cudaStreamNonBlocking), "stream");
    // (the attribute is per device)
    check(cudaFuncSetAttribute(bulk_copy<8, 4, 4096>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 4 * 4096), "a");
    check(cudaFuncSetAttribute(bulk_copy<1, 8, 14336>, cudaFuncAttributeMaxDynamicSharedMemorySize, 8 * 14336), "a");
    check(cudaFuncSetAttribute(bulk_copy<16, 3, 4096>, cudaFuncAttributeMaxDynamicSharedMemorySize, 16 * 3 * 4096), "a");
  }
  auto wall_us = [&](const std::function<void()>& f) {
    std::vector<double> us;
    for (int i = 0; i < 21; ++i) {
      for (int d = 0; d < 2; ++d) { cudaSetDevice(d); cudaDeviceSynchronize(); }
      const auto t0 = std::chrono::steady_clock::now();
      f();
      for (int d = 0; d < 2; ++d) { cudaSetDevice(d); check(cudaStreamSynchronize(st[d]), "sync"); }
      const auto t1 = std::chrono::steady_clock::now();
      if (i > 0) us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
    std::sort(us.begin(), us.end());
    return us[us.size() / 2];
  };
  std::vector<char> host(bytes);
  auto all = [&](const char* p, int d, char v) {
    cudaSetDevice(d);
    check(cudaMemcpy(host.data(), p, bytes, cudaMemcpyDeviceToHost), "readback");
    return std::all_of(host.begin(), host.end(), [&](char c) { return c == v; });
  };
  auto line = [&](const std::string& name, int blocks, const char* pattern, double us, bool ok) {
    std::printf("%-22s blocks %4d  %-34s %8.1f us  %6.0f GB/s per direction%s\n", name.c_str(), blocks, pattern, us,
                bytes / us / 1e3, ok ? "" : "  WRONG");
  };
  std::printf("\ntwo GPUs, peer access; %d rows of %d B (%.1f MB) per direction\n", rows, row_bytes, bytes / 1e6);
  const double ce = wall_us([&] {
    cudaSetDevice(0);
    cudaMemcpyPeerAsync(in[1], 1, src[0], 0, bytes, st[0]);
  });
  line("cudaMemcpyPeerAsync", 0, "push 0 -> 1 (copy engine)", ce, all(in[1], 1, 1));
  std::vector<std::pair<std::string, Variant>> variants = {
      {"reg<8, 512>", reg_variant<8, 512>()},        {"reg<8, 1024>", reg_variant<8, 1024>()},
      {"bulk<8, 4, 4096>", bulk_variant<8, 4, 4096>()}, {"bulk<1, 8, 14336>", bulk_variant<1, 8, 14336>()},
      {"bulk<16, 3, 4096>", bulk_variant<16, 3, 4096>()}};
  for (int blocks : {24, 48}) {
    for (auto& entry : variants) {
      const std::string& name = entry.first;
      Variant& v = entry.second;
      auto on = [&](int d, char* dst, char* dst2, const char* from) {
        cudaSetDevice(d);
        v(dst, dst2, from, bytes, blocks, st[d]);
      };
      for (int d = 0; d < 2; ++d) { cudaSetDevice(d); cudaMemset(in[d], 0, bytes); cudaMemset(loc[d], 0, bytes); }
      double us = wall_us([&] { on(0, in[1], nullptr, src[0]); });
      line(name, blocks, "push 0 -> 1", us, all(in[1], 1, 1));
      us = wall_us([&] { on(0, in[1], nullptr, src[0]); on(1, in[0], nullptr, src[1]); });
      line(name, blocks, "push both ways at once", us, all(in[0], 0, 2));
      us = wall_us([&] { on(0, loc[0], nullptr, src[1]); });
      line(name, blocks, "pull 1 -> 0 (kernel on 0)", us, all(loc[0], 0, 2));
      for (int d = 0; d < 2; ++d) { cudaSetDevice(d); cudaMemset(in[d], 0, bytes); cudaMemset(loc[d], 0, bytes); }
      us = wall_us([&] { on(0, loc[0], in[1], src[0]); on(1, loc[1], in[0], src[1]); });
      line(name, blocks, "dispatch: local + peer, both ranks", us, all(in[0], 0, 2) && all(loc[1], 1, 2));
    }
  }
}

int main(int argc, char** argv) {
  const int rows = 4096, row_bytes = 7168 * 2, units = row_bytes / 16;
  const int64_t bytes = static_cast<int64_t>(rows) * row_bytes;
  char *src, *dst;
  check(cudaMalloc(&src, bytes), "malloc");
  check(cudaMalloc(&dst, bytes), "malloc");
  check(cudaMemset(src, 1, bytes), "memset");
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("%s, %d SMs; %d rows of %d B (%.1f MB)\n", prop.name, sms, rows, row_bytes, bytes / 1e6);
  Timer tm;
  std::vector<char> host(bytes);
  // Times f, then runs it once more into a zeroed dst and checks every byte arrived.
  auto measure = [&](const char* name, int blocks, auto&& f) {
    const float us = tm.median_us(f);
    check(cudaMemset(dst, 0, bytes), "memset");
    f();
    check(cudaMemcpy(host.data(), dst, bytes, cudaMemcpyDeviceToHost), "readback");
    const bool ok = std::all_of(host.begin(), host.end(), [](char c) { return c == 1; });
    std::printf("%-28s blocks %4d  %8.1f us  %7.0f GB/s%s\n", name, blocks, us, 2.0 * bytes / us / 1e3,
                ok ? "" : "  WRONG");
  };
  measure("cudaMemcpyAsync", 0, [&] { cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice); });
  int devices = 0;
  cudaGetDeviceCount(&devices);
  if (devices >= 2 && argc > 1 && std::string(argv[1]) == "two") {
    two_gpus();
    return 0;
  }
  const int grids[] = {24, 48, sms};
  for (int g : grids) {
#define REG(U, TH)                                                                                         \
  measure("reg<" #U ", " #TH ">", g, [&] {                                                                \
    reg_copy<U, TH><<<g, TH>>>(reinterpret_cast<int4*>(dst), nullptr, reinterpret_cast<const int4*>(src), rows, units);   \
  });
    REG(4, 512) REG(8, 512) REG(16, 512) REG(8, 1024)
#undef REG
#define BULK(I, S, CB)                                                                                   \
  {                                                                                                      \
    auto k = bulk_copy<I, S, CB>;                                                                        \
    const int smem = I * S * CB;                                                                         \
    check(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, smem), "smem attr");      \
    measure("bulk<" #I ", " #S ", " #CB ">", g, [&] { k<<<g, I * 32, smem>>>(dst, nullptr, src, bytes); });         \
    check(cudaGetLastError(), "bulk");                                                                   \
  }
    BULK(1, 8, 14336) BULK(2, 6, 14336) BULK(4, 6, 7168) BULK(8, 4, 4096) BULK(16, 3, 4096) BULK(4, 12, 3584)
#undef BULK
  }
  return 0;
}
