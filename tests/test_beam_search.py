"""Beam search: `diffexport generate --num-beams` runs onnxruntime-genai's search over a KV-cache
folder, or eager_generation.search_beams (the same rule) over the onnxruntime loop and engines;
eager_generation.beam_search is the eager reference. The reference equals transformers'
generate(num_beams=...) where the two libraries' rules coincide (length_penalty 0: transformers
normalises by the new tokens, genai by the whole sequence); genai's hypotheses and the loop's equal
the reference's, in rank order, for V1, V2 and the baseline Transformer, both attention kinds, with
end ids reached early, late and never, several end ids, and length penalties of both signs."""

import json
import shutil

import pytest
import torch
from helpers import assert_one_line_error, cli_main, quiet

from diffexport.core.eager_generation import BeamSearch, beam_search, generate
from diffexport.core.errors import DiffExportError

# ---------------------------------------------------------------- the eager reference


def _hf_diffllama(seed=4, vocab=96):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    cfg = transformers.DiffLlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=512)
    return transformers.DiffLlamaForCausalLM(cfg).eval()


def _with_end(hypothesis, end):
    """transformers keeps the end token in a finished sequence; genai and the reference leave it out."""
    return hypothesis.tokens + ([end] if hypothesis.stop == "eos" else [])


def _cut_at_end(row, end):
    return row[:row.index(end) + 1] if end in row else row


@pytest.mark.parametrize("early_stopping", [True, False])
def test_eager_beam_search_equals_transformers(early_stopping, tmp_path):
    """length_penalty 0 (sum of log-probabilities): transformers and genai rank alike, so the reference
    must give transformers' hypotheses, in order, also when some beams end early."""
    from diffexport.modeling.checkpoint import load_model

    hf = _hf_diffllama()
    hf.save_pretrained(tmp_path / "hf")
    ours = load_model(tmp_path / "hf").model.eval()
    gen = torch.Generator().manual_seed(5)
    stops = set()
    for n in (5, 11):
        prompt = torch.randint(3, 96, (1, n), generator=gen)
        greedy = generate(ours, prompt, max_new_tokens=8).tokens[0].tolist()
        for end in (greedy[1], greedy[5]):  # end ids the search meets early and late
            with torch.no_grad():
                out = hf.generate(prompt, max_new_tokens=14, num_beams=4, num_return_sequences=4, do_sample=False,
                                  length_penalty=0.0, early_stopping=early_stopping, eos_token_id=end, pad_token_id=0)
            expected = [_cut_at_end(row[n:].tolist(), end) for row in out]
            got = beam_search(ours, prompt[0].tolist(), BeamSearch(4, 4, 0.0, early_stopping), 14, eos_token_id=end)
            assert [_with_end(h, end) for h in got] == expected, (n, end)
            assert [h.score for h in got] == sorted((h.score for h in got), reverse=True)
            stops |= {h.stop for h in got}
    assert stops == {"eos", "length"}  # both endings were compared


def test_beam_search_of_one_beam_is_greedy():
    from diffexport.modeling.families import build_model
    from diffexport.modeling.presets import preset_config

    model = build_model(preset_config("diff-v2-tiny"), seed=2).eval()
    prompt = [7, 300, 12, 45]
    greedy = generate(model, torch.tensor([prompt]), max_new_tokens=12).tokens[0].tolist()
    (only,) = beam_search(model, prompt, BeamSearch(1), 12)
    assert (only.tokens, only.stop) == (greedy, "length")
    (ended,) = beam_search(model, prompt, BeamSearch(1), 12, eos_token_id=greedy[4])
    assert (ended.tokens, ended.stop) == (greedy[:4], "eos")


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(num_beams=0), "num beams must be an integer in 1..256"),
    (dict(num_beams=True), "num beams must be an integer in 1..256"),
    (dict(num_beams=2.0), "num beams must be an integer in 1..256"),
    (dict(num_beams=2, num_return_sequences=3), "3 sequences to return need at least as many beams"),
    (dict(num_beams=2, num_return_sequences=0), "num return sequences must be an integer in 1..256"),
    (dict(num_beams=2, length_penalty=float("nan")), "length penalty must be a finite number"),
    (dict(num_beams=2, length_penalty="1"), "length penalty must be a finite number"),
])
def test_bad_beam_search_options(kwargs, pattern):
    with pytest.raises(DiffExportError, match=pattern):
        BeamSearch(**kwargs)


