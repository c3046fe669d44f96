// Paged decode attention, flash-decoding style: the CUDA twin of the CPU kernel of the same name
// (cpu/cpu_kernels.h has the contract: shapes, strides, the workspace layout).
//
// The problem. Sequence b has one new query token (n_heads vectors of head_dim) and
// context_lens[b] keys and values, scattered over the KV pool in blocks of block_size tokens;
// block_tables[b] lists its blocks in order. Decoding is memory-bound: a K or V byte is used for
// a handful of multiply-adds (one per query head of its GQA group), so the kernel is as fast as it
// reads the cache. The design is about reading every byte once, in wide coalesced loads, with
// enough loads in flight to hide the memory latency.
//
// The plan (flash-decoding). One block per (sequence, head) would leave most of the GPU idle at
// small batch, and walk long contexts slowly, so the keys are cut into partitions of
// partition_size, and the partitions of a sequence are shared among n_splits blocks:
//
//   kernel 1  grid (n_splits, n_kv_heads * head_chunks, batch), 128 threads (4 warps).
//             A block takes partitions split, split + n_splits, ... of one sequence, for one KV
//             head and every query head of that KV head's group (GQA: query head h reads KV head
//             h / (n_heads / n_kv_heads)), up to kMaxHeads of them; a bigger group is split into
//             head_chunks blocks. It reads each of its K and V vectors from global memory once,
//             uses it for all its query heads, and leaves per head an unnormalised partial output
//             o = sum_j e^(s_j - m) v_j, its max m and its sum l = sum_j e^(s_j - m) in the
//             workspace, or, when the sequence has a single partition, the output itself.
//   kernel 2  grid (n_heads, batch): merges a head's splits into the output; nothing to do for a
//             sequence with one partition.
//
// The grid comes from numbers the host knows (the batch, the SM count, and max_blocks *
// block_size, the table's width), never from context_lens (device memory): the launch never
// waits for the GPU, so the pair can be captured in a CUDA graph and replayed whatever the
// lengths. Under graphs the table is as wide as the longest context the engine allows (131,072
// keys for Llama 3.2, 512 partitions of 256): one block per partition would launch 4,096 blocks
// per layer at batch 1 and 131,072 at batch 32, almost all of them for partitions past the end.
// Here n_splits is what fills the GPU (about kBlocksPerSm blocks per SM, split among the batch's
// sequences and KV heads) and at most the number of partitions; a block loops over its
// partitions, and a split with none (past the end of its sequence) returns without writing.
//
// Inside a block: lane groups, each running an online softmax.
// A key's head_dim vector is 128 or 256 bytes in bf16. kLanesPerKey lanes read it, each with one
// 16-byte load when the sizes allow (else several narrower ones: heads of 96), so a warp reads
// kKeysPerWarp keys at once, one per lane group ("group").
// Every lane holds the same slice of head_dim of the query (every head of the block, already
// multiplied by `scale`) and of the output accumulators. A score is the lane's partial dot
// product summed over the group's lanes by a butterfly of shuffles, after which every lane of the
// group has it. Each group walks its own keys (group, group + kGroups, ...) with an online
// softmax of its own: a running max m, sum l and accumulator o per head, updated key by key:
//   m' = max(m, s),  a = e^(m - m'),  p = e^(s - m'),  l' = a l + p,  o' = a o + p v.
//
// Why registers, not shared memory, for K and V: a K or V element is used by exactly one lane
// (for every head of the group), so there is nothing to share, and staging it through shared
// memory would cost a store, a barrier and a load for nothing. Shared memory holds what threads do
// share: the physical row of each key of the partition (looked up once in the block table, so the
// hot loop has no division), and the final merge of the warps.
//
// Merging two parts (m1, l1, o1) and (m2, l2, o2) is the one rule used at every level:
//   M = max(m1, m2),  a_i = e^(m_i - M),  l = a1 l1 + a2 l2,  o = a1 o1 + a2 o2,
// with a_i = 0 for a part that saw no key (m_i = -inf): e^(-inf - -inf) would be NaN.
// The groups of a warp merge through shuffles, the warps of a block through shared memory, the
// partitions of a sequence in kernel 2, which finally divides o by l.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "dtype.cuh"
#include "launchers.h"

