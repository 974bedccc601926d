// A block's CUDA threads as cooperative fibers on the launching OS thread, switched at the barriers
// (bar.sync and the warp collectives, cuda_emulation.h's Barrier). Why: with one std::thread per CUDA
// thread, every barrier woke 32-256 OS threads through the kernel's scheduler, and on a 2-core CI
// machine the emulated tests spent as much CPU time in the kernel (futex, context switches) as in
// the kernels' arithmetic. A fiber switch here is a few instructions in user space.
//
// Sequential, so without races of its own: the sanitizer builds (ThreadSanitizer, whose question
// is the races between CUDA threads, and AddressSanitizer, which would need its stack-switch hooks)
// keep an OS thread per CUDA thread (DIFFX_EMU_FIBERS is 0 there). A barrier that not all of its
// threads reach, which hangs a GPU, aborts here with one line.
//
// The switch: a few lines of assembly on x86-64 and AArch64 ELF (the callee-saved registers and the
// stack pointer, as boost.context's fcontext does); elsewhere, or with
// -DDIFFX_EMU_FIBER_UCONTEXT=1, POSIX swapcontext (a signal-mask system call per switch). The x86-64
// and swapcontext switches run in the tests; the AArch64 one was only compiled and linked (fibers_check.cpp
// with `zig c++ -target aarch64-linux-gnu`, 2026-11-30): no AArch64 machine has run it yet.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <sys/mman.h>

#if !defined(DIFFX_EMU_FIBER_UCONTEXT)
#if defined(__ELF__) && (defined(__x86_64__) || defined(__aarch64__))
#define DIFFX_EMU_FIBER_UCONTEXT 0
#else
#define DIFFX_EMU_FIBER_UCONTEXT 1
#endif
#endif

#if DIFFX_EMU_FIBER_UCONTEXT
#include <ucontext.h>
#else
// diffx_emu_fiber_switch(&from_sp, to_sp): pushes the callee-saved registers on the running stack,
// stores its pointer in from_sp, loads to_sp and pops the registers saved there. Weak: every
// translation unit that includes this header defines the same bytes.
extern "C" void diffx_emu_fiber_switch(void** from_sp, void* to_sp);
#if defined(__x86_64__)
asm(R"(
  .pushsection .text.diffx_emu_fiber_switch,"ax",@progbits
  .weak diffx_emu_fiber_switch
  .hidden diffx_emu_fiber_switch
  .type diffx_emu_fiber_switch, @function
diffx_emu_fiber_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size diffx_emu_fiber_switch, .-diffx_emu_fiber_switch
  .popsection
)");
#else  // AArch64: x19-x29, the link register x30 and d8-d15
asm(R"(
  .pushsection .text.diffx_emu_fiber_switch,"ax",@progbits
  .weak diffx_emu_fiber_switch
  .hidden diffx_emu_fiber_switch
  .type diffx_emu_fiber_switch, %function
diffx_emu_fiber_switch:
  sub sp, sp, #160
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x9, sp
  str x9, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #160
  ret
  .size diffx_emu_fiber_switch, .-diffx_emu_fiber_switch
  .popsection
)");
#endif
#endif

namespace diffx_emu {

class Fibers;

struct Fiber {
  Fibers* group = nullptr;
  int index = 0;
  void* user = nullptr;  // the CUDA thread's context (cuda_emulation.h reads it through t_fiber)
  bool runnable = false, finished = false;
  char* stack = nullptr;  // lowest usable byte (a guard page below it)
#if DIFFX_EMU_FIBER_UCONTEXT
  ucontext_t context;
#else
  void* sp = nullptr;
#endif
};

inline thread_local Fiber* t_fiber = nullptr;  // the running fiber; null on the scheduling thread

// `count` fibers with a stack each, run again and again: run() starts each at fn(arg, index) and
// returns when every one has returned.
class Fibers {
 public:
  static constexpr size_t kStackBytes = 256 << 10;  // the emulated mma's operand tiles are 3 KB

  explicit Fibers(int count) : fibers_(count) {
    const size_t page = 4096, each = kStackBytes + page;
    region_bytes_ = each * size_t(count);
    void* region = mmap(nullptr, region_bytes_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
                        -1, 0);
    if (region == MAP_FAILED) fail("cannot map the emulated threads' stacks");
    region_ = static_cast<char*>(region);
    for (int i = 0; i < count; ++i) {
      char* guard = region_ + each * size_t(i);
      mprotect(guard, page, PROT_NONE);  // a stack that overflows faults here instead of writing into its neighbour
      fibers_[i].group = this;
      fibers_[i].index = i;
      fibers_[i].stack = guard + page;
    }
  }
  ~Fibers() { munmap(region_, region_bytes_); }
  Fibers(const Fibers&) = delete;
  Fibers& operator=(const Fibers&) = delete;