def test_beam_caches_are_held_to_the_machines_memory():
    """256 beams (the most a search takes) of a 70B-class model's cache at 128k tokens: refused
    before any search starts; a small model's fit."""
    from diffexport.backends.base import check_beam_memory

    big = {"model": {"decoder": {"num_hidden_layers": 80, "num_key_value_heads": 8, "head_size": 128}}}
    with pytest.raises(DiffExportError, match="256 beams of 131072 tokens need .* GiB of KV cache, more than the"):
        check_beam_memory(big, "float16", 256, 131072)
    small = {"model": {"decoder": {"num_hidden_layers": 2, "num_key_value_heads": 1, "head_size": 64}}}
    check_beam_memory(small, "float32", 256, 2048)


# ---------------------------------------------------------------- onnxruntime-genai's search over folders

pytest.importorskip("onnxruntime")

FAMILIES = ("diff-v1-tiny", "diff-v2-tiny", "transformer-tiny")


def _attentions(family):
    """The folder kinds a family exports to (the baseline has no DiffAttention for gqa to rewrite)."""
    return ("diffattention",) if family == "transformer-tiny" else ("diffattention", "gqa")


RECIPE = {"diff-v1-tiny": "diff-v1-gqa", "diff-v2-tiny": "diff-v2", "transformer-tiny": "transformer"}


@pytest.fixture(scope="module")
def folders(artifacts):
    """Each family's eager model (V1 with 4 diff-heads on 2 kv-groups and an affine head norm), its
    DiffAttention and gqa folders by attention, and its checkpoint; built when a test first asks
    for the family (the refusal tests need one folder, not five)."""
    from diffexport.modeling.checkpoint import load_model

    class Families(dict):
        def __missing__(self, family):
            ckpt = artifacts.checkpoint(RECIPE[family])
            self[family] = (load_model(ckpt).model.eval(), artifacts.decoders(RECIPE[family]), ckpt)
            return self[family]

    return Families()


def _with_end_ids(folder, tmp_path, ends):
    copy = tmp_path / folder.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    config = json.loads((copy / "genai_config.json").read_text())
    config["model"]["eos_token_id"] = ends
    (copy / "genai_config.json").write_text(json.dumps(config))
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("family,attention", [(f, a) for f in FAMILIES for a in _attentions(f)])
def test_genai_and_loop_beams_equal_the_eager_reference(folders, family, attention, tmp_path):
    """genai's own search and eager_generation.search_beams over the onnxruntime loop give the eager
    reference's hypotheses, in order."""
    pytest.importorskip("onnxruntime_genai")
    from diffexport.backends import genai, step_loop

    model, root, _ = folders[family]
    prompt = [11, 250, 3, 97, 40, 8]
    free = beam_search(model, prompt, BeamSearch(4), 16)[0].tokens
    # end ids: none reachable, one met early, one met late, and two at once (genai reads a list)
    end_sets = [[model.config.vocab_size - 1], [free[1]], [free[6]], [free[3], free[9]]]
    # early stopping matters where long answers are favoured (penalty 3): there it ends the search first
    searches = [BeamSearch(4, 4, 1.0, True), BeamSearch(4, 4, 1.0, False), BeamSearch(4, 4, 3.0, True),
                BeamSearch(3, 2, 0.0, False), BeamSearch(4, 3, 2.0, False), BeamSearch(5, 5, -1.0, False)]
    stops = set()
    for ends in end_sets:
        folder = _with_end_ids(root[attention], tmp_path, ends)
        genai_model, runner = genai.open_genai_model(folder), step_loop.OrtDecoder(folder)
        for search in searches:
            expected = beam_search(model, prompt, search, 16, eos_token_id=ends)
            for run in (genai.beam_search_genai(folder, prompt, 16, search, model=genai_model),
                        step_loop.beam_search_stepped(folder, prompt, 16, search, runner)):
                assert run.sequences == [h.tokens for h in expected], (ends, search)
                assert run.stops == [h.stop for h in expected], (ends, search)
                stops |= set(run.stops)
    assert stops == {"eos", "length"}


