"""Runtimes as objects (backends/runtimes.py): the registry is the one place a runtime's name is
read, each entry opens a Runtime that refuses the options it does not take, and every runtime
gives the same greedy tokens for one answer, a batch, a beam search and a chat's turns."""

import ast
from pathlib import Path

import pytest

from diffexport.backends.base import Runtime
from diffexport.backends.runtimes import DEFAULT_RUNTIME, RUNTIMES, open_runtime
from diffexport.cli import build_parser
from diffexport.core.eager_generation import BeamSearch, Sampling
from diffexport.core.errors import DiffExportError

ROOT = Path(__file__).resolve().parent.parent


def refused(call, *args, **kwargs) -> str:
    """The one-line DiffExportError `call` raises."""
    with pytest.raises(DiffExportError) as caught:
        call(*args, **kwargs)
    assert "\n" not in str(caught.value)
    return str(caught.value)


def test_the_clis_backends_are_the_registrys():
    parser = build_parser()
    generate = parser._subparsers._group_actions[0].choices["generate"]
    backend = next(a for a in generate._actions if a.dest == "backend")
    assert list(backend.choices) == list(RUNTIMES) and backend.default == DEFAULT_RUNTIME


def test_no_module_compares_a_runtimes_name_outside_the_registry():
    """The names are read in backends/runtimes.py: elsewhere a runtime is an object (its .name is
    only printed)."""
    found = []
    for path in (ROOT / "diffexport").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and any(isinstance(x, ast.Constant) and x.value in RUNTIMES
                                                     for x in [node.left, *node.comparators]):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


def test_a_planted_comparison_is_found():
    tree = ast.parse('if backend == "genai":\n    pass\n')
    assert any(isinstance(n, ast.Compare) and n.comparators[0].value in RUNTIMES for n in ast.walk(tree))


def test_each_runtime_refuses_what_it_does_not_take(artifacts):
    folder = artifacts.decoder("diff-v1-gqa", "gqa")
    assert "unknown backend 'vllm'" in refused(open_runtime, "vllm", folder)
    for name in ("onnxruntime", "genai"):
        if name == "genai":
            pytest.importorskip("onnxruntime_genai")
        assert "--backend tensorrt runs the engine" in refused(open_runtime, name, folder, engine="model.engine")
    assert "give both --backend tensorrt and --engine ENGINE" in refused(open_runtime, "tensorrt", folder)
    assert "a TensorRT engine runs on the GPU" in refused(open_runtime, "tensorrt", folder, engine="model.engine",
                                                          provider="cpu")
    # an engine's runtime loads nothing until it is used: a missing engine is refused then
    engine_runtime = open_runtime("tensorrt", folder, engine=str(folder / "missing.engine"))
    assert isinstance(engine_runtime, Runtime) and engine_runtime.name == "tensorrt"
    assert "missing.engine" in refused(engine_runtime.open)


def test_every_runtime_gives_the_same_greedy_tokens(artifacts):
    """One answer, a batch, a beam search and a chat's two turns, on the step loop and on genai: the
    same tokens (greedy), and each one's chat turn equal to its own answer from scratch."""
    pytest.importorskip("onnxruntime_genai")
    folder = artifacts.decoder("diff-v1-gqa", "gqa")
    prompts = [[5, 17, 42, 99], [9, 8, 7], [300, 12]]
    search = BeamSearch(3, 2, 1.0, True)
    results = {}
    for name in ("onnxruntime", "genai"):
        runtime = open_runtime(name, folder, provider="cpu")
        assert isinstance(runtime, Runtime) and runtime.name == name and runtime.open() is runtime
        alone = [runtime.generate(p, 6, Sampling()).tokens for p in prompts]
        batched = [None] * len(prompts)
        for indices, run in runtime.generate_in_batches(prompts, 6, Sampling(), 2, sort_by_length=True):
            for i, tokens in zip(indices, run.tokens):
                batched[i] = tokens
        assert batched == alone, name
        searcher = runtime.beam_searcher(search, prompts, 10)
        beams = [searcher(p, 6).sequences for p in prompts]
        chat = runtime.chat_session(Sampling())
        first = chat.turn(prompts[0], 6).tokens
        second_ids = prompts[0] + first + [11]
        second = chat.turn(second_ids, 4)
        assert first == alone[0]
        assert second.tokens == runtime.generate(second_ids, 4, Sampling()).tokens, name
        assert second.prompt_tokens < len(second_ids)  # the cache was kept: only the new tokens read
        results[name] = (alone, beams)
    assert results["onnxruntime"] == results["genai"]
