// The emulator's scheduler: a launch's blocks one after another, each block's CUDA threads as
// fibers on this host thread (include/emu.h says what it shows and what it cannot).
//
// A block runs in passes. In a pass every runnable thread runs until it must wait: at a barrier,
// at a warp exchange (shuffle or vote), or at its end. Between passes the scheduler releases
// what can be released: a warp exchange once every lane the mask names is at that same call,
// else the barrier once every thread of the block is at that same __syncthreads. When neither
// can be released and threads are still waiting, the launch can never finish: on a GPU it would
// hang or read garbage; here it stops with a message that says which threads wait where.
// Passes alternate between forward and reverse thread order, so a missing barrier shows whether
// the data flows from lower thread numbers to higher ones or the other way.
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include "include/emu.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/common_interface_defs.h>
#define EMU_ASAN 1
#else
#define EMU_ASAN 0
#endif

// --- fibers -----------------------------------------------------------------------------------------
// A fiber is a stack and a saved stack pointer. emu_switch saves the callee-saved registers of
// the running side on its own stack, stores its stack pointer, loads the other's and pops its
// registers: a context switch is a function call that returns on another stack. (glibc's
// swapcontext does the same plus a system call to save the signal mask, 10x slower; a launch
// switches millions of times.) A new fiber's stack is laid out as if emu_switch had saved it,
// with fiber_start as the return address.
#if defined(__x86_64__) && defined(__linux__)
extern "C" void emu_switch(void** save_sp, void* load_sp);
extern "C" void emu_fiber_start();
asm(R"(
    .text
    .globl emu_switch
    .type emu_switch, @function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size emu_switch, .-emu_switch

    .globl emu_fiber_start
    .type emu_fiber_start, @function
emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
    .size emu_fiber_start, .-emu_fiber_start
)");
#else
#include <ucontext.h>
#endif

