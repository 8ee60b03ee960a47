// Host -> device copy rates by source memory and copy size (issue 27: why do 4 GiB loads from the
// host tier run at 44-47 GB/s when one copy from cudaMallocHost memory runs at 55?).
// Build and run on the GPU machine: nvcc -O2 -o /tmp/copy_rates scripts/gpu/copy_rates.cu && /tmp/copy_rates [GiB]
// Sources: cudaMallocHost; mmap + MADV_HUGEPAGE + cudaHostRegister (kvtier's host tier);
// mmap + MADV_NOHUGEPAGE + cudaHostRegister. Copies: one of the whole buffer; 2 MiB, 512 KiB and
// 32 KiB pieces one by one (cudaMemcpyAsync) into a contiguous device buffer, on one stream and
// round-robin over 2 or 4 streams; best of 3.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

// Pieces round-robin over `ns` streams (each may get a copy engine of its own), timed from an
// event on the first stream to all streams done.
static double rate(void* src, void* dst, size_t bytes, size_t piece, cudaStream_t* s, int ns) {
  cudaEvent_t a, b, done[8];
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&b));
  for (int i = 0; i < ns; i++) CK(cudaEventCreate(&done[i]));
  double best = 0;
  for (int rep = 0; rep < 3; rep++) {
    CK(cudaEventRecord(a, s[0]));
    for (int i = 1; i < ns; i++) CK(cudaStreamWaitEvent(s[i], a, 0));
    size_t k = 0;
    for (size_t o = 0; o < bytes; o += piece, k++)
      CK(cudaMemcpyAsync((char*)dst + o, (char*)src + o, piece, cudaMemcpyHostToDevice, s[k % ns]));
    for (int i = 1; i < ns; i++) { CK(cudaEventRecord(done[i], s[i])); CK(cudaStreamWaitEvent(s[0], done[i], 0)); }
    CK(cudaEventRecord(b, s[0]));
    CK(cudaEventSynchronize(b));
    float ms; CK(cudaEventElapsedTime(&ms, a, b));
    double gbs = bytes / (ms * 1e-3) / 1e9;
    if (gbs > best) best = gbs;
  }
  return best;
}

int main(int argc, char** argv) {
  size_t gib = argc > 1 ? strtoul(argv[1], 0, 10) : 4;
  size_t bytes = gib << 30;
  void* dev; CK(cudaMalloc(&dev, bytes));
  cudaStream_t s[4];
  for (int i = 0; i < 4; i++) CK(cudaStreamCreateWithFlags(&s[i], cudaStreamNonBlocking));
  const char* names[3] = {"cudaMallocHost", "mmap+THP+register", "mmap 4K+register"};
  size_t pieces[4] = {bytes, 2u << 20, 512u << 10, 32u << 10};
  printf("| source | one copy | 2 MiB | 512 KiB | 32 KiB | 512 KiB, 2 streams | 512 KiB, 4 streams | 256 KiB, 4 streams | 32 KiB, 4 streams |\n|---|---|---|---|---|---|---|---|---|\n");
  for (int k = 0; k < 3; k++) {
    void* h;
    if (k == 0) {
      CK(cudaMallocHost(&h, bytes));
    } else {
      h = mmap(0, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (h == MAP_FAILED) { perror("mmap"); return 1; }
      madvise(h, bytes, k == 1 ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      memset(h, 1, bytes);
      CK(cudaHostRegister(h, bytes, cudaHostRegisterDefault));
    }
    memset(h, 7, bytes);
    printf("| %s (%zu GiB) |", names[k], gib);
    for (size_t p : pieces) printf(" %.1f GB/s |", rate(h, dev, bytes, p, s, 1));
    printf(" %.1f |", rate(h, dev, bytes, 512u << 10, s, 2));
    printf(" %.1f |", rate(h, dev, bytes, 512u << 10, s, 4));
    printf(" %.1f |", rate(h, dev, bytes, 256u << 10, s, 4));
    printf(" %.1f |", rate(h, dev, bytes, 32u << 10, s, 4));
    printf("\n");
    fflush(stdout);
    if (k == 0) CK(cudaFreeHost(h)); else { CK(cudaHostUnregister(h)); munmap(h, bytes); }
  }
  return 0;
}
