"""Batched generation from KV-cache folders: `diffexport generate --prompts-file` and
a runtime's generate_in_batches (backends/runtimes.py). onnxruntime-genai pads a batch on the right (the new tokens
follow the
padding), the onnxruntime loop on the left; greedy rows must give, token for token, what eager
generate gives each prompt alone, for both attention kinds, a prompt that ends with the pad id and
rows that stop at an end id included. The prompts file is an input from strangers: every refusal
is one line."""

import json
import os

import pytest
import torch
from helpers import assert_one_line_error, cli_main, quiet

from diffexport.backends.runtimes import open_runtime
from diffexport.core.errors import DiffExportError
from diffexport.core.files import MAX_TEXT_BYTES
from diffexport.generation import prompts as prompts_file

# ---------------------------------------------------------------- the prompts file (no model needed)


def _write(tmp_path, text, name="p.jsonl"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_prompts_file_reads_each_lines_own_limits(tmp_path):
    path = _write(tmp_path, '{"prompt": "a", "max_new_tokens": 5, "stop": "\\n"}\n{"prompt": "b", "stop": []}\n'
                            '{"ids": [1], "stop": []}\n{"prompt": "c", "stop": ["x", "y"]}\n')
    lines = prompts_file.read_prompts(path, vocab_size=10)
    assert [(p.max_new_tokens, p.stop) for p in lines] == [(5, ["\n"]), (None, []), (None, []), (None, ["x", "y"])]


def test_prompts_file_reads_text_ids_and_caller_ids(tmp_path):
    path = _write(tmp_path, '{"prompt": "hello", "id": "q1"}\n\n  \n{"ids": [1, 2, 3], "id": 7}\n{"ids": [0]}\n')
    lines = prompts_file.read_prompts(path, vocab_size=10)
    assert [(p.line, p.text, p.ids, p.id) for p in lines] == [
        (1, "hello", None, "q1"), (4, None, [1, 2, 3], 7), (5, None, [0], None)]


@pytest.mark.parametrize("text,message", [
    ("not json\n", "line 1: not JSON"),
    ('["hello"]\n', "line 1: give an object"),
    ('{"ids": [1]}\n{"text": "hi"}\n', "line 2: unknown key 'text'"),
    ('{"prompt": "a", "ids": [1]}\n', "exactly one of prompt"),
    ('{"id": 3}\n', "exactly one of prompt"),
    ('{"prompt": ""}\n', "prompt must be non-empty text"),
    ('{"prompt": 5}\n', "prompt must be non-empty text"),
    ('{"ids": []}\n', "ids must be a non-empty list"),
    ('{"ids": [1, 10]}\n', "token ids in [0, 10)"),
    ('{"ids": [-1]}\n', "token ids in [0, 10)"),
    ('{"ids": [true]}\n', "token ids in [0, 10)"),
    ('{"ids": [1.0]}\n', "token ids in [0, 10)"),
    ('{"ids": [1], "id": [2]}\n', "id must be a string or an integer"),
    ('{"ids": [1], "id": false}\n', "id must be a string or an integer"),
    ("\n \n", "holds no prompt"),
    ('{"ids": [1], "max_new_tokens": 0}\n', "max_new_tokens must be an integer >= 1"),
    ('{"ids": [1], "max_new_tokens": 2.0}\n', "max_new_tokens must be an integer >= 1"),
    ('{"ids": [1], "max_new_tokens": true}\n', "max_new_tokens must be an integer >= 1"),
    ('{"prompt": "a", "stop": ""}\n', "stop must be a non-empty string or a list"),
    ('{"prompt": "a", "stop": ["x", 3]}\n', "stop must be a non-empty string or a list"),
    ('{"prompt": "a", "stop": ' + json.dumps(["s"] * 17) + '}\n', "at most 16"),
    ('{"ids": [1], "stop": "x"}\n', "stop matches generated text: give a text prompt"),
], ids=["json", "array", "key", "both", "neither", "empty", "number", "no-ids", "vocab", "negative", "bool",
        "float", "id-list", "id-bool", "blank", "limit-0", "limit-float", "limit-bool", "stop-empty", "stop-type",
        "stop-many", "stop-ids"])
def test_prompts_file_refusals(tmp_path, text, message):
    with pytest.raises(DiffExportError, match=None) as err:
        prompts_file.read_prompts(_write(tmp_path, text), vocab_size=10)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_prompts_file_refuses_what_is_not_a_small_utf8_file(tmp_path):
    with pytest.raises(DiffExportError, match="prompts file not found"):
        prompts_file.read_prompts(tmp_path / "missing.jsonl", 10)
    with pytest.raises(DiffExportError, match="not a regular file"):
        prompts_file.read_prompts(tmp_path, 10)
    os.mkfifo(tmp_path / "fifo.jsonl")  # never opened: a reader would block on it
    with pytest.raises(DiffExportError, match="not a regular file"):
        prompts_file.read_prompts(tmp_path / "fifo.jsonl", 10)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "caf\xe9"}\n')
    with pytest.raises(DiffExportError, match="not UTF-8"):
        prompts_file.read_prompts(tmp_path / "latin1.jsonl", 10)
    with open(tmp_path / "huge.jsonl", "wb") as f:  # sparse: refused from its size, never read
        f.truncate(MAX_TEXT_BYTES + 1)
    with pytest.raises(DiffExportError, match="limited to 64 MiB"):
        prompts_file.read_prompts(tmp_path / "huge.jsonl", 10)