@pytest.mark.slow
def test_loop_beams_take_a_long_prompt_in_chunks(folders):
    """An engine's profile caps one call's tokens: the loop's search then reads the prompt in chunks
    (as `generate --backend tensorrt` does) and finds the same hypotheses."""
    from diffexport.backends import step_loop

    model, root, ckpt = folders["diff-v1-tiny"]
    prompt = list(range(40, 51))
    search = BeamSearch(3, 3, 1.0, False)
    runner = step_loop.OrtDecoder(root["gqa"])
    runner.max_sequence = 4  # chunks of 4, 4 and 3
    calls = []
    step = runner.step
    runner.step = lambda ids, mask, cache: calls.append(ids.shape) or step(ids, mask, cache)
    run = step_loop.beam_search_stepped(root["gqa"], prompt, 9, search, runner)
    assert calls[:4] == [(1, 4), (1, 4), (1, 3), (3, 1)]
    assert run.sequences == [h.tokens for h in beam_search(model, prompt, search, 9)]
    assert run.steps == 9 and run.stops == ["length"] * 3


@pytest.mark.slow
def test_generate_num_beams_prompts_file_and_text(folders, artifacts, tmp_path):
    """The CLI: a prompts file's JSON lines (best hypothesis, and all under "beams") equal the
    reference; a text prompt prints every hypothesis, decoded, under its header."""
    pytest.importorskip("onnxruntime_genai")
    model, root, ckpt = folders["diff-v1-tiny"]
    pad = model.config.vocab_size - 1  # the folders' pad id (no pad id: the eos pads), ending a prompt
    prompts = [[5, 17, 42, 99], [300, 12, pad], [64, 2, 9, 9, 9]]
    end = beam_search(model, prompts[0], BeamSearch(3), 10)[0].tokens[2]
    folder = _with_end_ids(root["diffattention"], tmp_path, end)
    assert json.loads((folder / "genai_config.json").read_text())["model"]["pad_token_id"] == pad
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"ids": p, "id": f"q{i}"}) + "\n" for i, p in enumerate(prompts)))
    result = cli_main("generate", folder, "--prompts-file", path, "--num-beams", "3", "--num-return-sequences", "2",
                     "--max-new-tokens", "10", "--length-penalty", "0.5")
    assert result.returncode == 0, result.stderr
    answers = [json.loads(line) for line in result.stdout.splitlines()]
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        expected = beam_search(model, prompt, BeamSearch(3, 2, 0.5), 10, eos_token_id=end)
        assert answer["id"] == f"q{i}" and answer["line"] == i + 1
        assert [(b["tokens"], b["stop"]) for b in answer["beams"]] == [(h.tokens, h.stop) for h in expected]
        assert (answer["tokens"], answer["stop"]) == (expected[0].tokens, expected[0].stop)
    assert {a["stop"] for a in answers} == {"eos", "length"}
    loop = cli_main("generate", folder, "--prompts-file", path, "--num-beams", "3", "--num-return-sequences", "2",
                   "--max-new-tokens", "10", "--length-penalty", "0.5", "--backend", "onnxruntime")
    assert loop.returncode == 0, loop.stderr
    assert loop.stdout == result.stdout and "onnxruntime beam search" in loop.stderr

    # text: an HF DiffLlama with a tokenizer; the hypotheses are the reference's, decoded
    from transformers import AutoTokenizer

    from diffexport.modeling.checkpoint import load_model

    hf = artifacts.hf_diffllama()
    tokenizer = AutoTokenizer.from_pretrained(hf)
    kv = artifacts.cli_output("onnx", hf, "--kv-cache", output="kv")
    expected = beam_search(load_model(hf).model.eval(), tokenizer("the cat sat")["input_ids"],
                           BeamSearch(4, 3), 8, eos_token_id=2)
    path.write_text('{"prompt": "the cat sat"}\n')
    answer = json.loads(cli_main("generate", kv, "--prompts-file", path, "--num-beams", "4",
                                "--num-return-sequences", "3", "--max-new-tokens", "8").stdout)
    assert [(b["tokens"], b["stop"]) for b in answer["beams"]] == [(h.tokens, h.stop) for h in expected]
    result = cli_main("generate", kv, "--prompt", "the cat sat", "--num-beams", "4",
                     "--num-return-sequences", "3", "--max-new-tokens", "8")
    assert result.returncode == 0, result.stderr
    shown = []  # a random model's tokens need not be whole UTF-8 characters: genai's decode is the text
    for rank, (hypothesis, beam) in enumerate(zip(expected, answer["beams"]), 1):
        shown += [f"--- hypothesis {rank} of 3 (stopped: {hypothesis.stop})", beam["completion"]]
    assert result.stdout == "\n".join(shown) + "\n"
    assert "genai beam search, 4 beams" in result.stderr


