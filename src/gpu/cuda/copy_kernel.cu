// kvring's copy kernel: the middle tier of a chunk's copies, for drivers
// without cuMemcpyBatchAsync (CUDA 12.8). One thread block per copy (a
// grid-stride loop when there are more copies than blocks); its threads
// move 16-byte words when both ends and the length are 16-byte aligned,
// else single bytes. The descriptor array lives in pinned host memory that
// the device reads over the bus: no copy of it is needed first.
//
// copy_kernel.ptx is this file compiled by NVRTC (-arch=compute_70) with its
// `.version` set to 7.0, so drivers from CUDA 11.0 on can JIT it:
//   python3 src/gpu/cuda/build_copy_kernel.py

struct KvringCopy {
    unsigned long long src;
    unsigned long long dst;
    unsigned long long len;
};

extern "C" __global__ void kvring_copy(const KvringCopy *copies, unsigned int count) {
    for (unsigned int c = blockIdx.x; c < count; c += gridDim.x) {
        const KvringCopy copy = copies[c];
        if (((copy.src | copy.dst | copy.len) & 15ULL) == 0) {
            const uint4 *src = reinterpret_cast<const uint4 *>(copy.src);
            uint4 *dst = reinterpret_cast<uint4 *>(copy.dst);
            const unsigned long long words = copy.len >> 4;
            for (unsigned long long i = threadIdx.x; i < words; i += blockDim.x) {
                dst[i] = src[i];
            }
        } else {
            const unsigned char *src = reinterpret_cast<const unsigned char *>(copy.src);
            unsigned char *dst = reinterpret_cast<unsigned char *>(copy.dst);
            for (unsigned long long i = threadIdx.x; i < copy.len; i += blockDim.x) {
                dst[i] = src[i];
            }
        }
    }
}