# ---------------------------------------------------------------- batches of a folder


onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def model_and_folders(artifacts):
    """A V1 model (4 diff-heads on 2 kv-groups) and its DiffAttention and gqa folders (each exported
    when a test first looks it up)."""
    from diffexport.modeling.checkpoint import load_model

    return load_model(artifacts.checkpoint("diff-v1-gqa")), artifacts.decoders("diff-v1-gqa")


def _alone(model, prompt, n, eos, sampling=None):
    from diffexport.core.eager_generation import generate

    return generate(model.eval(), torch.tensor([prompt]), max_new_tokens=n, eos_token_id=eos,
                    sampling=sampling).tokens[0].tolist()


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
def test_batches_give_what_each_prompt_gives_alone(model_and_folders, attention, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    import shutil

    from diffexport.backends import genai
    from diffexport.core.eager_generation import Sampling

    loaded, folders = model_and_folders
    folder = tmp_path / attention
    shutil.copytree(folders[attention], folder)
    config = json.loads((folder / "genai_config.json").read_text())
    pad = config["model"]["pad_token_id"]
    assert pad == config["model"]["eos_token_id"] == loaded.config.vocab_size - 1  # no pad id: eos pads
    # lengths 1..13, one prompt ending with the pad id (genai would read it as padding)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [9], [300, 12, 77, pad], list(range(100, 113)), [64, 2]]
    free = _alone(loaded.model, prompts[0], 12, None)
    stop = next(i for i in range(2, 12) if free[i] not in free[:i])  # first seen late: an end id to stop at
    config["model"]["eos_token_id"] = [free[stop]]
    (folder / "genai_config.json").write_text(json.dumps(config))
    expected = [_alone(loaded.model, p, 12, [free[stop]]) for p in prompts]
    assert len(expected[0]) == stop + 1 and any(len(e) == 12 for e in expected)

    for backend in ("genai", "onnxruntime"):
        for size, by_length in ((5, False), (2, False), (2, True)):
            runs = list(open_runtime(backend, folder).generate_in_batches(prompts, 12, Sampling(), size,
                                                               sort_by_length=by_length))
            plan = [[3, 0], [2, 4], [1]] if by_length else [list(range(i, min(i + size, 5))) for i in range(0, 5, size)]
            assert [indices for indices, _ in runs] == plan
            tokens, stops = [None] * 5, [None] * 5
            for indices, run in runs:
                for i, t, s in zip(indices, run.tokens, run.stops):
                    tokens[i], stops[i] = t, s
            assert tokens == expected, (backend, size, by_length)
            assert stops == ["eos" if e[-1] == free[stop] else "length" for e in expected]
    # one prompt through genai alone: a trailing pad id is a token, not padding
    assert genai.generate_genai(folder, prompts[2], 12, Sampling()).tokens == expected[2]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
def test_each_line_its_own_token_limit(model_and_folders, attention, tmp_path):
    """A prompts file's "max_new_tokens" per line: rows of one batch stop at their own limits
    ("length"), or earlier at an end id, on both backends; the others take --max-new-tokens."""
    pytest.importorskip("onnxruntime_genai")
    import shutil

    loaded, folders = model_and_folders
    folder = shutil.copytree(folders[attention], tmp_path / attention)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [9], [300, 12, 77], list(range(100, 113))]
    free = _alone(loaded.model, prompts[2], 10, None)
    end = free[next(i for i in range(4, 10) if free[i] not in free[:i])]  # row 2 ends before --max-new-tokens
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [end]
    (folder / "genai_config.json").write_text(json.dumps(config))
    limits = [3, None, None, 14]
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"ids": p, **({} if n is None else {"max_new_tokens": n})}) + "\n"
                            for p, n in zip(prompts, limits)))
    expected = [_alone(loaded.model, p, 10 if n is None else n, [end]) for p, n in zip(prompts, limits)]
    assert [len(e) for e in expected][:1] == [3] and len(expected[3]) == 14
    for backend in ("genai", "onnxruntime"):
        result = cli_main("generate", folder, "--prompts-file", path, "--max-new-tokens", "10", "--batch-size", "4",
                         "--backend", backend)
        assert result.returncode == 0, result.stderr
        answers = [json.loads(line) for line in result.stdout.splitlines()]
        assert [a["tokens"] for a in answers] == expected, backend
        assert [a["stop"] for a in answers] == ["eos" if e[-1] == end else "length" for e in expected]
        assert "eos" in {a["stop"] for a in answers}
    beams = cli_main("generate", folder, "--prompts-file", path, "--max-new-tokens", "10", "--num-beams", "2")
    assert beams.returncode == 0, beams.stderr
    assert [len(json.loads(line)["tokens"]) <= (10 if n is None else n)
            for line, n in zip(beams.stdout.splitlines(), limits)] == [True] * 4