namespace kernels::cuda {
namespace {

constexpr int kWarps = 4;  // warps per block of kernel 1
constexpr int kThreads = kWarps * 32;
constexpr int kMaxHeads = 8;           // query heads per block: their q and o live in registers
constexpr int kSmemLimit = 48 * 1024;  // shared memory a block gets without opting in
constexpr int kBlocksPerSm = 4;        // kernel 1's grid: enough resident warps to keep loads in flight

// The weight e^(m - M) of a part whose max is m in a merge whose max is M >= m; 0 for a part that
// saw no key (m = -inf), which also covers M = -inf, where e^(m - M) would be NaN.
__device__ __forceinline__ float rescale(float m, float M) { return m == -INFINITY ? 0.f : __expf(m - M); }

// Sum of v over the LANES consecutive lanes of a lane group (LANES a power of two dividing 32):
// a butterfly, after which every lane of the group holds the sum. xor with offsets < LANES never
// leaves the group. Every lane of the warp must take part.
template <int LANES>
__device__ __forceinline__ float group_sum(float v) {
#pragma unroll
    for (int offset = LANES / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}

constexpr int pow2_at_least(int n) { return n <= 1 ? 1 : 2 * pow2_at_least((n + 1) / 2); }
constexpr int pow2_dividing(int n, int cap) { return n % 2 == 0 && cap > 1 ? 2 * pow2_dividing(n / 2, cap / 2) : 1; }

// How kernel 1 cuts the work, for element type T, HEAD_DIM and HEADS query heads per block.
// A lane holds kVec elements of head_dim (at most one 16-byte load's worth: 8 bf16, 4 floats, so
// q and o fit in registers), read as kAccesses loads of kAccess elements. Lane g of a group reads
// elements [(j * kLanesPerKey + g) * kAccess, ... + kAccess) for j < kAccesses: for each j the
// group's loads are side by side in memory (coalesced). Heads of 32 to 256 values:
//   head_dim   bf16: lanes x elements (loads)   float: lanes x elements (loads)
//   32, 64          4, 8  x 8 (1 x 16 B)            8, 16 x 4 (1 x 16 B)
//   96              16 x 6 (3 x 4 B)                 32 x 3 (3 x 4 B)
//   128             16 x 8 (1 x 16 B)                32 x 4 (1 x 16 B)
//   256             32 x 8 (1 x 16 B)                32 x 8 (2 x 16 B)
// The ACCESSES loads of one key, as the lane's VEC floats in order.
template <typename T, int ACCESS, int ACCESSES>
__device__ __forceinline__ void unpack_all(const Packed<T, ACCESS> (&raw)[ACCESSES], float (&out)[ACCESS * ACCESSES]) {
#pragma unroll
    for (int j = 0; j < ACCESSES; ++j) {
        float part[ACCESS];
        unpack<T, ACCESS>(raw[j], part);
#pragma unroll
        for (int e = 0; e < ACCESS; ++e) out[j * ACCESS + e] = part[e];
    }
}

template <typename T, int HEAD_DIM, int HEADS>
struct Layout {
    static constexpr int kMaxVec = 16 / static_cast<int>(sizeof(T));  // elements in one 16-byte load
    static constexpr int kLanesPerKey = pow2_at_least(HEAD_DIM / kMaxVec) < 32 ? pow2_at_least(HEAD_DIM / kMaxVec) : 32;
    static constexpr int kVec = HEAD_DIM / kLanesPerKey;          // elements of a key per lane
    static constexpr int kAccess = pow2_dividing(kVec, kMaxVec);  // elements per load
    static constexpr int kAccesses = kVec / kAccess;              // loads per lane per key
    static constexpr int kKeysPerWarp = 32 / kLanesPerKey;        // lane groups per warp
    static constexpr int kGroups = kWarps * kKeysPerWarp;         // keys the block reads side by side
    // Keys per group per step, all loaded before any is used: more bytes in flight per lane, and
    // fewer steps, each of which waits for the memory once. Bounded by registers: q and o take
    // 2 * HEADS * kVec floats per lane, a key's K and V 8 more words. With these values ptxas
    // (CUDA 13) uses 72-156 registers up to 4 heads (3 to 7 blocks of 128 threads per SM) and
    // 206-228 with 8 heads (2 blocks, as many as with a single key). __launch_bounds__(kThreads, 1)
    // asks for no occupancy: without it, ptxas spilled a few bytes of the 4-head variants to
    // squeeze them into 96 or 128 registers, and a spill is a local-memory round trip per step.
    static constexpr int kUnroll = HEADS >= 8 ? 2 : (HEADS >= 4 ? 3 : 4);
    // Static shared memory of the warps' merge.
    static constexpr int kMergeBytes = kWarps * HEADS * (HEAD_DIM + 2) * static_cast<int>(sizeof(float));
    static_assert(HEAD_DIM % kLanesPerKey == 0 && kVec <= 8 && kAccess * sizeof(T) >= 4,
                  "a key's vector is read by a power-of-two number of lanes of one warp, 4 to 16 bytes at a time");
    // Element i of this lane's slice: its place in head_dim, for the lane at `g` in its group.
    __device__ static int dim(int g, int i) { return ((i / kAccess) * kLanesPerKey + g) * kAccess + i % kAccess; }
};

// Everything kernel 1 needs besides its template, by value.
struct Params {
    const void* q;
    int64_t q_stride;
    const void* k_pool;
    const void* v_pool;
    const int32_t* block_tables;
    const int32_t* context_lens;
    void* out;        // [batch, n_heads, head_dim]: written here for a sequence with one partition
    float* part_out;  // [batch, n_heads, n_splits, head_dim]
    float* part_max;  // [batch, n_heads, n_splits]
    float* part_sum;  // [batch, n_heads, n_splits]
    int n_heads, n_kv_heads, block_size, max_blocks, partition_size, n_splits, head_chunks;
    float scale;
};

// --- kernel 1: one split of the partitions, one KV head, the query heads of its group ------------
template <typename T, int HEAD_DIM, int HEADS>
__global__ void __launch_bounds__(kThreads, 1) partition_kernel(const Params p) {
    using L = Layout<T, HEAD_DIM, HEADS>;
    constexpr int VEC = L::kVec;

    extern __shared__ int key_rows[];  // [partition_size]: pool row (block * block_size + slot) per key
    __shared__ float merge_max[kWarps][HEADS];
    __shared__ float merge_sum[kWarps][HEADS];
    __shared__ float merge_out[kWarps][HEADS][HEAD_DIM];

    const int split = blockIdx.x;
    const int kv_head = blockIdx.y / p.head_chunks;
    const int chunk = blockIdx.y % p.head_chunks;
    const int b = blockIdx.z;
    const int group_heads = p.n_heads / p.n_kv_heads;            // query heads per KV head
    const int head0 = kv_head * group_heads + chunk * HEADS;     // this block's first query head
    const int n_here = min(HEADS, group_heads - chunk * HEADS);  // and how many it has

    // The partitions that hold keys of sequence b. The clamp guards the block table against a
    // context longer than the table (a broken caller); the contract says it never is.
    const int max_keys = p.max_blocks * p.block_size;
    const int context = min(max(p.context_lens[b], 0), max_keys);
    const int n_parts = (context + p.partition_size - 1) / p.partition_size;
    T* out = static_cast<T*>(p.out) + (static_cast<int64_t>(b) * p.n_heads + head0) * HEAD_DIM;

    // Past the end of the sequence: nothing to read, nothing to write. The whole block takes this
    // branch (no barrier is skipped by some threads only). An empty context (outside the
    // contract) still gets its zeros, from split 0.
    if (split >= n_parts) {
        if (n_parts == 0 && split == 0)
            for (int i = threadIdx.x; i < n_here * HEAD_DIM; i += kThreads) store(out + i, 0.f);
        return;
    }

    // 1. This lane's place: lane group `group` reads one key at a time, this lane (at `g` in its
    //    group) its elements L::dim(g, 0..VEC) of head_dim.
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int group = warp * L::kKeysPerWarp + lane / L::kLanesPerKey;
    const int g = lane % L::kLanesPerKey;

    // The query slice of every head, times scale, so that a dot product is the score itself.
    const T* q = static_cast<const T*>(p.q) + b * p.q_stride + static_cast<int64_t>(head0) * HEAD_DIM;
    float qv[HEADS][VEC];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) qv[h][e] = h < n_here ? load(q + h * HEAD_DIM + L::dim(g, e)) * p.scale : 0.f;
    }