namespace emu {

struct Thread {
    enum State { kRunnable, kBarrier, kExchange, kDone };
    dim3 idx;
    int linear = 0;
    State state = kRunnable;
    const char* file = nullptr;  // where it waits
    int line = 0;
    // the exchange it waits at
    int kind = 0, arg = 0, width = 32;
    unsigned mask = 0;
    uint32_t value = 0, result = 0;
    // its fiber
    uint8_t* stack = nullptr;
#if defined(__x86_64__) && defined(__linux__)
    void* sp = nullptr;
#else
    ucontext_t context;
#endif
};

Thread* current = nullptr;
dim3 block_idx, block_dim, grid_dim;
int sm_count = 132;

const dim3& thread_idx(const Thread* t) { return t->idx; }

namespace {

// Fiber stacks: reserved once, grown on demand, pages touched only as used (MAP_NORESERVE).
constexpr size_t kStackBytes = EMU_ASAN ? 512 * 1024 : 128 * 1024;
std::vector<uint8_t*> stacks;

uint8_t* stack_for(size_t i) {
    while (stacks.size() <= i) {
        void* p =
            mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (p == MAP_FAILED) throw std::runtime_error("emulator: no memory for a fiber stack");
        stacks.push_back(static_cast<uint8_t*>(p));
    }
    return stacks[i];
}

struct Block {
    std::vector<Thread> threads;
    void (*run)(void*) = nullptr;
    void* closure = nullptr;
#if defined(__x86_64__) && defined(__linux__)
    void* scheduler_sp = nullptr;
#else
    ucontext_t scheduler;
#endif
    // The scheduler's own stack, as the address sanitizer needs it when a fiber switches back.
    const void* main_bottom = nullptr;
    size_t main_size = 0;
    std::string error;  // a rule a thread broke, found on its own stack: the scheduler reports it
};
Block* running = nullptr;

std::vector<uint8_t> dynamic_smem;       // the launch's dynamic shared memory (reset to NaN bytes per block)
std::map<const void*, size_t> max_smem;  // per kernel, cudaFuncSetAttribute
cudaError_t pending = cudaSuccess;
std::string message;
int64_t blocks_run = 0;

// Switches from the scheduler into thread t until it waits or ends.
void resume(Thread& t) {
    current = &t;
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(&fake, t.stack, kStackBytes);
#endif
#if defined(__x86_64__) && defined(__linux__)
    emu_switch(&running->scheduler_sp, t.sp);
#else
    swapcontext(&running->scheduler, &t.context);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
    current = nullptr;
}

// Switches from the current thread back to the scheduler; returns when resumed (never, once done).
void yield_to_scheduler() {
    Thread& t = *current;
#if EMU_ASAN
    void* fake = nullptr;
    __sanitizer_start_switch_fiber(t.state == Thread::kDone ? nullptr : &fake, running->main_bottom,
                                   running->main_size);
#endif
#if defined(__x86_64__) && defined(__linux__)
    emu_switch(&t.sp, running->scheduler_sp);
#else
    swapcontext(&t.context, &running->scheduler);
#endif
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
#endif
}

void thread_main(Thread* t) {
#if EMU_ASAN
    __sanitizer_finish_switch_fiber(nullptr, &running->main_bottom, &running->main_size);
#endif
    running->run(running->closure);
    t->state = Thread::kDone;
    yield_to_scheduler();
}

void start_fiber(Thread& t) {
    t.stack = stack_for(static_cast<size_t>(t.linear));
#if defined(__x86_64__) && defined(__linux__)
    // Top of the stack, 16-byte aligned: after emu_switch pops the 8-byte control word slot, six
    // registers and the return address (64 bytes), emu_fiber_start calls with rsp % 16 == 0.
    auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(t.stack + kStackBytes) & ~uintptr_t{15}) - 64);
    top[0] = 0x1F80 | (uint64_t{0x037F} << 32);             // mxcsr, x87 control word: the defaults
    top[1] = 0;                                             // r15
    top[2] = 0;                                             // r14
    top[3] = reinterpret_cast<uint64_t>(&thread_main);      // r13: the function
    top[4] = reinterpret_cast<uint64_t>(&t);                // r12: its argument
    top[5] = 0;                                             // rbx
    top[6] = 0;                                             // rbp
    top[7] = reinterpret_cast<uint64_t>(&emu_fiber_start);  // where emu_switch returns to
    t.sp = top;
#else
    getcontext(&t.context);
    t.context.uc_stack.ss_sp = t.stack;
    t.context.uc_stack.ss_size = kStackBytes;
    t.context.uc_link = nullptr;
    makecontext(&t.context, reinterpret_cast<void (*)()>(&thread_main), 1, &t);  // a pointer fits one int on LP64 glibc
#endif
}

std::string where(const Thread& t) {
    switch (t.state) {
        case Thread::kBarrier: return "__syncthreads at " + std::string(t.file) + ":" + std::to_string(t.line);
        case Thread::kExchange: {
            static const char* names[] = {"__shfl_xor_sync", "__shfl_sync", "__shfl_down_sync", "__ballot_sync"};
            return std::string(names[t.kind]) + " at " + t.file + ":" + std::to_string(t.line);
        }
        case Thread::kDone: return "returned";
        default: return "running";
    }
}

std::string describe_block() {
    // Per warp, consecutive lanes that are at the same place: "warp 0: lanes 0-30 __shfl_xor_sync at f:12; lane 31
    // returned"
    std::string out;
    const auto& ts = running->threads;
    for (size_t w = 0; w * 32 < ts.size(); ++w) {
        out += "\n  warp " + std::to_string(w) + ":";
        size_t begin = w * 32, end = std::min(ts.size(), begin + 32);
        for (size_t i = begin; i < end;) {
            size_t j = i + 1;
            while (j < end && where(ts[j]) == where(ts[i])) ++j;
            out += (i == begin ? " " : "; ") + std::string(j - i == 1 ? "lane " : "lanes ") +
                   std::to_string(i - begin) + (j - i == 1 ? "" : "-" + std::to_string(j - 1 - begin)) + " " +
                   where(ts[i]);
            i = j;
        }
    }
    return out;
}

