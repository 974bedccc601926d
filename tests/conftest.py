import hashlib
import os
import sys
import zlib
from pathlib import Path

import pytest


def _cores_of_this_worker() -> None:
    """Under pytest-xdist (`-n N`), each worker runs on cores of its own, before torch is imported:
    torch's, onnxruntime's and the compilers' threads of one worker's test then never crowd the
    other's (two processes each spinning two threads on two cores made a 35 s test take 300 s).
    Code that sizes its thread pools from this process's CPUs (diffexport's machine_threads, torch's
    OpenMP) sees the worker's share."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or not hasattr(os, "sched_setaffinity"):
        return
    cpus, workers, index = sorted(os.sched_getaffinity(0)), int(count), int(worker[2:])
    if 2 <= workers <= len(cpus):
        share = len(cpus) // workers
        os.sched_setaffinity(0, cpus[index * share:(index + 1) * share])


_cores_of_this_worker()
import torch  # noqa: E402 (after the worker's cores are set: its thread pool is sized from them)

sys.path.insert(0, os.path.dirname(__file__))  # tests/oracle.py


# The files whose tests take longest in all (seconds on a 2-core machine under `-n auto`, 2026-11-30,
# `--durations=0` summed per file), run first. Under `--dist loadfile` pytest-xdist hands whole files
# to its workers in the order it holds them, by default the files with the most tests first. That
# left the sanitizer runs (2 tests, 217 s), the quickstart and the wheel for last, where one worker
# ran them while the other idled: 1004 s of wall time for 1718 s of tests on two workers.
LONG_FILES_FIRST = {
    "test_kernel_sanitized.py": 228, "test_fusion.py": 149, "test_kernel_build.py": 116,
    "test_kernel_emulated.py": 106, "test_hostile_inputs.py": 69, "test_needles.py": 60, "test_wheel.py": 59,
    "test_decoder_export.py": 59, "test_export_errors.py": 50, "test_readme_quickstart.py": 48,
    "test_gpu_campaign_budget.py": 46, "test_beam_search.py": 44, "test_triton.py": 44, "test_docs.py": 43,
    "test_checkpoint.py": 40, "test_qdq.py": 38, "test_export.py": 37, "test_decoder_check.py": 35,
}


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist: keep the order below
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    # (a stable sort: each file's tests keep their order)
    items.sort(key=lambda item: -LONG_FILES_FIRST.get(item.path.name, 0))


@pytest.fixture
def rng():
    """A fresh generator per test, seeded from the test's name: different inputs per test, reproducible."""
    return torch.Generator().manual_seed(zlib.crc32(os.environ.get("PYTEST_CURRENT_TEST", "").encode()))


# ------------------------------------------------------------------ artifacts shared by the session

# Model recipes the test files share: name -> (preset, config overrides, seed). Each model's norm
# weights are perturbed (seeded) so that a graph that loses one shows it.
RECIPES = {
    # V1 with 4 diff-heads on 2 kv-groups, head dim 16: GQA and a head norm the kernels' layouts see
    "diff-v1-gqa": ("diff-v1-tiny", dict(n_heads=4, n_kv_heads=2, head_dim=16), 21),
    "diff-v1": ("diff-v1-tiny", {}, 1),
    "diff-v2": ("diff-v2-tiny", {}, 61),
    "transformer": ("transformer-tiny", {}, 62),
}


def _digest(path: Path) -> str:
    """Names and contents of every file under path (links as their targets' names, never followed)."""
    h = hashlib.sha256()
    for item in sorted([path] if path.is_file() else path.rglob("*")):
        h.update(str(item.relative_to(path.parent)).encode() + b"\0")
        if item.is_symlink():
            h.update(b"link:" + os.readlink(item).encode())
        elif item.is_file():
            h.update(_without_check_results(item))
    return h.hexdigest()


def _without_check_results(item: Path) -> bytes:
    """A file's bytes; for a model card of ours, without its results section, which `check` writes
    into the folder it checked by design (diffexport/format/model_card.py)."""
    from diffexport.format import model_card

    data = item.read_bytes()
    if item.name != model_card.CARD or model_card.MARKER.encode() not in data:
        return data
    start, end = data.find(model_card.RESULTS_START.encode()), data.find(model_card.RESULTS_END.encode())
    return data[:start] + data[end:] if 0 <= start < end else data