    // 2. The online softmax of this lane group over its keys, in every partition of the split.
    float m[HEADS], l[HEADS], o[HEADS][VEC];
#pragma unroll
    for (int h = 0; h < HEADS; ++h) {
        m[h] = -INFINITY;
        l[h] = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) o[h][e] = 0.f;
    }

    const T* k_pool = static_cast<const T*>(p.k_pool);
    const T* v_pool = static_cast<const T*>(p.v_pool);
    const int64_t row_stride = static_cast<int64_t>(p.n_kv_heads) * HEAD_DIM;  // pool row: [n_kv_heads, head_dim]
    const int64_t head_offset = static_cast<int64_t>(kv_head) * HEAD_DIM + L::dim(g, 0);
    constexpr int ACCESS = L::kAccess, ACCESSES = L::kAccesses;
    constexpr int kStride = L::kLanesPerKey * ACCESS;  // from one of a lane's loads to its next

    // Partitions split, split + n_splits, ...: the softmax state above carries over from one to
    // the next, so the split's result is one partial whatever the number of its partitions.
#pragma unroll 1  // a loop of whole partitions: unrolling it would only double the code
    for (int key_begin = split * p.partition_size; key_begin < context; key_begin += p.n_splits * p.partition_size) {
        // 3. Where each key of the partition lives: token t is slot t % block_size of block
        //    block_tables[b, t / block_size]. One division per key here, none in the loop below.
        const int n_keys = min(p.partition_size, context - key_begin);  // >= 1
        const int32_t* table = p.block_tables + static_cast<int64_t>(b) * p.max_blocks;
        __syncthreads();  // every thread is done with the previous partition's rows
        for (int k = threadIdx.x; k < n_keys; k += kThreads) {
            const int t = key_begin + k;
            key_rows[k] = table[t / p.block_size] * p.block_size + t % p.block_size;
        }
        __syncthreads();

        // The trip count is the same for every thread of the block (it depends on n_keys only), so
        // every lane reaches every shuffle; a group with no key in a step masks its scores to -inf.
        for (int base = 0; base < n_keys; base += L::kGroups * L::kUnroll) {
            // a. Issue the loads of all kUnroll keys first: they are in flight together.
            Packed<T, ACCESS> kraw[L::kUnroll][ACCESSES], vraw[L::kUnroll][ACCESSES];
            bool valid[L::kUnroll];
#pragma unroll
            for (int u = 0; u < L::kUnroll; ++u) {
                const int k = base + u * L::kGroups + group;
                valid[u] = k < n_keys;
#pragma unroll
                for (int j = 0; j < ACCESSES; ++j) {
                    if (valid[u]) {
                        const int64_t offset = key_rows[k] * row_stride + head_offset + j * kStride;
                        kraw[u][j] = load_packed<T, ACCESS, true>(k_pool + offset);
                        vraw[u][j] = load_packed<T, ACCESS, true>(v_pool + offset);
                    } else {  // zeros, not garbage: p = 0 below, and 0 * NaN would still be NaN
                        kraw[u][j] = zero_packed<T, ACCESS>();
                        vraw[u][j] = zero_packed<T, ACCESS>();
                    }
                }
            }

            // b. Scores s[u][h] = q_h . k_u: a partial dot product per lane, summed over the group.
            float s[L::kUnroll][HEADS];
#pragma unroll
            for (int u = 0; u < L::kUnroll; ++u) {
                float kf[VEC];
                unpack_all(kraw[u], kf);
#pragma unroll
                for (int h = 0; h < HEADS; ++h) {
                    if (h >= n_here) break;  // the same for the whole block
                    float dot = 0.f;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) dot = fmaf(qv[h][e], kf[e], dot);
                    dot = group_sum<L::kLanesPerKey>(dot);
                    s[u][h] = valid[u] ? dot : -INFINITY;
                }
            }

            // c. Per head: the new running max, the rescale of what came before, and the weights
            //    p = e^(s - m_new) of the step's keys (in place of their scores). One rescale per step
            //    of kUnroll keys rather than per key.
#pragma unroll
            for (int h = 0; h < HEADS; ++h) {
                if (h >= n_here) break;
                float m_new = m[h];
#pragma unroll
                for (int u = 0; u < L::kUnroll; ++u) m_new = fmaxf(m_new, s[u][h]);
                // m_new is -inf only while the group has seen no key; rescale() then gives 0, not NaN.
                const float a = rescale(m[h], m_new);
                l[h] *= a;
#pragma unroll
                for (int e = 0; e < VEC; ++e) o[h][e] *= a;
#pragma unroll
                for (int u = 0; u < L::kUnroll; ++u) {
                    s[u][h] = rescale(s[u][h], m_new);  // 0 for a masked key (s = -inf)
                    l[h] += s[u][h];
                }
                m[h] = m_new;
            }

            // d. o += p v, key by key: a V vector is converted to float once and used for every head.
#pragma unroll
            for (int u = 0; u < L::kUnroll; ++u) {
                float vf[VEC];
                unpack_all(vraw[u], vf);
#pragma unroll
                for (int h = 0; h < HEADS; ++h) {
                    if (h >= n_here) break;
#pragma unroll
                    for (int e = 0; e < VEC; ++e) o[h][e] = fmaf(s[u][h], vf[e], o[h][e]);
                }
            }
        }
    }  // the next partition of this split: the same running max, sum and output go on

    // 4. Merge the lane groups of the warp: lanes holding the same slice of head_dim sit
    //    kLanesPerKey apart, so xor over the group bits of the lane index pairs them up.
