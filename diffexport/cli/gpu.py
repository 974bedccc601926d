"""`diffexport trt` (backends.tensorrt.build_engine_file) and `diffexport kernels`: their options and printing.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from diffexport.cli.common import Command, add_force
from diffexport.core.errors import DiffExportError  # light: no torch
from diffexport.core.lazy import lazy_import

kernel_probe = lazy_import("diffexport.kernel.kernel_probe")
kernels = lazy_import("diffexport.kernel.kernels")
tensorrt = lazy_import("diffexport.backends.tensorrt")


def _shape_pair(text: str, flag: str) -> tuple[int, int]:
    try:
        batch, seq = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise DiffExportError(f"{flag} {text!r}: write BATCHxSEQ, e.g. 1x128") from None
    return batch, seq


def cmd_trt(args) -> int:
    """Build a TensorRT engine from an exported ONNX file: DiffAttention plugin (fp16/bf16, --int8 logits) or native
    layers."""
    if args.int8 and args.logit_bits not in (None, 8):
        raise DiffExportError("--int8 means --logit-bits 8: pass one of them")
    bits = 8 if args.int8 else (args.logit_bits or 16)
    precision = "fp16" if args.fp16 else "bf16" if args.bf16 else "auto"
    module = {"auto": "auto", "tensorrt": "tensorrt", "tensorrt-rtx": "tensorrt_rtx"}[args.builder]
    options = tensorrt.EngineOptions(attention=args.attention, precision=precision, logit_bits=bits,
                                     smooth_k=not args.no_smooth_k, plugin_lib=args.plugin_lib, module=module,
                                     targets=tuple(args.targets), min_shape=_shape_pair(args.min, "--min"),
                                     opt_shape=_shape_pair(args.opt or "1x128", "--opt"),
                                     max_shape=_shape_pair(args.max or "4x2048", "--max"),
                                     timing_cache=args.timing_cache, save_onnx=args.save_onnx, opt_past=args.opt_past,
                                     force=args.force)
    result = tensorrt.build_engine_file(args.model, args.output, options, max_given=args.max is not None,
                                        opt_given=args.opt is not None, max_past=args.max_past)
    print("\n".join(result.summary() + [f"wrote         {args.output} (+ {Path(args.output).name}.json)"]))
    return 0


def cmd_kernels(args) -> int:
    """Where the fused CUDA kernel library is, what it was built for, and whether this machine can run it."""
    import torch

    if kernels.library_path() is None:  # informational: not built is a state, not a failure
        if args.check:
            raise DiffExportError(f"--check needs the kernel library, which is not built: {kernels.BUILD_HINT}")
        where = ", ".join(str(p) for p in kernels.library_candidates())
        print(f"library      not built (looked at {where})")
        print(f"build        {kernels.BUILD_HINT}")
        print(f"op on CUDA   the PyTorch reference (${kernels.IMPL_ENV}={kernels.impl_choice()}, no library)")
        return 0
    lib = kernels.load_library()  # a library that is there but unusable: one-line error, exit 2
    print(f"library      {kernels.library_path()}")
    print(f"build        {kernels.build_info()}")
    print(f"op on CUDA   ${kernels.IMPL_ENV}={kernels.impl_choice()}")
    if torch.cuda.is_available():
        cap = torch.cuda.get_device_capability()
        print(f"GPU          {torch.cuda.get_device_name()} (sm_{cap[0]}{cap[1]})")
    else:
        print("GPU          none visible to torch: the library loads, kernels cannot run here")
    del lib
    if not args.check:
        return 0
    if not torch.cuda.is_available():
        raise DiffExportError("--check needs a CUDA GPU visible to torch")
    return check_kernels()


def check_kernels() -> int:
    """Every kernel path this GPU and library have, each in a child process, against the torch reference."""
    failed = 0
    for name, check in kernel_probe.CHECKS.items():
        why_not = kernel_probe.applicable(name)
        if why_not:
            print(f"check {name:<11} skipped  {check.what}: {why_not}")
            continue
        reason, lines = kernel_probe.run_probe(name)
        failed += reason is not None
        summary = lines[-1].removeprefix("ok: ") if lines else "ran"
        verdict = f"ok       {summary}" if reason is None else f"FAILED   {reason}"
        print(f"check {name:<11} {verdict}  ({check.what})")
    print(f"result         {'PASS' if not failed else f'FAIL: {failed} kernel path(s)'}")
    return 1 if failed else 0


def _trt_arguments(p: argparse.ArgumentParser) -> None:
    add_force(p)
    p.add_argument("model", help="an .onnx file written by `diffexport onnx` (fp16/bf16 for the plugin), "
                                 "or a --kv-cache folder")
    p.add_argument("-o", "--output", default="model.engine", help="engine path (default model.engine)")
    precision = p.add_mutually_exclusive_group()
    precision.add_argument("--fp16", action="store_true",
                           help="the graph must already be fp16 (export it with `diffexport onnx --fp16`): "
                                "the network is strongly typed, TensorRT takes its types from the ONNX. Not "
                                "trtexec's --fp16, which lets TensorRT pick fp16 kernels for an fp32 graph")
    precision.add_argument("--bf16", action="store_true",
                           help="the graph must already be bf16 (`diffexport onnx --bf16`); see --fp16")
    p.add_argument("--int8", action="store_true",
                   help="INT8 attention logits in every DiffAttention (= --logit-bits 8)")
    p.add_argument("--logit-bits", type=int, choices=[8, 6, 4], help="low-bit attention logits (plugin only)")
    p.add_argument("--no-smooth-k", action="store_true", help="INT8 logits without K-smoothing")
    p.add_argument("--attention", default="plugin", choices=["plugin", "native", "function"],
                   help="plugin: our CUDA plugin (default); native: lowered to TensorRT's own layers; "
                        "function: the ONNX function body, inlined by the parser")
    p.add_argument("--plugin-lib", help="libdiffexport_plugins.so (default: $DIFFEXPORT_PLUGIN_LIB or build/)")
    p.add_argument("--min", default="1x1", help="profile minimum BATCHxSEQ (default 1x1)")
    p.add_argument("--opt", help="profile optimum BATCHxSEQ (default 1x128, at most --max)")
    p.add_argument("--max", help="profile maximum BATCHxSEQ (default 4x2048; KV-cache folders: "
                                 "4x(context/4, at most 512))")
    p.add_argument("--opt-past", type=int, default=128,
                   help="KV-cache graphs: past length the profile optimises for (default 128)")
    p.add_argument("--max-past", type=int,
                   help="KV-cache graphs: longest past (default: the folder's context length - 1, else 2048)")
    p.add_argument("--timing-cache", help="timing cache file: read if present, written after the build")
    p.add_argument("--save-onnx", help="also write the graph given to the parser (plugin fields stamped and "
                                       "no function body, or lowered): what trtexec/polygraphy need for "
                                       "the same engine on any TensorRT 10.1+")
    p.add_argument("--builder", default="auto", choices=["auto", "tensorrt", "tensorrt-rtx"],
                   help="which TensorRT (auto: tensorrt, else tensorrt-rtx)")
    p.add_argument("--targets", nargs="+", default=["SM80", "SM89"],
                   help="TensorRT-RTX ahead-of-time GPU targets (default SM80 SM89)")


def _kernels_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--check", action="store_true",
                   help="run every kernel path this GPU has (one-pass, INT8 logits, split-KV decode, Hopper fp and "
                        "INT8) "
                        "on small shapes, each in a child process, against the torch reference")


COMMANDS = [Command("trt", cmd_trt, _trt_arguments), Command("kernels", cmd_kernels, _kernels_arguments)]