@pytest.mark.slow
def test_genai_samples_from_the_eager_distribution(model_and_folders):
    """Sampled tokens through genai follow the eager model's softmax: without a top-k cut over the
    whole vocabulary (genai once fell back to the folder's top_k of 1: every draw greedy), with
    top-k only among the k likeliest, and the likeliest token as often as its probability says."""
    pytest.importorskip("onnxruntime_genai")
    from diffexport.backends import genai
    from diffexport.core.eager_generation import Sampling

    loaded, folders = model_and_folders
    prompt = [5, 17, 42, 99, 3]
    with torch.no_grad():
        logits = loaded.model.eval()(torch.tensor([prompt]))[0, -1].float()
    model = genai.open_genai_model(folders["gqa"])

    def draws(count, **options):
        return [genai.generate_genai(folders["gqa"], prompt, 1, Sampling(greedy=False, seed=seed, **options),
                                     model=model).tokens[0] for seed in range(count)]

    whole = draws(200)
    assert len(set(whole)) > 60  # ~512 near-equally likely ids: about 170 distinct in 200 draws
    top3 = set(logits.topk(3).indices.tolist())
    assert set(draws(60, top_k=3)) == top3
    temperature = 0.05  # sharpen until the likeliest id has a probability well inside (0, 1)
    probs = (logits / temperature).softmax(-1)
    while probs.max() > 0.8:
        temperature *= 1.5
        probs = (logits / temperature).softmax(-1)
    while probs.max() < 0.3:
        temperature /= 1.5
        probs = (logits / temperature).softmax(-1)
    n, p_max = 400, float(probs.max())
    hits = sum(t == int(probs.argmax()) for t in draws(n, temperature=temperature))
    assert abs(hits / n - p_max) < 4 * (p_max * (1 - p_max) / n) ** 0.5, (hits / n, p_max)