#pragma unroll
    for (int offset = L::kLanesPerKey; offset < 32; offset *= 2) {
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            if (h >= n_here) break;
            const float m_other = __shfl_xor_sync(0xffffffffu, m[h], offset);
            const float l_other = __shfl_xor_sync(0xffffffffu, l[h], offset);
            const float M = fmaxf(m[h], m_other);
            const float a = rescale(m[h], M), a_other = rescale(m_other, M);
            l[h] = a * l[h] + a_other * l_other;
#pragma unroll
            for (int e = 0; e < VEC; ++e) {
                const float o_other = __shfl_xor_sync(0xffffffffu, o[h][e], offset);
                o[h][e] = a * o[h][e] + a_other * o_other;
            }
            m[h] = M;
        }
    }

    // 5. Merge the warps through shared memory: the first group of each warp (which now holds
    //    the warp's result, as every group does) writes it, then each thread combines the warps
    //    for some (head, d) and writes the split's result to the workspace, or, for a sequence
    //    of one partition, the output itself: then there is nothing to merge.
    if (lane < L::kLanesPerKey) {
#pragma unroll
        for (int h = 0; h < HEADS; ++h) {
            if (h >= n_here) break;
#pragma unroll
            for (int e = 0; e < VEC; ++e) merge_out[warp][h][L::dim(g, e)] = o[h][e];
            if (lane == 0) {
                merge_max[warp][h] = m[h];
                merge_sum[warp][h] = l[h];
            }
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < n_here * HEAD_DIM; i += kThreads) {
        const int h = i / HEAD_DIM, d = i % HEAD_DIM;
        float M = -INFINITY;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) M = fmaxf(M, merge_max[w][h]);
        float out_d = 0.f, sum = 0.f;
#pragma unroll
        for (int w = 0; w < kWarps; ++w) {
            const float a = rescale(merge_max[w][h], M);
            out_d += a * merge_out[w][h][d];
            sum += a * merge_sum[w][h];
        }
        if (n_parts == 1) {
            store(out + i, out_d / sum);  // sum >= 1: the largest key has weight 1
            continue;
        }
        // Workspace entry (b, head0 + h, split) of the [batch, n_heads, n_splits] arrays.
        const int64_t entry = (static_cast<int64_t>(b) * p.n_heads + head0 + h) * p.n_splits + split;
        p.part_out[entry * HEAD_DIM + d] = out_d;
        if (d == 0) {
            p.part_max[entry] = M;  // finite: the split had keys, so some group saw one
            p.part_sum[entry] = sum;
        }
    }
}