class Artifacts:
    """Checkpoints, exports and decoder folders built once per test session, on first use, and handed
    out to be read: every distinct artifact (model recipe x format x dtype x attention) is one path.
    A test that must change one works on copy(path, tmp_path). Nothing is chmod-protected (the tests
    may run as root): at the end of the session each artifact is checked to be byte for byte what
    was built, so a test that wrote into one fails the run."""

    def __init__(self, factory):
        self._factory = factory
        self._built: dict[tuple, object] = {}
        self._digests: dict[Path, str] = {}
        self._summaries: dict[tuple, object] = {}
        self._stdout: dict[tuple, str] = {}

    def _once(self, key: tuple, build):
        if key not in self._built:
            folder = self._factory.mktemp("-".join(str(k) for k in key)[:60].replace("/", "_"))
            path = Path(build(folder))
            self._digests[path] = _digest(path)
            self._built[key] = path
        return self._built[key]

    def checkpoint(self, recipe: str) -> Path:
        """ckpt.pt of a RECIPES model."""
        def build(folder):
            from helpers import perturb_norm_weights

            from diffexport.modeling.checkpoint import save_checkpoint
            from diffexport.modeling.families import build_model
            from diffexport.modeling.presets import preset_config

            preset, overrides, seed = RECIPES[recipe]
            cfg = preset_config(preset)
            for name, value in overrides.items():
                setattr(cfg, name, value)
            return save_checkpoint(perturb_norm_weights(build_model(cfg, seed=seed), seed), folder / "ckpt.pt")
        return self._once(("ckpt", recipe), build)

    def decoder(self, recipe: str, attention: str = "diffattention") -> Path:
        """The KV-cache decoder folder of a RECIPES model (export_decoder's defaults otherwise)."""
        def build(folder):
            from helpers import quiet

            from diffexport.modeling.checkpoint import load_model
            from diffexport.passes.decoder_formats import export_decoder

            summary = export_decoder(load_model(self.checkpoint(recipe)), folder / attention, attention=attention,
                                     log=quiet)
            self._summaries[recipe, attention] = summary
            return folder / attention
        return self._once(("decoder", recipe, attention), build)

    def decoders(self, recipe: str) -> "DecoderFolders":
        """decoder(recipe, attention) by attention, each built when first looked up."""
        return DecoderFolders(self, recipe)

    def decoder_summary(self, recipe: str, attention: str = "diffattention"):
        """What export_decoder returned when it wrote decoder(recipe, attention)."""
        self.decoder(recipe, attention)
        return self._summaries[recipe, attention]

    def hf_diffllama(self) -> Path:
        """An HF DiffLlama folder with GQA (8 maps over 4 kv heads) and a byte-level BPE tokenizer."""
        def build(folder):
            import transformers
            from helpers import byte_bpe_tokenizer

            torch.manual_seed(8)
            cfg = transformers.DiffLlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=112,
                                               num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                               head_dim=16, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                                               max_position_embeddings=512)
            transformers.DiffLlamaForCausalLM(cfg).eval().save_pretrained(folder / "diffllama")
            byte_bpe_tokenizer(folder / "diffllama")
            return folder / "diffllama"
        pytest.importorskip("transformers")
        return self._once(("hf-diffllama",), build)

    def hf_diffllama_with_chat_template(self) -> Path:
        """hf_diffllama() plus a chat_template.jinja (where newer transformers save it)."""
        def build(folder):
            import shutil

            source = shutil.copytree(self.hf_diffllama(), folder / "diffllama")
            (source / "chat_template.jinja").write_text(
                "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant: {% endif %}")
            return source
        return self._once(("hf-diffllama-chat",), build)

    def cli_output(self, *args, output: str = "model.onnx") -> Path:
        """What `diffexport ARGS -o OUTPUT` writes (a file, or a folder for --kv-cache and quantize of a
        folder), run once in this process: the same ARGS give the same path, named as the first
        caller asked."""
        def build(folder):
            from helpers import cli_main

            result = cli_main(*args, "-o", folder / output)
            assert result.returncode == 0, result.stdout + result.stderr
            self._stdout[key] = result.stdout
            return folder / output
        key = ("cli",) + tuple(str(a) for a in args)
        return self._once(key, build)

    def cli_stdout(self, *args) -> str:
        """What the run behind cli_output(*args) printed on stdout."""
        self.cli_output(*args)
        return self._stdout[("cli",) + tuple(str(a) for a in args)]

    @staticmethod
    def copy(path: Path, folder: Path, name: str | None = None) -> Path:
        """A private copy of an artifact in folder (as name, else its own), for a test that changes it."""
        import shutil

        target = folder / (name or path.name)
        if path.is_dir():
            shutil.copytree(path, target, symlinks=True)
        else:
            shutil.copyfile(path, target)
        return target

    def changed(self) -> list[Path]:
        return [path for path, digest in self._digests.items() if _digest(path) != digest]


class DecoderFolders(dict):
    """attention -> Artifacts.decoder(recipe, attention), exported on first lookup: a fixture can hand
    out both attentions while a test that needs one exports one."""

    def __init__(self, made: Artifacts, recipe: str):
        super().__init__()
        self._made, self._recipe = made, recipe

    def __missing__(self, attention):
        self[attention] = self._made.decoder(self._recipe, attention)
        return self[attention]


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    made = Artifacts(tmp_path_factory)
    yield made
    changed = made.changed()
    assert not changed, f"tests wrote into shared artifacts (use artifacts.copy): {changed}"


# The decoder folders several test files share (built once per session by `artifacts`).
@pytest.fixture(scope="module")
def v1_ckpt(artifacts):
    """A native ckpt.pt of a V1 model with GQA and an affine head norm that is not all ones."""
    return artifacts.checkpoint("diff-v1-gqa")


@pytest.fixture(scope="module")
def v1_folder(artifacts):
    return artifacts.decoder("diff-v1-gqa")


@pytest.fixture(scope="module")
def hf_dir(artifacts):
    """An HF DiffLlama folder with GQA (8 maps over 4 kv heads) and its tokenizer files."""
    return artifacts.hf_diffllama()


@pytest.fixture(scope="module")
def hf_kv(artifacts, hf_dir):
    """`diffexport onnx HF --kv-cache`: the folder with the HF checkpoint's tokenizer."""
    return artifacts.cli_output("onnx", hf_dir, "--kv-cache", output="kv")


@pytest.fixture(scope="module")
def hf_chat_kv(artifacts):
    """The same export of the HF folder with a chat_template.jinja, which the export copies."""
    return artifacts.cli_output("onnx", artifacts.hf_diffllama_with_chat_template(), "--kv-cache", output="kv")