@pytest.mark.slow
def test_repetition_penalty_in_batches_and_alone_equals_eager(model_and_folders, tmp_path):
    """A repetition penalty counts each row's own tokens only: padded batches through genai (where
    diffexport applies it, since genai's own would also penalise a padded row's pad id) and the
    onnxruntime loop, and genai's own penalty on a single prompt, all give eager generate's greedy
    tokens for each prompt alone. The folders' pad and end id is set to a token a padded row
    chooses, so a penalised pad would show."""
    pytest.importorskip("onnxruntime_genai")
    import shutil

    from diffexport.backends import genai, step_loop
    from diffexport.core.eager_generation import Sampling

    loaded, originals = model_and_folders
    penalised = Sampling(repetition_penalty=1.4)
    prompts = [[5, 17, 42, 99, 3, 250, 7, 5, 17], [9, 9, 9], [300, 12, 77, 12], [64, 2]]
    free = _alone(loaded.model, prompts[1], 14, None, penalised)
    end = free[next(i for i in range(3, 14) if free[i] not in free[:i] and free[i] not in prompts[1])]
    folders = {}
    for attention in ("diffattention", "gqa"):
        folders[attention] = shutil.copytree(originals[attention], tmp_path / attention)
        config = json.loads((folders[attention] / "genai_config.json").read_text())
        config["model"]["eos_token_id"], config["model"]["pad_token_id"] = [end], end
        (folders[attention] / "genai_config.json").write_text(json.dumps(config))
    expected = [_alone(loaded.model, p, 14, [end], penalised) for p in prompts]
    assert expected[1][-1] == end  # the padded row [9, 9, 9] stops at the pad id
    assert expected != [_alone(loaded.model, p, 14, [end]) for p in prompts]  # the penalty changed something
    for attention, folder in folders.items():
        for backend in ("genai", "onnxruntime"):
            tokens = [None] * len(prompts)
            for indices, run in open_runtime(backend, folder).generate_in_batches(prompts, 14, penalised, 4):
                for i, t in zip(indices, run.tokens):
                    tokens[i] = t
            assert tokens == expected, (attention, backend)
        assert genai.generate_genai(folder, prompts[1], 14, penalised).tokens == expected[1]
        assert step_loop.generate_stepped(folder, prompts[1], 14, penalised).tokens == expected[1]


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
@pytest.mark.parametrize("kind", ["genai", "loop"])
def test_sessions_keep_their_cache_and_answer_as_from_scratch(model_and_folders, attention, kind, tmp_path):
    """GenaiSession and LoopSession (the onnxruntime loop's): turns that keep the last answer whole
    (ended by its end id, or by the length: then genai's own append would count the unfed last
    token), keep part of it (a stop string cut it) or start over read only what they do not share
    with the session's sequence (and a token or two of it: genai is rewound before every append)
    and answer with the greedy tokens generate_genai / generate_stepped give from scratch, with
    a repetition penalty too, on both cache kinds."""
    pytest.importorskip("onnxruntime_genai")
    import shutil

    from diffexport.backends import genai, step_loop
    from diffexport.core.eager_generation import Sampling

    loaded, folders = model_and_folders
    folder = shutil.copytree(folders[attention], tmp_path / attention)
    first = [5, 17, 42, 99, 3, 250, 7]
    free = _alone(loaded.model, first, 10, None)
    end = free[next(i for i in range(2, 10) if free[i] not in free[:i])]
    config = json.loads((folder / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = [end]
    (folder / "genai_config.json").write_text(json.dumps(config))
    stops = []
    scratch = genai.generate_genai if kind == "genai" else step_loop.generate_stepped
    for sampling in (Sampling(), Sampling(repetition_penalty=1.3)):
        session = genai.GenaiSession(folder, sampling) if kind == "genai" else \
            step_loop.LoopSession(step_loop.OrtDecoder(folder), sampling)
        held: list[int] = []
        turns = [lambda ids, answer: first,
                 lambda ids, answer: ids + answer + [300, 301, 302],  # the whole answer kept
                 lambda ids, answer: ids + answer + [64, 65],  # again (this answer ends by the length)
                 lambda ids, answer: ids + answer[:1] + [66, 67],  # a cut answer
                 lambda ids, answer: [9, 8, 7, 6],  # a new conversation
                 lambda ids, answer: ids]  # the same conversation again
        ids, answer = [], []
        for number, make in enumerate(turns):
            ids = make(ids, answer)
            shared = next((k for k, (a, b) in enumerate(zip(held, ids)) if a != b), min(len(held), len(ids)))
            run = session.turn(ids, 10, stop_after=lambda token: token == 111)
            fresh = scratch(folder, ids, 10, sampling, stop_after=lambda token: token == 111)
            assert (run.tokens, run.stop) == (fresh.tokens, fresh.stop)
            assert len(ids) - shared <= run.prompt_tokens <= max(len(ids) - shared, 1) + 2
            answer, held = run.tokens, ids + run.tokens
            if number < len(turns) - 1:
                stops.append(run.stop)
    assert "eos" in stops and "length" in stops  # both ways a turn ends were followed by another turn
    if kind == "genai":
        with pytest.raises(DiffExportError, match="ends with the pad id"):
            genai.GenaiSession(folder, Sampling()).turn([5, config["model"]["pad_token_id"]], 4)
    with pytest.raises(DiffExportError, match="a turn needs 1 to"):
        session.turn([5] * config["model"]["context_length"], 4)


@pytest.mark.slow
def test_sampled_batches_are_reproducible(model_and_folders):
    pytest.importorskip("onnxruntime_genai")
    from diffexport.core.eager_generation import Sampling

    _, folders = model_and_folders
    prompts = [[5, 17, 42], [9, 8, 7, 6, 5]]
    sampling = Sampling(greedy=False, temperature=1.5, top_k=50, seed=3)
    for backend in ("genai", "onnxruntime"):
        first = list(open_runtime(backend, folders["gqa"]).generate_in_batches(prompts, 10, sampling, 2))[0][1]
        again = list(open_runtime(backend, folders["gqa"]).generate_in_batches(prompts, 10, sampling, 2))[0][1]
        assert first.tokens == again.tokens and all(len(t) == 10 for t in first.tokens)
        # one prompt in three batches: each batch has its own draws (the first keeps the seed itself)
        runs = [run.tokens[0] for _, run in open_runtime(backend, folders["gqa"]).generate_in_batches(
                    [prompts[0]] * 3, 10, sampling, 1)]
        alone = list(open_runtime(backend, folders["gqa"]).generate_in_batches([prompts[0]], 10, sampling, 1))
        assert runs[0] == alone[0][1].tokens[0]
        assert len({tuple(r) for r in runs}) == 3, backend


@pytest.mark.slow
def test_generate_prompts_file_cli(model_and_folders, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    loaded, folders = model_and_folders
    folder = folders["diffattention"]
    prompts = [[5, 17, 42, 99], [9], [300, 12, 77, 1, 2, 3]]
    path = _write(tmp_path, "".join(json.dumps({"ids": p, "id": f"q{i}"}) + "\n" for i, p in enumerate(prompts)))
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", folder, "--prompts-file", path, "--batch-size", "2", "--max-new-tokens", "6",
                      "--backend", backend)
        assert out.returncode == 0, out.stderr
        answers = [json.loads(line) for line in out.stdout.splitlines()]
        assert [a["id"] for a in answers] == ["q0", "q1", "q2"] and [a["line"] for a in answers] == [1, 2, 3]
        assert [a["tokens"] for a in answers] == [_alone(loaded.model, p, 6, None) for p in prompts]
        assert "in 2 batches of up to 2" in out.stderr and "batch 2/2: 1 prompt (longest 6 tokens)," in out.stderr
        # longest first: [q2, q0] then [q1]; the answers still come in the file's order
        by_length = cli_main("generate", folder, "--prompts-file", path, "--batch-size", "2", "--max-new-tokens", "6",
                            "--backend", backend, "--sort-by-length")
        assert by_length.returncode == 0, by_length.stderr
        assert [json.loads(line) for line in by_length.stdout.splitlines()] == answers
        assert "batch 1/2: 2 prompts (longest 6 tokens)" in by_length.stderr
        assert "batch 2/2: 1 prompt (longest 1 token)" in by_length.stderr


@pytest.mark.slow
def test_generate_prompts_file_refusals(model_and_folders, tmp_path):
    _, folders = model_and_folders
    folder = folders["diffattention"]
    ok = _write(tmp_path, '{"ids": [1, 2]}\n')
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", _write(tmp_path, '{"ids": [1]}\n{"ids": [1, '
                                                                                          '99999]}\n',
                                                                                "bad.jsonl")),
                          "bad.jsonl line 2: ids must be")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", tmp_path / "missing.jsonl"),
                          "prompts file not found")
    assert_one_line_error(cli_main("generate", folder, "--ids", "1,2", "--batch-size", "2"),
                          "--batch-size groups the prompts of --prompts-file")
    assert_one_line_error(cli_main("generate", folder, "--ids", "1,2", "--sort-by-length"),
                          "--sort-by-length groups the prompts of --prompts-file")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", ok, "--batch-size", "0"),
                          "the batch size must be >= 1")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", ok, "--repetition-penalty", "-1"),
                          "repetition penalty must be a finite number > 0")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", ok, "--chat"),
                          "gives token ids only")
    text_prompts = _write(tmp_path, '{"prompt": "hi"}\n', "t.jsonl")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", text_prompts),
                          "has no tokenizer")
    long = _write(tmp_path, '{"ids": [1]}\n' + json.dumps({"ids": [1] * 2040}) + "\n", "long.jsonl")
    assert_one_line_error(cli_main("generate", folder, "--prompts-file", long, "--max-new-tokens", "16"),
                          "long.jsonl line 2 (2040 tokens) + --max-new-tokens 16 exceeds the context length 2048")