@pytest.mark.parametrize("args,pattern", [
    (["--length-penalty", "2"], "--length-penalty is a beam search option: add --num-beams"),
    (["--num-return-sequences", "2"], "--num-return-sequences is a beam search option"),
    (["--no-early-stopping"], "--no-early-stopping is a beam search option"),
    (["--num-beams", "0"], "--num-beams must be >= 1"),
    (["--num-beams", "2", "--num-return-sequences", "3"], "3 sequences to return need at least as many beams"),
    (["--num-beams", "2", "--length-penalty", "inf"], "length penalty must be a finite number"),
    (["--num-beams", "2", "--sample"], "beam search is deterministic"),
    (["--num-beams", "2", "--repetition-penalty", "1.2"], "not combined with --num-beams"),
    (["--num-beams", "2", "--stop", "x"], "drop --stop"),
    (["--num-beams", "100000", "--max-new-tokens", "2000"], "num beams must be an integer in 1..256, got 100000"),
    (["--num-beams", "33"], "onnxruntime-genai searches at most 32 beams, got 33: lower --num-beams, or use "
                            "--backend onnxruntime"),
])
def test_beam_search_refusals(folders, args, pattern):
    _, root, ckpt = folders["diff-v2-tiny"]
    assert_one_line_error(cli_main("generate", root["diffattention"], "--ids", "1,2,3", *args), pattern)


def test_beam_search_refuses_batches_and_chat(folders, tmp_path):
    _, root, ckpt = folders["diff-v2-tiny"]
    path = tmp_path / "p.jsonl"
    path.write_text('{"ids": [1, 2]}\n')
    assert_one_line_error(cli_main("generate", root["gqa"], "--prompts-file", path, "--num-beams", "2",
                                  "--batch-size", "4"), "beam search runs one prompt at a time")
    assert_one_line_error(cli_main("generate", root["gqa"], "--interactive", "--num-beams", "2", stdin="hi\n"),
                          "--interactive streams a chat: drop --num-beams")


# ---------------------------------------------------------------- `diffexport check FOLDER --num-beams`