  // The next fiber to run is always the lowest-numbered runnable one (the highest with `descending`):
  // the first warp runs as far ahead of the others as the barriers let it, the last one lags as far
  // behind, so that a read or a refill that a missing barrier leaves unordered happens on the wrong
  // side of the write it races with, in one order or in the other.
  template <typename Fn>
  void run(void* const* users, Fn& fn, bool descending) {
    fn_ = &fn;
    call_ = [](void* f, int index) { (*static_cast<Fn*>(f))(index); };
    for (Fiber& f : fibers_) start(f, users[f.index]);
    const int count = int(fibers_.size());
    for (int unfinished = count; unfinished != 0;) {
      Fiber* next = nullptr;
      for (int i = 0; i < count && next == nullptr; ++i) {
        Fiber& f = fibers_[descending ? count - 1 - i : i];
        if (f.runnable && !f.finished) next = &f;
      }
      if (next == nullptr)
        fail("every unfinished thread of the block waits at a barrier that the others do not reach (a GPU hangs)");
      resume(*next);
      if (next->finished) --unfinished;
    }
  }

  // The running fiber waits: back to the scheduler until a barrier's last thread marks it runnable.
  static void block_current() {
    Fiber* self = t_fiber;
    self->runnable = false;
    self->group->to_scheduler(*self);
  }

 private:
  [[noreturn]] static void fail(const char* what) {
    std::fprintf(stderr, "diffexport emulator: %s\n", what);
    std::abort();
  }

  [[noreturn]] static void trampoline() {
    Fiber* self = t_fiber;
    self->group->call_(self->group->fn_, self->index);
    self->finished = true;
    self->group->to_scheduler(*self);
    __builtin_unreachable();
  }

  void start(Fiber& f, void* user) {
    f.user = user;
    f.runnable = true;
    f.finished = false;
#if DIFFX_EMU_FIBER_UCONTEXT
    getcontext(&f.context);
    f.context.uc_stack.ss_sp = f.stack;
    f.context.uc_stack.ss_size = kStackBytes;
    f.context.uc_link = nullptr;
    makecontext(&f.context, reinterpret_cast<void (*)()>(&Fibers::trampoline), 0);
#else
    // The frame diffx_emu_fiber_switch pops: zeroed saved registers, then the trampoline as the
    // return address, with the stack aligned as a call would leave it (16 bytes, less the return slot).
    auto* top = reinterpret_cast<uintptr_t*>(f.stack + kStackBytes);
#if defined(__x86_64__)
    uintptr_t* sp = top - 2 - 6;  // 6 registers, the return address, an empty slot above (alignment)
    for (int r = 0; r < 6; ++r) sp[r] = 0;
    sp[6] = reinterpret_cast<uintptr_t>(&Fibers::trampoline);
    sp[7] = 0;
#else
    uintptr_t* sp = top - 20;  // 160 bytes: x19-x28, x29, x30 (the return address), d8-d15
    for (int r = 0; r < 20; ++r) sp[r] = 0;
    sp[11] = reinterpret_cast<uintptr_t>(&Fibers::trampoline);
#endif
    f.sp = sp;
#endif
  }

  void resume(Fiber& f) {
    t_fiber = &f;
#if DIFFX_EMU_FIBER_UCONTEXT
    swapcontext(&scheduler_, &f.context);
#else
    diffx_emu_fiber_switch(&scheduler_sp_, f.sp);
#endif
    t_fiber = nullptr;
  }

  void to_scheduler(Fiber& self) {
#if DIFFX_EMU_FIBER_UCONTEXT
    swapcontext(&self.context, &scheduler_);
#else
    diffx_emu_fiber_switch(&self.sp, scheduler_sp_);
#endif
  }

  std::vector<Fiber> fibers_;
  char* region_ = nullptr;
  size_t region_bytes_ = 0;
  void* fn_ = nullptr;
  void (*call_)(void*, int) = nullptr;
#if DIFFX_EMU_FIBER_UCONTEXT
  ucontext_t scheduler_;
#else
  void* scheduler_sp_ = nullptr;
#endif
};

// A barrier of `threads` fibers: each waits until the last arrives, which wakes them and runs on.
class FiberBarrier {
 public:
  explicit FiberBarrier(int threads) : threads_(threads) { waiting_.reserve(size_t(threads)); }
  void arrive_and_wait() {
    if (++arrived_ == threads_) {
      arrived_ = 0;
      for (Fiber* f : waiting_) f->runnable = true;
      waiting_.clear();
      return;
    }
    waiting_.push_back(t_fiber);
    Fibers::block_current();
  }

 private:
  const int threads_;
  int arrived_ = 0;
  std::vector<Fiber*> waiting_;
};

}  // namespace diffx_emu