# ---------------------------------------------------------------- `diffexport check FOLDER --sample`


def test_chi_square_of_draws():
    from diffexport.validation.search import _chi_square

    expected = torch.full((10,), 100.0, dtype=torch.float64)
    statistic, bins, p_value = _chi_square(expected.clone(), expected)
    assert (statistic, bins) == (0.0, 10) and p_value == pytest.approx(1.0)
    skewed = expected.clone()
    skewed[0], skewed[1] = 160.0, 40.0
    statistic, bins, p_value = _chi_square(skewed, expected)
    assert statistic == pytest.approx(72.0) and p_value < 1e-10  # 36 + 36 on 9 degrees of freedom
    # bins below 5 expected draws merge into one; a tail too small for a bin folds into the last
    tail = torch.tensor([500.0, 300.0, 100.0, 50.0, 30.0, 15.0, 3.0, 1.0, 1.0], dtype=torch.float64)
    assert _chi_square(tail.clone(), tail)[1] == 7
    assert _chi_square(torch.tensor([10.0, 3.0]), torch.tensor([10.0, 3.0]))[1:] == (1, 1.0)


@pytest.mark.slow
def test_check_sample_holds_genai_draws_to_the_eager_distribution(model_and_folders, tmp_path, monkeypatch):
    """`check FOLDER --sample` passes where genai draws as eager generate does, top-p alone
    included (genai 0.18's own top-p-only sampler, which diffexport passed top_k 0 until
    2026-11-25, drew 14% outside the nucleus: the check fails on it), and fails a genai given
    another temperature than eager draws with (the chi-square test, no token outside)."""
    pytest.importorskip("onnxruntime_genai")
    from diffexport.backends import genai
    from diffexport.core.eager_generation import Sampling
    from diffexport.validation.decoder import run_decoder_check
    from diffexport.validation.options import CheckOptions

    loaded, folders = model_and_folders

    def check(sampling):
        options = CheckOptions(provider="cpu", save_dir=tmp_path / "saved", sampling=sampling, draws=2000)
        report = run_decoder_check(folders["gqa"], loaded, options, log=quiet, steps=1)
        return report, [line for line in report.lines if line.startswith("sampled tokens")]

    cases = [Sampling(greedy=False), Sampling(greedy=False, temperature=1.0, top_p=0.3),
             Sampling(greedy=False, temperature=0.05, top_p=0.9), Sampling(greedy=False, temperature=0.05, top_k=3),
             Sampling(greedy=False, temperature=0.07, top_k=20, top_p=0.8),
             Sampling(greedy=False, temperature=0.05, repetition_penalty=1.5)]
    for sampling in cases:
        report, lines = check(sampling)
        assert report.passed and len(lines) == 3 and all(line.endswith("PASS") for line in lines), (sampling, lines)

    original = genai._search_options

    def top_p_alone(sampling, *args, **kwargs):  # what diffexport passed genai before the fix
        options = original(sampling, *args, **kwargs)
        if not sampling.greedy:
            options["top_k"] = sampling.top_k
        return options

    monkeypatch.setattr(genai, "_search_options", top_p_alone)
    report, lines = check(Sampling(greedy=False, temperature=1.0, top_p=0.3))
    assert not report.passed and all(line.endswith("FAIL") for line in lines), lines
    assert all(int(line.split("candidates, ")[1].split()[0]) > 100 for line in lines)  # draws outside the nucleus

    def hotter(sampling, *args, **kwargs):
        options = original(sampling, *args, **kwargs)
        options["temperature"] *= 1.5
        return options

    monkeypatch.setattr(genai, "_search_options", hotter)
    report, lines = check(Sampling(greedy=False, temperature=0.05))
    assert not report.passed and any(line.endswith("FAIL") for line in lines), lines
    assert all(", 0 outside them" in line for line in lines)  # the distribution, not the support, fails