// --- kernel 2: merge the splits of one (sequence, head) ---------------------------------------
// One thread per element of head_dim. Every thread computes the global max M and the weights
// e^(m_s - M) itself: they are a few loads of the same addresses (served once, broadcast) and
// no barrier is needed. Only the splits that had partitions wrote an entry, and only those are
// read; a sequence with one partition (or none) was written by kernel 1.
template <typename T>
__global__ void merge_kernel(T* __restrict__ out, const float* __restrict__ part_out,
                             const float* __restrict__ part_max, const float* __restrict__ part_sum,
                             const int32_t* __restrict__ context_lens, int n_heads, int head_dim, int partition_size,
                             int n_splits, int max_keys) {
    const int h = blockIdx.x, b = blockIdx.y;
    const int context = min(max(context_lens[b], 0), max_keys);
    const int n_parts = static_cast<int>((static_cast<int64_t>(context) + partition_size - 1) / partition_size);
    if (n_parts <= 1) return;
    const int used = min(n_parts, n_splits);
    const int64_t first = (static_cast<int64_t>(b) * n_heads + h) * n_splits;  // entry of split 0

    float M = -INFINITY;
    for (int part = 0; part < used; ++part) M = fmaxf(M, part_max[first + part]);

    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float num = 0.f, den = 0.f;
        for (int part = 0; part < used; ++part) {
            const float a = rescale(part_max[first + part], M);
            num += a * part_out[(first + part) * head_dim + d];
            den += a * part_sum[first + part];
        }
        // den >= 1: the largest key has weight 1. (A NaN in q or K still reaches the output, as it
        // would in the reference.)
        store(out + (static_cast<int64_t>(b) * n_heads + h) * head_dim + d, num / den);
    }
}

