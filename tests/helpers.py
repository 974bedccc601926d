"""Random DiffAttention inputs in the contract layout, and the dtype-aware comparison rules."""

import torch

from diffexport.core.contract import DiffAttentionAttrs
from diffexport.kernel import reference


def make_inputs(attrs: DiffAttentionAttrs, batch, q_len, kv_len, *, dtype=torch.float32, rng=None,
                norm_weight=True):
    """Fresh non-zero random inputs; lambda in a realistic range (V1 ~0.2-0.8, V2 in (0,1))."""
    def randn(*shape):
        return torch.randn(*shape, generator=rng).to(dtype)

    H, D = attrs.num_heads, attrs.head_dim
    query = randn(batch, q_len, 2 * H * D)
    key = randn(batch, kv_len, attrs.key_width)
    value = randn(batch, kv_len, attrs.num_kv_heads * attrs.value_dim)
    if attrs.variant == 1:
        lam = (0.2 + 0.6 * torch.rand(1, generator=rng)).to(dtype)
    else:
        lam = torch.sigmoid(torch.randn(batch, q_len, H, generator=rng)).to(dtype)
    # norm_weight is float32 whatever the activation dtype (the contract's choice: the norm runs in fp32);
    # norm_weight=False gives the all-ones weight of a model that has none
    weight = 1 + 0.5 * torch.randn(attrs.value_dim, generator=rng) if norm_weight else torch.ones(attrs.value_dim)
    return query, key, value, lam, weight


def assert_close_fp32(out, ref, what=""):
    out64, ref64 = out.double(), torch.as_tensor(ref, dtype=torch.float64)
    assert torch.isfinite(out64).all(), f"{what}: non-finite output"
    scale = max(1.0, ref64.abs().max().item())
    err = (out64 - ref64).abs().max().item()
    assert err <= 1e-5 * scale, f"{what}: max abs {err:.3e} > {1e-5 * scale:.3e}"


def assert_close_lowprec(out, baseline, ref, what="", atol=1e-3, min_cosine=0.9999):
    """flash-attention's rule: |out - ref| <= 2*|baseline - ref| + atol, plus a cosine floor."""
    out64, base64, ref64 = out.double(), baseline.double(), torch.as_tensor(ref, dtype=torch.float64)
    assert torch.isfinite(out64).all(), f"{what}: non-finite output"
    err = (out64 - ref64).abs().max().item()
    base_err = (base64 - ref64).abs().max().item()
    cos = torch.nn.functional.cosine_similarity(out64.flatten(), ref64.flatten(), dim=0).item()
    assert err <= 2 * base_err + atol, f"{what}: max abs {err:.3e} > 2*{base_err:.3e} + {atol}"
    assert cos >= min_cosine, f"{what}: cosine {cos:.6f} < {min_cosine}"


def lowprec_baseline(query, key, value, lam, weight, attrs, key_mask=None):
    """Plain PyTorch in the low-precision dtype throughout (no upcast): the error yardstick."""
    q1, q2, k1, k2, v = reference.split_maps(query, key, value, attrs)
    rep = attrs.num_heads // attrs.num_kv_heads
    k1, k2, v = (t.repeat_interleave(rep, dim=1) for t in (k1, k2, v))
    mask = reference.visible_mask(q1.shape[2], k1.shape[2], bool(attrs.causal), key_mask, q1.device)

    def amap(q, k):
        s = (q @ k.transpose(-1, -2)) * attrs.effective_scale
        if mask is not None:
            s = s.masked_fill(~mask, float("-inf"))
        return reference.zero_unseen_rows(s.softmax(-1), mask)

    lam4 = lam.reshape(1, 1, 1, 1) if attrs.variant == 1 else lam.permute(0, 2, 1).unsqueeze(-1)
    o = (amap(q1, k1) - lam4 * amap(q2, k2)) @ v
    if attrs.norm:
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + attrs.norm_eps)
    if weight is not None:
        o = o * weight.to(o.dtype)
    o = o * attrs.output_scale
    B, H, S, Dv = o.shape
    return o.transpose(1, 2).reshape(B, S, H * Dv)


