"""The generation API (generation/text_generation.py) called as Python, not through argparse: a
generate request refuses its clashes on creation, and a prompts file is answered on an opened
runtime in the file's order, each line with its own limit."""

import json

import pytest

from diffexport.backends.runtimes import open_runtime
from diffexport.core.eager_generation import BeamSearch, Sampling
from diffexport.core.errors import DiffExportError
from diffexport.format.decoder_folder import read_decoder_folder
from diffexport.generation.text_generation import GenerateRequest, answer_prompt_rows, read_prompt_rows


@pytest.mark.parametrize("kwargs, message", [
    (dict(), "give one of a prompt, ids, an interactive chat or a prompts file, not none"),
    (dict(prompt="hi", ids="1,2"), "not prompt and ids"),
    (dict(prompt="hi", max_new_tokens=0), "--max-new-tokens must be >= 1, got 0"),
    (dict(ids="1,2", chat=True), "--chat and --system template a text prompt"),
    (dict(prompt="hi", system="be brief"), "--system is a turn of the chat template: add --chat"),
    (dict(prompt="hi", stop=("",)), "--stop needs non-empty text"),
    (dict(prompt="hi", batch_size=4), "--batch-size groups the prompts of --prompts-file"),
    (dict(prompt="hi", sort_by_length=True), "--sort-by-length groups the prompts of --prompts-file"),
    (dict(interactive=True, chat=True), "--interactive is a chat already"),
    (dict(prompts_file="p.jsonl", batch_size=0), "the batch size must be >= 1, got 0"),
    (dict(ids="1,2", stop=("x",)), "--stop matches generated text"),
    (dict(prompt="hi", num_beams=4, sample=True), "--sample: beam search is deterministic"),
    (dict(prompt="hi", length_penalty=2.0), "--length-penalty is a beam search option"),
    (dict(prompts_file="p.jsonl", num_beams=2, batch_size=2), "beam search runs one prompt at a time"),
])
def test_a_request_refuses_its_clashes_on_creation(kwargs, message):
    with pytest.raises(DiffExportError) as caught:
        GenerateRequest(**kwargs)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_a_request_gives_its_search_batch_and_draw():
    request = GenerateRequest(prompt="hi", num_beams=3, num_return_sequences=2, length_penalty=0.5)
    assert request.search == BeamSearch(3, 2, 0.5, True) and GenerateRequest(ids="1").search is None
    assert GenerateRequest(prompts_file="p.jsonl").batch == 8
    assert GenerateRequest(prompts_file="p.jsonl", batch_size=3, sort_by_length=True).batch == 3
    config = {"search": {"do_sample": False, "temperature": 1.0, "top_k": 0, "top_p": 1.0,
                         "repetition_penalty": 1.0}}
    drawn = GenerateRequest(ids="1", sample=True, temperature=0.5, seed=7).sampling(config)
    assert (drawn.greedy, drawn.temperature, drawn.seed) == (False, 0.5, 7)


def test_a_prompts_file_is_answered_on_a_runtime_in_its_order(artifacts, tmp_path):
    """Token-id prompts, two with their own limits, answered in batches of 2 longest first on the step
    loop: each answer as the runtime gives that prompt alone, in the file's order."""
    folder = artifacts.decoder("diff-v1-gqa", "gqa")
    _, config, _ = read_decoder_folder(folder)
    prompts = [[5, 17, 42], [9], [300, 12, 77, 8, 1], [64, 2]]
    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"ids": p, "id": f"p{i}", **({"max_new_tokens": 3} if i % 2 else {})})
                              for i, p in enumerate(prompts)) + "\n")
    rows = read_prompt_rows(folder, config, path, 6)
    assert rows.limits == [6, 3, 6, 3] and rows.tokenizer is None
    runtime = open_runtime("onnxruntime", folder, provider="cpu")
    logged = []
    answers = list(answer_prompt_rows(runtime, config, rows, Sampling(), batch_size=2, sort_by_length=True,
                                      log=logged.append))
    assert [a["id"] for a in answers] == ["p0", "p1", "p2", "p3"] and [a["line"] for a in answers] == [1, 2, 3, 4]
    for answer, prompt, limit in zip(answers, prompts, rows.limits):
        assert answer["tokens"] == runtime.generate(prompt, limit, Sampling()).tokens
    assert any(line.startswith("onnxruntime: 4 prompts") for line in logged), logged


def test_a_chat_session_on_a_runtime_answers_each_turn_as_a_fresh_prompt(hf_chat_kv):
    """ChatSession called as Python: each turn's answer is what the whole templated conversation gives
    as one prompt from scratch, and the second turn reads only what the cache does not hold."""
    pytest.importorskip("onnxruntime_genai")
    from diffexport.generation.text_generation import ChatSession, conversation_text, folder_tokenizer

    _, config, _ = read_decoder_folder(hf_chat_kv)
    runtime = open_runtime("onnxruntime", hf_chat_kv, provider="cpu")
    tokenizer = folder_tokenizer(hf_chat_kv)
    session = ChatSession(runtime, config, Sampling(), 8, system="be brief")
    messages = [{"role": "system", "content": "be brief"}]
    for turn in ("the cat sat", "on a mat"):
        shown = []
        run = session.turn(turn, shown.append)
        messages.append({"role": "user", "content": turn})
        ids = [int(t) for t in tokenizer.encode(conversation_text(tokenizer, hf_chat_kv, messages))]
        assert run.tokens == runtime.generate(ids, 8, Sampling()).tokens
        messages.append({"role": "assistant", "content": "".join(shown)})
        assert session.history.turns[-1] == messages[-1]
    assert run.prompt_tokens < len(ids)  # the second turn: the cache of the first was kept
