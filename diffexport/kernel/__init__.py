"""Kernel: the DiffAttention op's eager references (`reference`), the fused kernel library's
binding (`kernels`), the torch op and its dispatch (`op`), and the child process that probes a
kernel path before it is trusted (`kernel_probe`). Nothing is imported here."""