@pytest.mark.slow
def test_check_sample_on_the_command_line(model_and_folders, tmp_path):
    loaded, folders = model_and_folders
    result = cli_main("check", folders["diffattention"], "--ckpt", loaded.path, "--steps", "1", "--sample",
                     "--top-p", "0.5", "--temperature", "0.8", "--draws", "500", "--save-dir", tmp_path / "saved",
                     "--plot", tmp_path / "steps.png")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("500 draws over") == 3 and "top-p 0.5" in result.stdout + result.stderr
    for name in ("steps.png", "steps-sampling.png"):  # the decode steps, and the draws beside them
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the draws' plot has a name the user did not give: an existing file there is refused, not replaced
    drawn = (tmp_path / "steps-sampling.png").read_bytes()
    assert_one_line_error(cli_main("check", folders["diffattention"], "--ckpt", loaded.path, "--steps", "1",
                                   "--sample", "--plot", tmp_path / "steps.png"), "steps-sampling.png exists")
    assert (tmp_path / "steps-sampling.png").read_bytes() == drawn
    # a folder whose search samples gives the defaults, as it does to generate; an option overrides
    import shutil

    folder = shutil.copytree(folders["gqa"], tmp_path / "sampling-folder")
    config = json.loads((folder / "genai_config.json").read_text())
    config["search"].update(do_sample=True, temperature=0.5, top_p=0.8, top_k=0)
    (folder / "genai_config.json").write_text(json.dumps(config))
    result = cli_main("check", folder, "--ckpt", loaded.path, "--steps", "1", "--sample", "--top-p", "0.9",
                     "--draws", "300", "--save-dir", tmp_path / "saved")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "from the folder's genai_config.json search: temperature 0.5 (the options override it)" in result.stderr
    assert "(temperature 0.5, top-k 0, top-p 0.9," in result.stdout + result.stderr