template <typename T, int HEAD_DIM, int HEADS>
cudaError_t launch_partitions(const Params& p, int batch, cudaStream_t stream) {
    using L = Layout<T, HEAD_DIM, HEADS>;
    const size_t dynamic_smem = static_cast<size_t>(p.partition_size) * sizeof(int);
    // Past 48 KB with the merge (256-value heads, 8 a block, partitions of 4096 keys: 49.4 KB) the
    // kernel must be allowed more first: a host-side attribute, so graph capture is unaffected.
    if (dynamic_smem + L::kMergeBytes > static_cast<size_t>(kSmemLimit)) {
        const cudaError_t err = cudaFuncSetAttribute(partition_kernel<T, HEAD_DIM, HEADS>,
                                                     cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                     static_cast<int>(dynamic_smem));
        if (err != cudaSuccess) return err;
    }
    const dim3 grid(p.n_splits, p.n_kv_heads * p.head_chunks, batch);
    partition_kernel<T, HEAD_DIM, HEADS><<<grid, kThreads, dynamic_smem, stream>>>(p);
    return cudaGetLastError();
}

template <typename T, int HEAD_DIM>
cudaError_t launch_partitions(const Params& p, int batch, int heads_per_block, cudaStream_t stream) {
    switch (heads_per_block) {
        case 1: return launch_partitions<T, HEAD_DIM, 1>(p, batch, stream);
        case 2: return launch_partitions<T, HEAD_DIM, 2>(p, batch, stream);
        case 4: return launch_partitions<T, HEAD_DIM, 4>(p, batch, stream);
        default: return launch_partitions<T, HEAD_DIM, kMaxHeads>(p, batch, stream);
    }
}

// Kernel 1's splits per sequence: about kBlocksPerSm blocks per SM over the whole grid
// (blocks_per_split = the batch's sequences times their KV-head blocks), at least one, at most a
// block per partition. A host query of the device (no wait for the GPU), so graph capture is fine.
int splits_for(int batch, int kv_blocks, int n_partitions) {
    int device = 0, sms = 0;
    if (cudaGetDevice(&device) != cudaSuccess ||
        cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || sms <= 0) {
        sms = 108;  // an A100's count: never reached on a working device
    }
    const int64_t per_split = static_cast<int64_t>(batch) * kv_blocks;
    const int64_t wanted = (static_cast<int64_t>(kBlocksPerSm) * sms + per_split - 1) / per_split;
    return static_cast<int>(std::min<int64_t>(std::max<int64_t>(wanted, 1), n_partitions));
}

}  // namespace