# ------------------------------------------------------------------ command line and onnxruntime

def checkout_env() -> dict:
    """This process's environment with the checkout first on PYTHONPATH, so that a child process
    (`-m diffexport` from another folder, a tools/ script) imports this checkout's package even where
    it is not installed, as on the GPU machine."""
    import os
    from pathlib import Path

    root = str(Path(__file__).resolve().parent.parent)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    return env


def run_cli(*args, cwd=None, stdin: str | bytes | None = None):
    """`python -m diffexport ARGS` in a subprocess, as a user runs it (stdin: text or bytes piped in)."""
    import subprocess
    import sys

    if isinstance(stdin, str):
        stdin = stdin.encode()
    out = subprocess.run([sys.executable, "-m", "diffexport", *map(str, args)], capture_output=True,
                         env=checkout_env(), cwd=cwd, timeout=300, input=stdin,
                         stdin=None if stdin is not None else subprocess.DEVNULL)
    return subprocess.CompletedProcess(out.args, out.returncode, out.stdout.decode(errors="replace"),
                                       out.stderr.decode(errors="replace"))


def run_printed_polygraphy(report_text: str):
    """The `polygraphy run ...` command a check printed (its line, or the command itself), run as a
    user would, with this interpreter's scripts first on PATH; asserts that it passes."""
    import os
    import re
    import shlex
    import subprocess
    import sys

    found = re.search(r"^(?:polygraphy {4})?(polygraphy run .*)$", report_text, re.M)
    assert found, f"no polygraphy command printed:\n{report_text[-2000:]}"
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    result = subprocess.run(shlex.split(found.group(1)), capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0 and "PASSED" in result.stdout + result.stderr, (
        found.group(1) + "\n" + result.stdout[-3000:] + result.stderr[-3000:])
    return result


def cli_main(*args, cwd=None, stdin: str | bytes | None = None):
    """`diffexport ARGS` run in this process through cli.main: what run_cli gives, without starting
    an interpreter that imports torch again. The exit status is main's return or SystemExit's code
    (argparse); stdout and stderr are captured at the file descriptors, so what a C library prints
    counts as it would in a child; stdin is the bytes given, else empty. Warnings show as in a fresh
    interpreter (its default filters, printed to stderr), and the environment, working directory and
    SIGTERM and SIGINT handlers are restored afterwards. For what needs a process of its own (signals, resource
    limits, broken pipes, which modules an entry point imports) use run_cli."""
    import contextlib
    import io
    import os
    import signal
    import subprocess
    import sys
    import tempfile
    import warnings

    from diffexport import cli

    argv = [str(a) for a in args]
    if isinstance(stdin, str):
        stdin = stdin.encode()
    saved_env, saved_cwd = dict(os.environ), os.getcwd()
    saved_sigterm, saved_sigint = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(tempfile.TemporaryFile()) for _ in range(3)]
        files[0].write(stdin or b"")
        files[0].seek(0)
        for stream in saved_streams[1:]:
            stream.flush()
        saved_fds = [os.dup(fd) for fd in (0, 1, 2)]
        for fd, file in enumerate(files):
            os.dup2(file.fileno(), fd)
        # the child's streams: pipes, so block-buffered stdout, strict text, backslashes for bad bytes on stderr
        sys.stdin = io.TextIOWrapper(open(os.dup(0), "rb"), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(open(os.dup(1), "wb"), encoding="utf-8")
        sys.stderr = io.TextIOWrapper(open(os.dup(2), "wb"), encoding="utf-8", errors="backslashreplace",
                                      line_buffering=True)
        try:
            if cwd is not None:
                os.chdir(cwd)
            with warnings.catch_warnings():
                warnings.resetwarnings()
                for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                    warnings.simplefilter("ignore", category)
                warnings.showwarning = lambda message, category, filename, lineno, file=None, line=None: \
                    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))
                try:
                    code = cli.main(argv)
                except SystemExit as exc:  # argparse, or a command that exits
                    code = exc.code
                if code is None:
                    code = 0
                elif not isinstance(code, int):  # the interpreter prints a non-integer exit code, status 1
                    print(code, file=sys.stderr)
                    code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.flush()
            for stream in (sys.stdin, sys.stdout, sys.stderr):
                with contextlib.suppress(Exception):
                    stream.close()
            for fd, saved in enumerate(saved_fds):
                os.dup2(saved, fd)
                os.close(saved)
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            os.chdir(saved_cwd)
            os.environ.clear()
            os.environ.update(saved_env)
            signal.signal(signal.SIGTERM, saved_sigterm)
            signal.signal(signal.SIGINT, saved_sigint)
        out, err = files[1], files[2]
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    return subprocess.CompletedProcess(["diffexport", *argv], code, stdout, stderr)