@pytest.mark.slow
def test_check_sample_that_cannot_fail_is_inconclusive_not_pass(model_and_folders, tmp_path):
    """With top-k 1 one token holds all the probability: the draws make the chi-square one bin, a
    test that cannot fail. The check says so, names the draws that would make it a test,
    exits non-zero, and neither the verdict nor the folder's card says PASS."""
    loaded, folders = model_and_folders
    import shutil

    folder = shutil.copytree(folders["diffattention"], tmp_path / "folder")
    result = cli_main("check", folder, "--ckpt", loaded.path, "--steps", "1", "--sample", "--top-k", "1",
                      "--draws", "100", "--save-dir", tmp_path / "saved")
    assert result.returncode == 1, result.stdout + result.stderr
    sampled = [line for line in result.stdout.splitlines() if line.startswith("sampled tokens")]
    assert sampled and all("over 1 bins" in line and "INCONCLUSIVE" in line and "PASS" not in line
                           for line in sampled), sampled
    assert all("use --draws" in line or "raise --temperature" in line for line in sampled), sampled
    assert "result        INCONCLUSIVE" in result.stdout and "not judged: sampled tokens" in result.stdout
    assert "**INCONCLUSIVE**" in (folder / "README.md").read_text()


@pytest.mark.parametrize("args,pattern", [
    (["--top-p", "0.5"], "--top-p shapes the sampling check: add --sample"),
    (["--sample", "--draws", "5"], "--draws must be 100 to 1,000,000"),
    (["--sample", "--top-p", "0"], "top-p must be in (0, 1]"),
    (["--sample", "--seed", "-1"], "the draws are seeded"),
])
def test_check_sample_refusals(model_and_folders, args, pattern):
    loaded, folders = model_and_folders
    assert_one_line_error(cli_main("check", folders["gqa"], "--ckpt", loaded.path, *args), pattern)


