// Tensor parallelism's all-reduce and gather between CPU ranks of one host, through a file in
// /dev/shm that every rank maps: chapter 08's shm_channel.py, in C++. The same file layout, the same
// flags, the same sums in the same order, so the two take turns on one file and give the same bits;
// the Python one is the one to read. This one exists because a Python call costs ~10 µs where the
// protocol itself costs one, a step makes two per layer, and the one-call decoder layer
// (decoder_layer.h) calls this one directly between its o_proj and its MLP, without Python.
//
// The file: one 64-byte line per rank holding its flag (int64: the number of its last call), then
// two sets of one slot of `slot_bytes` per rank. Call n (= my flag + 1) writes set n % 2:
//     wait until every flag has reached n - 1    (everyone is done with call n - 2, which used it)
//     copy my part into my slot; flag = n
//     wait until the flags I read have reached n, read their slots
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>

namespace kernels::ops {

struct ShmChannel {
    // file: the whole mapped file as uint8 (the tensor keeps the mapping alive while this lives).
    ShmChannel(at::Tensor file, int64_t rank, int64_t world, int64_t slot_bytes, double timeout_s);

    bool fits(const at::Tensor& t) const;  // a contiguous CPU float32/bfloat16/float16 tensor a slot holds
    // t (float32, bfloat16 or float16, contiguous) replaced in place by the sum over the ranks, slot 0
    // first, in float32 for 16-bit types and rounded once (torch.sum over the slots); -> t
    at::Tensor all_reduce(at::Tensor t) const;
    // [..., cols] on every rank -> on rank 0 [..., world * cols], the ranks' parts side by side; t elsewhere
    at::Tensor gather_last_dim(const at::Tensor& t) const;

    // While a wait lasts (a rank is slow or gone): every millisecond `pause` (bindings.cpp: releases the
    // GIL for a moment, so the process's other Python threads run), every 0.1 s `check` (rank 0: raises
    // if a rank has exited). Past timeout_s the call fails.
    std::function<void()> pause, check;

   private:
    at::Tensor file_;
    uint8_t* base_;
    int64_t rank_, world_, slot_bytes_;
    double timeout_s_;

    int64_t* flag(int64_t r) const { return reinterpret_cast<int64_t*>(base_ + 64 * r); }
    uint8_t* slot(int64_t n, int64_t r) const { return base_ + 64 * world_ + ((n % 2) * world_ + r) * slot_bytes_; }
    int64_t write(const at::Tensor& t, bool copy) const;  // -> the call's number n, t in my slot of set n % 2 (copy)
    void wait(int64_t n, int64_t ranks) const;  // until the flags of ranks 0 .. ranks - 1 reach n
};

}  // namespace kernels::ops