def assert_one_line_error(result, pattern):
    """Exit 2, and stderr is exactly one line `error: ...` containing `pattern`."""
    assert result.returncode == 2, result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr
    assert pattern in lines[0], lines[0]


def ort_logits(model, ids):
    """First output of an in-memory ONNX model on the CPU provider."""
    import onnxruntime as ort

    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {"input_ids": ids})[0]


def assert_same_logits(before, after, shapes, seed, vocab=512):
    """Two ONNX models agree in fp32 (1e-5 of max(1, |logits|)) on seeded token ids of each shape."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for shape in shapes:
        ids = rng.integers(0, vocab, size=shape, dtype=np.int64)
        a, b = ort_logits(before, ids), ort_logits(after, ids)
        assert np.abs(a - b).max() <= 1e-5 * max(1.0, np.abs(a).max())


def host_library(tmp_path_factory, env_var: str, built, name: str, sources, flags=()):
    """A small host-compiled library the tests call through ctypes: $env_var, else the CMake build,
    else compiled here with the C++ compiler (skipped when there is none; our sources failing to
    compile fails the test, where a skip would hide a broken kernel build)."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import pytest

    path = Path(os.environ.get(env_var, built))
    if path.is_file():
        return path
    compiler = shutil.which(os.environ.get("CXX", "c++"))
    if compiler is None:
        pytest.skip(f"no C++ compiler to build {name}")
    path = tmp_path_factory.mktemp(name) / f"lib{name}.so"
    result = subprocess.run([compiler, "-O2", "-fPIC", "-shared", *flags, *map(str, sources), "-o", str(path)],
                            capture_output=True, text=True)
    if result.returncode != 0:
        pytest.fail(f"cannot build {name}: " + "\n".join(result.stderr.strip().splitlines()[-20:]))
    return path


def resave_checkpoint(path, tmp_path, edit):
    """The checkpoint at `path` loaded, changed by edit(obj) in place, saved as tmp_path/edited.pt."""
    obj = torch.load(path, weights_only=True)
    edit(obj)
    out = tmp_path / "edited.pt"
    torch.save(obj, out)
    return out


def quiet(_line):
    """A log callback that drops the line (exports and checks under test)."""


def perturb_norm_weights(model, seed):
    """Norm weights that are not all ones (in place), so a graph that loses one shows it."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return model


def padding_mask(batch: int, kv_len: int, pads: list) -> torch.Tensor:
    """[B, Skv] int64 key mask. Per row: an int n, the first n keys are padding (a left-padded
    batch); a pair (a, b), keys a..b-1 are (a right-padded prompt's padding before its answer,
    as onnxruntime-genai pads a batch); a triple (a, b, s), keys a, a + s, ... before b (holes
    scattered through every key tile, so that each key's place in a tile is tested both ways)."""
    mask = torch.ones(batch, kv_len, dtype=torch.int64)
    for row, pad in enumerate(pads):
        start, stop, step = (0, pad, 1) if isinstance(pad, int) else (*pad, 1)[:3]
        mask[row, start:stop:step] = 0
    return mask


def byte_bpe_tokenizer(folder):
    """A byte-level BPE tokenizer trained here (no download), saved as an HF tokenizer folder."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the cat sat on the mat", "differential attention cancels noise"] * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(folder)
    return fast


def process_ends(pid: int, polls: int = 600) -> bool:
    """Whether process `pid` ends (gone, or a zombie) within `polls` looks 0.05 s apart (Linux /proc)."""
    import time

    for _ in range(polls):
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False