def test_check_sample_needs_a_folder(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"not read")
    assert_one_line_error(cli_main("check", path, "--preset", "diff-v1-tiny", "--sample"),
                          "--sample checks onnxruntime-genai's sampling on a --kv-cache folder")


def test_folder_search_with_top_p_alone_goes_through_genais_top_k_sampler():
    """A checkpoint's top_p with top_k 0 (no cut) is written as a top-k of the whole vocabulary, so
    an app sampling with the folder's defaults in genai avoids genai's top-p-only sampler; other
    values are written as they are."""
    from diffexport.format.decoder_folder import SEARCH_DEFAULTS, genai_config
    from diffexport.modeling.presets import preset_config

    cfg = preset_config("diff-v1-tiny")

    def written(search):
        return genai_config(cfg, "float32", 256, {}, search=search)["search"]

    assert written({"do_sample": True, "top_k": 0, "top_p": 0.9})["top_k"] == cfg.vocab_size
    assert written({"top_k": 0})["top_k"] == 0  # no nucleus: nothing to route
    assert written({"top_k": 7, "top_p": 0.9})["top_k"] == 7
    assert written({"top_k": 100000})["top_k"] == cfg.vocab_size  # past the vocabulary: no cut (genai refuses it)
    from diffexport.backends.genai import _search_options
    from diffexport.core.eager_generation import Sampling

    folder_config = {"model": {"vocab_size": cfg.vocab_size}}  # generate's and check's draws take the same route
    assert _search_options(Sampling(greedy=False, top_k=100000), 8, folder_config)["top_k"] == cfg.vocab_size
    assert _search_options(Sampling(greedy=False, top_k=0, top_p=0.5), 8, folder_config)["top_k"] == cfg.vocab_size
    assert {k: written(None)[k] for k in SEARCH_DEFAULTS} == SEARCH_DEFAULTS


def test_chi_square_bins_a_flat_distribution_and_refuses_a_single_bin():
    """A near-flat distribution over 200 tokens with 500 draws (2.5 expected each) is grouped into
    bins of at least 5 expected draws, so the test has something to reject; a distribution with 99.9%
    on one token leaves one bin at 500 draws, and the words say the draws that make it a test."""
    from diffexport.validation.search import SAMPLING_MIN_EXPECTED, _chi_square, _too_few_bins

    flat = torch.full((200,), 1 / 200, dtype=torch.float64)
    expected = flat * 500
    statistic, bins, p = _chi_square(expected.clone(), expected)
    assert bins == 100 and statistic == 0 and p == 1.0
    skewed = torch.zeros(200, dtype=torch.float64)
    skewed[:100] = 5.0  # all draws on half the tokens: rejected
    statistic, bins, p = _chi_square(skewed, expected)
    assert bins == 100 and p < 1e-10
    peaked = torch.tensor([0.999, 0.0005, 0.0005], dtype=torch.float64)
    assert _chi_square(peaked * 500, peaked * 500)[1] == 1
    words = _too_few_bins(peaked, 500)
    import re

    needed = int(re.search(r"--draws (\d+)", words).group(1))
    assert SAMPLING_MIN_EXPECTED / 0.001 <= needed <= SAMPLING_MIN_EXPECTED / 0.001 + 1 and "99.9000%" in words