def test_hypothesis_score_rescores_the_search_scores():
    """The eager rescoring `check` applies to a runtime's differing beams gives each reference
    hypothesis the score the search gave it, for ended and length-limited ones and any penalty."""
    from diffexport.core.eager_generation import hypothesis_score
    from diffexport.modeling.families import build_model
    from diffexport.modeling.presets import preset_config

    model = build_model(preset_config("diff-v1-tiny"), seed=9).eval()
    prompt = [5, 77, 301, 12, 9]
    free = beam_search(model, prompt, BeamSearch(4), 10)[0].tokens
    stops = set()
    for penalty, ends in [(p, e) for p in (0.0, 1.0, -0.5, 2.5) for e in ([free[2], free[6]], None)]:
        for hypothesis in beam_search(model, prompt, BeamSearch(4, 4, penalty, False), 10, eos_token_id=ends):
            score = hypothesis_score(model, prompt, hypothesis.tokens, hypothesis.stop, penalty, ends)
            assert score == pytest.approx(hypothesis.score, rel=1e-5, abs=1e-4)
            stops.add(hypothesis.stop)
    assert stops == {"eos", "length"}
    # a hypothesis the model likes less scores lower
    (best,) = beam_search(model, prompt, BeamSearch(4), 6)
    worse = best.tokens[:-1] + [(best.tokens[-1] + 1) % model.config.vocab_size]
    assert hypothesis_score(model, prompt, worse, "length", 1.0) < best.score


@pytest.mark.slow
@pytest.mark.parametrize("attention", ["diffattention", "gqa"])
def test_check_folder_with_beams_and_a_broken_cache_reorder(folders, attention, tmp_path, monkeypatch):
    """`check FOLDER --num-beams 4` compares every hypothesis of the loop and of genai with eager
    beam search and passes on a correct folder, end ids met included; a loop whose cache rows do
    not follow their beams fails it, with the gap its worse hypotheses have under eager, while
    genai's own search still passes."""
    pytest.importorskip("onnxruntime_genai")
    from diffexport.backends import step_loop
    from diffexport.modeling.checkpoint import load_model
    from diffexport.validation.decoder import run_decoder_check
    from diffexport.validation.options import CheckOptions

    model, root, ckpt = folders["diff-v1-tiny"]
    loaded = load_model(ckpt)
    # the check's first prompt, its eager beams: an end id they meet
    import numpy as np

    first = np.random.default_rng(0).integers(0, model.config.vocab_size, size=9).tolist()
    end = beam_search(model, first, BeamSearch(4), 8)[0].tokens[4]
    folder = _with_end_ids(root[attention], tmp_path, [end])
    options = CheckOptions(provider="cpu", save_dir=tmp_path / "saved", beams=BeamSearch(4, 4))
    lines = []
    report = run_decoder_check(folder, loaded, options, log=lines.append, steps=12)
    assert report.passed, report.text()
    assert "beam hypotheses onnxruntime == eager: 12/12  PASS" in report.lines
    assert "beam hypotheses genai == eager: 12/12  PASS" in report.lines
    assert any(f"end ids {end}" in line for line in lines)

    def reordered_wrongly(step, *args, **kwargs):  # every cache row of the previous step's order, reversed
        return step_loop.search_beams.__wrapped__(
            lambda ids, order: step(ids, None if order is None else order[::-1]), *args, **kwargs)

    reordered_wrongly.__wrapped__ = step_loop.search_beams
    monkeypatch.setattr(step_loop, "search_beams", reordered_wrongly)
    report = run_decoder_check(folder, loaded, options, log=quiet, steps=12)
    assert not report.passed
    text = report.text()
    assert "beam hypotheses genai == eager: 12/12  PASS" in report.lines
    (line,) = [line for line in report.lines if line.startswith("beam hypotheses onnxruntime")]
    assert line.endswith("FAIL") and "/12; worst score gap under eager" in line
    assert float(line.split("gap under eager ")[1].split()[0]) > 1e-3  # worse beams, not a near-tie
    assert "onnxruntime prompt " in text and "parts at new token" in text, text