cudaError_t paged_decode_attention(void* out, const void* q, int64_t q_stride, const void* k_pool, const void* v_pool,
                                   const int32_t* block_tables, const int32_t* context_lens, float* workspace,
                                   int batch, int n_heads, int n_kv_heads, int head_dim, int block_size, int max_blocks,
                                   int partition_size, float scale, DType dtype, cudaStream_t stream) {
    if (batch < 0 || n_heads <= 0 || n_kv_heads <= 0 || n_heads % n_kv_heads != 0 || block_size <= 0 ||
        max_blocks <= 0 || partition_size <= 0 || partition_size % block_size != 0) {
        return cudaErrorInvalidValue;
    }
    if (!supported_head_dim(head_dim)) return cudaErrorInvalidValue;  // the instantiated sizes (kernels.h)
    if (batch == 0) return cudaSuccess;
    // K and V are read 16 bytes at a time: every (row, kv head) vector starts 16-byte aligned
    // when the pools do (head_dim * sizeof(T) is a multiple of 16).
    if (!is_aligned(k_pool, 16) || !is_aligned(v_pool, 16)) return cudaErrorInvalidValue;

    const int64_t max_keys = static_cast<int64_t>(max_blocks) * block_size;
    if (max_keys > INT_MAX) return cudaErrorInvalidValue;
    const int n_partitions = static_cast<int>((max_keys + partition_size - 1) / partition_size);

    // Query heads per block: the GQA group, rounded up to a power of two (the kernel's HEADS),
    // or kMaxHeads at a time in head_chunks blocks when the group is bigger.
    const int group_heads = n_heads / n_kv_heads;
    int heads_per_block = 1;
    while (heads_per_block < group_heads && heads_per_block < kMaxHeads) heads_per_block *= 2;
    const int head_chunks = (group_heads + heads_per_block - 1) / heads_per_block;
    if (static_cast<int64_t>(n_kv_heads) * head_chunks > 65535 || batch > 65535) return cudaErrorInvalidValue;

    const int n_splits = splits_for(batch, n_kv_heads * head_chunks, n_partitions);
    const int64_t partials = static_cast<int64_t>(batch) * n_heads * n_splits;
    float* part_max = workspace + partials * head_dim;  // after the partial outputs
    float* part_sum = part_max + partials;
    Params p{q,        q_stride, k_pool,     v_pool,     block_tables, context_lens,   out,      workspace,   part_max,
             part_sum, n_heads,  n_kv_heads, block_size, max_blocks,   partition_size, n_splits, head_chunks, scale};

    return dispatch_dtype(dtype, [&](auto tag) {
        using T = typename decltype(tag)::type;
        cudaError_t err = cudaErrorInvalidValue;
        switch (head_dim) {  // kernels.h's kHeadDims
            case 32: err = launch_partitions<T, 32>(p, batch, heads_per_block, stream); break;
            case 64: err = launch_partitions<T, 64>(p, batch, heads_per_block, stream); break;
            case 96: err = launch_partitions<T, 96>(p, batch, heads_per_block, stream); break;
            case 128: err = launch_partitions<T, 128>(p, batch, heads_per_block, stream); break;
            case 256: err = launch_partitions<T, 256>(p, batch, heads_per_block, stream); break;
        }
        if (err != cudaSuccess || n_partitions == 1) return err;  // one partition: kernel 1 wrote the output
        merge_kernel<T><<<dim3(n_heads, batch), head_dim, 0, stream>>>(
            static_cast<T*>(out), p.part_out, p.part_max, p.part_sum, context_lens, n_heads, head_dim, partition_size,
            n_splits, static_cast<int>(max_keys));
        return cudaGetLastError();
    });
}

}  // namespace kernels::cuda
