#include "shm_channel.h"

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <sched.h>

#include <algorithm>
#include <chrono>
#include <cstring>

namespace kernels::ops {
namespace {

// x86 keeps stores in order, but the compiler need not: acquire/release say what the protocol
// means (and are the fences an ARM host needs).
int64_t load_flag(const int64_t* f) { return __atomic_load_n(f, __ATOMIC_ACQUIRE); }
void store_flag(int64_t* f, int64_t v) { __atomic_store_n(f, v, __ATOMIC_RELEASE); }

template <typename T>
void sum_slots(T* out, const uint8_t* const* slots, int64_t world, int64_t n) {
    constexpr int64_t kChunk = 256;  // a float accumulator per element of a chunk: loops the compiler vectorizes
    float acc[kChunk];
    for (int64_t start = 0; start < n; start += kChunk) {
        const int64_t len = std::min(kChunk, n - start);
        const T* first = reinterpret_cast<const T*>(slots[0]) + start;
        for (int64_t i = 0; i < len; ++i) acc[i] = static_cast<float>(first[i]);
        for (int64_t r = 1; r < world; ++r) {  // slot 0 + slot 1 + ...: the order of torch.sum over the slots
            const T* part = reinterpret_cast<const T*>(slots[r]) + start;
            for (int64_t i = 0; i < len; ++i) acc[i] += static_cast<float>(part[i]);
        }
        for (int64_t i = 0; i < len; ++i) out[start + i] = static_cast<T>(acc[i]);  // 16-bit: rounded once, to nearest even
    }
}

}  // namespace

ShmChannel::ShmChannel(at::Tensor file, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s)
    : file_(std::move(file)), rank_(rank), world_(world), slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
    TORCH_CHECK(file_.is_cpu() && file_.scalar_type() == at::kByte && file_.dim() == 1 && file_.is_contiguous(),
                "ShmChannel: file must be the mapped file as a contiguous CPU uint8 tensor");
    TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "ShmChannel: rank ", rank, " of ", world, " ranks");
    TORCH_CHECK(slot_bytes > 0 && slot_bytes % 64 == 0, "ShmChannel: slot_bytes must be a positive multiple of 64");
    TORCH_CHECK(file_.numel() >= 64 * world + 2 * world * slot_bytes, "ShmChannel: a file of ", file_.numel(),
                " bytes holds no flags and two sets of ", world, " slots of ", slot_bytes, " bytes");
    TORCH_CHECK(timeout_s > 0, "ShmChannel: timeout_s must be positive");
    base_ = file_.data_ptr<uint8_t>();
    TORCH_CHECK(reinterpret_cast<uintptr_t>(base_) % 64 == 0, "ShmChannel: the file must be mapped at a line boundary");
}

bool ShmChannel::fits(const at::Tensor& t) const {
    const auto dtype = t.scalar_type();
    return t.is_cpu() && t.is_contiguous() && int64_t(t.nbytes()) <= slot_bytes_ &&
           (dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kHalf);
}

void ShmChannel::wait(int64_t n, int64_t ranks) const {
    auto arrived = [&] {
        for (int64_t r = 0; r < ranks; ++r)
            if (load_flag(flag(r)) < n) return false;
        return true;
    };
    if (arrived()) return;
    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto paused = start, checked = start;
    for (int64_t looks = 1; !arrived(); ++looks) {
        if (looks % 64) {  // the other ranks come within microseconds in a step: look again soon
            sched_yield();
            continue;
        }
        const auto now = clock::now();
        const double waited = std::chrono::duration<double>(now - start).count();
        TORCH_CHECK(waited <= timeout_s_, "shared memory: a rank did not arrive in ", timeout_s_, " s");
        if (check && now - checked > std::chrono::milliseconds(100)) {
            checked = now;
            check();
        }
        if (pause && now - paused > std::chrono::milliseconds(1)) {
            paused = now;
            pause();
        }
    }
}

int64_t ShmChannel::write(const at::Tensor& t, bool copy) const {
    TORCH_CHECK(fits(t), "ShmChannel: a contiguous CPU tensor of float32, bfloat16 or float16 of at most ",
                slot_bytes_, " bytes, not ", t.scalar_type(), ", ", t.nbytes(), " bytes on ", t.device(),
                t.is_contiguous() ? "" : ", strided");
    const int64_t n = load_flag(flag(rank_)) + 1;
    wait(n - 1, world_);
    if (copy) std::memcpy(slot(n, rank_), t.data_ptr(), t.nbytes());
    store_flag(flag(rank_), n);
    return n;
}

at::Tensor ShmChannel::all_reduce(at::Tensor t) const {
    const auto dtype = t.scalar_type();
    const int64_t n = write(t, /*copy=*/true);
    wait(n, world_);
    std::vector<const uint8_t*> slots(world_);
    for (int64_t r = 0; r < world_; ++r) slots[r] = slot(n, r);
    if (dtype == at::kFloat)
        sum_slots(t.data_ptr<float>(), slots.data(), world_, t.numel());
    else if (dtype == at::kBFloat16)
        sum_slots(t.data_ptr<at::BFloat16>(), slots.data(), world_, t.numel());
    else
        sum_slots(t.data_ptr<at::Half>(), slots.data(), world_, t.numel());
    return t;
}

at::Tensor ShmChannel::gather_last_dim(const at::Tensor& t) const {
    TORCH_CHECK(t.dim() >= 1, "ShmChannel.gather_last_dim: a tensor with a last dimension");
    const int64_t n = write(t, /*copy=*/rank_ != 0);  // nobody reads rank 0's slot: its part goes straight to out
    if (rank_ != 0) return t;
    wait(n, world_);
    auto shape = t.sizes().vec();
    const int64_t cols = shape.back(), rows = cols ? t.numel() / cols : 0;
    shape.back() = world_ * cols;
    at::Tensor out = at::empty(shape, t.options());
    const int64_t row_bytes = cols * t.element_size();
    auto* dst = static_cast<uint8_t*>(out.data_ptr());
    for (int64_t i = 0; i < rows; ++i)
        for (int64_t r = 0; r < world_; ++r) {
            const uint8_t* part = r == 0 ? static_cast<const uint8_t*>(t.data_ptr()) : slot(n, r);
            std::memcpy(dst + (i * world_ + r) * row_bytes, part + i * row_bytes, row_bytes);
        }
    return out;
}

}  // namespace kernels::ops