@pytest.mark.slow
def test_check_folder_with_beams_on_the_command_line(folders, tmp_path):
    _, root, ckpt = folders["diff-v2-tiny"]
    result = cli_main("check", root["gqa"], "--ckpt", ckpt, "--steps", "6",
                     "--num-beams", "3", "--length-penalty", "0.5", "--no-early-stopping",
                     "--save-dir", tmp_path / "saved")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "beam hypotheses onnxruntime == eager: 9/9  PASS" in result.stdout
    assert "3 beams (length penalty 0.5, no early stopping)" in result.stderr + result.stdout


def test_check_beams_past_genais_limit_check_the_loop_alone(folders, tmp_path):
    """genai takes at most 32 beams: the check says so and still holds the loop's 33 to eager."""
    _, root, ckpt = folders["diff-v2-tiny"]
    result = cli_main("check", root["diffattention"], "--ckpt", ckpt, "--steps", "2",
                     "--num-beams", "33", "--save-dir", tmp_path / "saved")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "onnxruntime-genai's own search not checked: onnxruntime-genai searches at most 32 beams, got 33\n" \
        in result.stdout
    assert "beam hypotheses onnxruntime == eager: 99/99  PASS" in result.stdout


@pytest.mark.parametrize("args,pattern", [
    (["--length-penalty", "2"], "--length-penalty and --no-early-stopping shape a beam search: add --num-beams"),
    (["--num-beams", "0"], "num beams must be an integer in 1..256"),
    (["--num-beams", "100000000", "--steps", "8"], "num beams must be an integer in 1..256"),
    (["--num-beams", "2", "--steps", "0"], "beam search needs at least one decode step"),
])
def test_check_beam_refusals(folders, args, pattern):
    _, root, ckpt = folders["diff-v2-tiny"]
    assert_one_line_error(cli_main("check", root["diffattention"], "--ckpt", ckpt,
                                  *args), pattern)


def test_check_beams_need_a_decoder(tmp_path):
    path = tmp_path / "m.onnx"
    path.write_bytes(b"not read")
    assert_one_line_error(cli_main("check", path, "--preset", "diff-v1-tiny", "--num-beams", "2"),
                          "--num-beams checks beam search on a --kv-cache folder")


@pytest.mark.slow
def test_check_hf_folder_beams_against_transformers(tmp_path):
    """For an HF DiffLlama folder at length penalty 0, `check --num-beams` also holds transformers'
    generate(num_beams=4) to the eager hypotheses, with an end id the beams meet; at another
    penalty it says why transformers is left out."""
    pytest.importorskip("onnxruntime_genai")
    import numpy as np

    from diffexport.export.decoder import export_decoder_graph as export_decoder
    from diffexport.modeling.checkpoint import load_model
    from diffexport.validation.decoder import run_decoder_check
    from diffexport.validation.options import CheckOptions

    _hf_diffllama().save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    export_decoder(loaded, tmp_path / "folder", log=quiet)
    first = np.random.default_rng(0).integers(0, 96, size=9).tolist()
    end = beam_search(loaded.model.eval(), first, BeamSearch(4, 4, 0.0), 8)[1].tokens[3]
    ended = beam_search(loaded.model.eval(), first, BeamSearch(4, 4, 0.0), 10, eos_token_id=[end])
    assert "eos" in {h.stop for h in ended}  # the search meets the end id
    folder = _with_end_ids(tmp_path / "folder", tmp_path / "ends", [end])
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu", save_dir=tmp_path / "saved",
                                                            beams=BeamSearch(4, 4, 0.0)), log=quiet, steps=10)
    assert report.passed, report.text()
    for runtime in ("onnxruntime", "genai", "transformers generate()"):
        assert f"beam hypotheses {runtime} == eager: 12/12  PASS" in report.lines, report.text()
    report = run_decoder_check(folder, loaded, CheckOptions(provider="cpu", save_dir=tmp_path / "saved",
                                                            beams=BeamSearch(2, 2, 1.0)), log=quiet, steps=4)
    assert report.passed and "compared with it at --length-penalty 0 only" in report.text()
    assert not any(line.startswith("beam hypotheses transformers") for line in report.lines)
