// Layer-by-layer host -> device copies of block-major host memory (issue 27: can a layered load
// of kvtier's host tier, whose blocks hold every layer, run at the link rate one layer at a time?).
// Host: N blocks of L layers x `row` bytes (a layer's K and V of one block, adjacent), block-major
// as in kvtier's host tier, in one registered mmap (as HostStorage pins it). Each mode moves every
// byte into a device staging buffer laid out layer-major (layer l's rows of all blocks adjacent),
// layer by layer on one stream:
//   one copy     the whole buffer in one cudaMemcpyAsync (the link's rate, the baseline)
//   rows         one cudaMemcpyAsync per (layer, block) row: what a per-layer plan costs today
//   2D           one cudaMemcpy2DAsync per layer (width `row`, source pitch = block bytes,
//                height N): the copy engine walks the strided rows itself
//   2D, runs of R  the same per run of R consecutive blocks (host slots not all adjacent)
// Also the time until layer 0 is in (what the forward pass waits for before its first layer).
// Build and run on the GPU machine:
//   nvcc -O2 -o /tmp/layer_copies scripts/gpu/layer_copies.cu && /tmp/layer_copies [blocks] [layers] [row KiB]
// (defaults 2048 blocks, 32 layers, 64 KiB rows: 4 GiB, a 32K-token Llama-3.1-8B prompt).
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <cuda_runtime.h>

#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { \
  fprintf(stderr, "%s: %s\n", #x, cudaGetErrorString(e)); exit(1); } } while (0)

struct Shape { size_t blocks, layers, row; };

// Enqueue one mode's copies; mode 0 one copy, 1 rows, 2 2D per layer, 3+ 2D per run of `mode` blocks.
static void enqueue(int mode, char* dst, const char* src, Shape s, cudaStream_t st, cudaEvent_t first) {
  size_t block = s.layers * s.row, total = s.blocks * block;
  if (mode == 0) {
    CK(cudaMemcpyAsync(dst, src, total, cudaMemcpyHostToDevice, st));
    CK(cudaEventRecord(first, st));
    return;
  }
  for (size_t l = 0; l < s.layers; l++) {
    char* d = dst + l * s.blocks * s.row;
    const char* h = src + l * s.row;
    if (mode == 1) {
      for (size_t b = 0; b < s.blocks; b++)
        CK(cudaMemcpyAsync(d + b * s.row, h + b * block, s.row, cudaMemcpyHostToDevice, st));
    } else {
      size_t run = mode == 2 ? s.blocks : (size_t)mode;
      for (size_t b = 0; b < s.blocks; b += run) {
        size_t n = s.blocks - b < run ? s.blocks - b : run;
        CK(cudaMemcpy2DAsync(d + b * s.row, s.row, h + b * block, block, s.row, n,
                             cudaMemcpyHostToDevice, st));
      }
    }
    if (l == 0) CK(cudaEventRecord(first, st));
  }
}

int main(int argc, char** argv) {
  Shape s = {argc > 1 ? strtoul(argv[1], 0, 10) : 2048, argc > 2 ? strtoul(argv[2], 0, 10) : 32,
             (argc > 3 ? strtoul(argv[3], 0, 10) : 64) << 10};
  size_t total = s.blocks * s.layers * s.row;
  void* h = mmap(0, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (h == MAP_FAILED) { perror("mmap"); return 1; }
  madvise(h, total, MADV_HUGEPAGE);
  for (size_t i = 0; i < total; i += 4096) ((char*)h)[i] = (char)(i >> 12);
  CK(cudaHostRegister(h, total, cudaHostRegisterDefault));
  char* dev; CK(cudaMalloc(&dev, total));
  char* check = (char*)malloc(s.row);
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t a, first, b;
  CK(cudaEventCreate(&a)); CK(cudaEventCreate(&first)); CK(cudaEventCreate(&b));
  int modes[] = {0, 1, 2, 256, 64, 16};
  printf("%zu blocks x %zu layers x %zu KiB rows = %.2f GiB, registered THP mmap -> device, one stream, best of 3\n\n",
         s.blocks, s.layers, s.row >> 10, total / 1073741824.0);
  printf("| copies | GB/s | layer 0 in after | calls |\n|---|---|---|---|\n");
  for (int m : modes) {
    if (m > 2 && (size_t)m >= s.blocks) continue;
    double best = 0, first_ms = 0;
    for (int rep = 0; rep < 3; rep++) {
      CK(cudaMemsetAsync(dev, 0, total, st));
      CK(cudaEventRecord(a, st));
      enqueue(m, dev, (const char*)h, s, st, first);
      CK(cudaEventRecord(b, st));
      CK(cudaEventSynchronize(b));
      float ms, f; CK(cudaEventElapsedTime(&ms, a, b)); CK(cudaEventElapsedTime(&f, a, first));
      double gbs = total / (ms * 1e-3) / 1e9;
      if (gbs > best) { best = gbs; first_ms = f; }
    }
    // The layer-major modes put block 1's layer 1 row at [1][1]: check it against the host.
    if (m != 0) {
      size_t block = s.layers * s.row;
      CK(cudaMemcpy(check, dev + (1 * s.blocks + 1) * s.row, s.row, cudaMemcpyDeviceToHost));
      if (memcmp(check, (char*)h + 1 * block + 1 * s.row, s.row) != 0) { fprintf(stderr, "mode %d: wrong bytes\n", m); return 1; }
    }
    size_t calls = m == 0 ? 1 : m == 1 ? s.layers * s.blocks : m == 2 ? s.layers : s.layers * ((s.blocks + m - 1) / m);
    const char* name = m == 0 ? "one copy" : m == 1 ? "rows (one per layer and block)" : m == 2 ? "2D, one per layer" : "2D per run";
    if (m > 2) printf("| %s of %d blocks | %.1f | %.2f ms | %zu |\n", name, m, best, first_ms, calls);
    else printf("| %s | %.1f | %.2f ms | %zu |\n", name, best, first_ms, calls);
  }
  return 0;
}