bool same_site(const Thread& a, const Thread& b) { return a.line == b.line && std::strcmp(a.file, b.file) == 0; }

[[noreturn]] void fail(const std::string& what) {
    throw std::runtime_error("block (" + std::to_string(block_idx.x) + "," + std::to_string(block_idx.y) + "," +
                             std::to_string(block_idx.z) + "): " + what + describe_block());
}

// Releases one warp exchange whose lanes have all arrived; false if none can be.
bool release_exchange() {
    auto& ts = running->threads;
    for (Thread& leader : ts) {
        if (leader.state != Thread::kExchange) continue;
        const size_t warp0 = static_cast<size_t>(leader.linear) / 32 * 32;
        bool ready = true;
        for (int lane = 0; lane < 32; ++lane) {
            if (!(leader.mask >> lane & 1u)) continue;
            if (warp0 + lane >= ts.size())
                fail(where(leader) + ": the mask names lane " + std::to_string(lane) +
                     ", which this block does not have");
            const Thread& t = ts[warp0 + lane];
            if (t.state != Thread::kExchange) {
                ready = false;
                break;
            }
            if (!same_site(t, leader) || t.kind != leader.kind || t.mask != leader.mask || t.width != leader.width) {
                fail("the lanes of one mask are at different warp exchanges");
            }
        }
        if (!ready) continue;
        for (int lane = 0; lane < 32; ++lane) {
            if (!(leader.mask >> lane & 1u)) continue;
            Thread& t = ts[warp0 + lane];
            const int segment = lane / t.width * t.width;  // width < 32: independent segments of lanes
            int src = lane;
            if (t.kind == 0) src = segment + ((lane - segment) ^ t.arg) % t.width;
            if (t.kind == 1) src = segment + t.arg % t.width;
            if (t.kind == 2) src = lane - segment + t.arg < t.width ? lane + t.arg : lane;
            if (t.kind == 3) {
                uint32_t ballot = 0;
                for (int l = 0; l < 32; ++l)
                    if ((leader.mask >> l & 1u) && ts[warp0 + l].value) ballot |= 1u << l;
                t.result = ballot;
            } else {
                if (!(leader.mask >> src & 1u))
                    fail(where(t) + ": lane " + std::to_string(lane) + " reads lane " + std::to_string(src) +
                         ", which the mask leaves out");
                t.result = ts[warp0 + src].value;
            }
        }
        for (int lane = 0; lane < 32; ++lane)
            if (leader.mask >> lane & 1u) ts[warp0 + lane].state = Thread::kRunnable;
        return true;
    }
    return false;
}

// Releases the block barrier when every thread is at the same __syncthreads; false if it cannot be.
bool release_barrier() {
    auto& ts = running->threads;
    const Thread* first = nullptr;
    int done = 0;
    for (const Thread& t : ts) {
        if (t.state == Thread::kDone) {
            ++done;
        } else if (t.state != Thread::kBarrier) {
            return false;
        } else if (first == nullptr) {
            first = &t;
        } else if (!same_site(t, *first)) {
            fail("threads wait at different __syncthreads");
        }
    }
    if (first == nullptr) return false;
    if (done > 0)
        fail("__syncthreads reached by " + std::to_string(ts.size() - done) + " of " + std::to_string(ts.size()) +
             " threads; the others had returned (a barrier in code that not every thread reaches)");
    for (Thread& t : ts) t.state = Thread::kRunnable;
    return true;
}

void run_block(Block& block, unsigned n) {
    block.threads.assign(n, Thread{});
    for (unsigned i = 0; i < n; ++i) {
        Thread& t = block.threads[i];
        t.linear = static_cast<int>(i);
        t.idx = dim3(i % block_dim.x, i / block_dim.x % block_dim.y, i / (block_dim.x * block_dim.y));
        start_fiber(t);
    }
    std::fill(dynamic_smem.begin(), dynamic_smem.end(), uint8_t{0xFF});  // NaN floats, -1 ints
    for (int pass = 0;; ++pass) {
        bool all_done = true;
        for (unsigned k = 0; k < n; ++k) {
            Thread& t = block.threads[pass % 2 == 0 ? k : n - 1 - k];
            if (t.state == Thread::kRunnable) resume(t);
            if (!block.error.empty()) fail(block.error);
        }
        for (const Thread& t : block.threads) all_done = all_done && t.state == Thread::kDone;
        if (all_done) return;
        if (release_exchange() || release_barrier()) continue;
        fail("no thread can go on: the launch would hang on a GPU");
    }
}

}  // namespace

// A rule broken inside a thread: its fiber ends here, and the scheduler stops the launch (an
// exception cannot cross from a fiber's stack to the scheduler's).
[[noreturn]] void fail_in_thread(const std::string& what) {
    running->error = what;
    current->state = Thread::kDone;
    yield_to_scheduler();
    std::abort();  // never resumed
}

void barrier(const char* file, int line) {
    Thread& t = *current;
    t.state = Thread::kBarrier;
    t.file = file;
    t.line = line;
    yield_to_scheduler();
}

uint32_t warp_exchange(int kind, unsigned mask, uint32_t value, int arg, int width, const char* file, int line) {
    Thread& t = *current;
    const int lane = t.linear % 32;
    if (!(mask >> lane & 1u)) {
        fail_in_thread("lane " + std::to_string(lane) + " calls a warp exchange at " + file + ":" +
                       std::to_string(line) + " with a mask that leaves it out");
    }
    if (width <= 0 || width > 32 || (width & (width - 1)) != 0)
        fail_in_thread("a warp exchange's width must be 1, 2, 4, ..., 32");
    t.state = Thread::kExchange;
    t.kind = kind;
    t.mask = mask;
    t.value = value;
    t.arg = arg;
    t.width = width;
    t.file = file;
    t.line = line;
    yield_to_scheduler();
    return t.result;
}

uint8_t* dynamic_shared(size_t) { return dynamic_smem.data(); }

cudaError_t set_max_dynamic_shared(const void* kernel, int bytes) {
    if (bytes < 0 || bytes > 227 * 1024) return cudaErrorInvalidValue;  // sm_90's most per block
    max_smem[kernel] = static_cast<size_t>(bytes);
    return cudaSuccess;
}

size_t max_dynamic_shared(const void* kernel) {
    const auto it = max_smem.find(kernel);
    return it == max_smem.end() ? 48 * 1024 : it->second;
}

cudaError_t launch_blocks(dim3 grid, dim3 block, size_t smem, void (*run)(void*), void* closure) {
    const uint64_t n = uint64_t{block.x} * block.y * block.z;
    if (n == 0 || n > 1024 || grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.y > 65535 || grid.z > 65535) {
        pending = cudaErrorInvalidValue;  // what the GPU's launch refuses
        message = "invalid launch configuration";
        return pending;
    }
    Block b;
    b.run = run;
    b.closure = closure;
    running = &b;
    grid_dim = grid;
    block_dim = block;
    dynamic_smem.assign(smem, 0xFF);
    try {
        for (unsigned z = 0; z < grid.z; ++z)
            for (unsigned y = 0; y < grid.y; ++y)
                for (unsigned x = 0; x < grid.x; ++x) {
                    block_idx = dim3(x, y, z);
                    run_block(b, static_cast<unsigned>(n));
                    ++blocks_run;
                }
    } catch (const std::runtime_error& e) {
        // The block's fibers are abandoned where they wait: nothing on their stacks needs unwinding.
        running = nullptr;
        pending = cudaErrorLaunchFailure;
        message = e.what();
        return pending;
    }
    running = nullptr;
    return cudaSuccess;
}

cudaError_t refuse(const char* why) {
    pending = cudaErrorInvalidValue;
    message = why;
    return pending;
}

cudaError_t take_error() {
    const cudaError_t e = pending;
    pending = cudaSuccess;
    return e;
}

}  // namespace emu

extern "C" {
const char* emu_last_message() { return emu::message.c_str(); }
int64_t emu_blocks_run() { return emu::blocks_run; }
void emu_set_sm_count(int n) { emu::sm_count = n; }
}
