"""`diffexport generate` on a decoder folder, through the command line: ids streamed, chat templates,
prompts files, an interactive chat on stdin, stop strings, threads, and the requests it refuses."""


import json
import re
import shutil

import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from helpers import (  # noqa: E402
    assert_one_line_error,
    cli_main,
)

from diffexport.backends import base, genai, step_loop  # noqa: E402
from diffexport.core.eager_generation import Sampling  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


def _prompt_tokens(result) -> int:
    return int(re.search(r"prompt (\d+) tokens", result.stderr).group(1))


def test_generate_chat_puts_the_prompt_in_the_chat_template(artifacts, hf_chat_kv, tmp_path):
    """`generate --chat`: the prompt becomes a user turn (after --system) in the tokenizer's chat
    template, from tokenizer_config.json or the chat_template.jinja the export copies; a tokenizer
    without one is refused in one line."""
    og = pytest.importorskip("onnxruntime_genai")
    artifacts.copy(hf_chat_kv, tmp_path)  # this test changes its chat template
    assert (tmp_path / "kv" / "chat_template.jinja").is_file()
    tokenizer = og.Tokenizer(og.Model(str(tmp_path / "kv")))
    for extra, text in (([], "<s>user: the cat sat\n<s>assistant: "),
                        (["--system", "be brief"], "<s>system: be brief\n<s>user: the cat sat\n<s>assistant: ")):
        result = cli_main("generate", tmp_path / "kv", "--prompt", "the cat sat", "--chat", *extra,
                         "--max-new-tokens", "2")
        assert result.returncode == 0, result.stderr
        assert _prompt_tokens(result) == len(tokenizer.encode(text)) > len(tokenizer.encode("the cat sat"))
    (tmp_path / "kv" / "chat_template.jinja").write_bytes(b"a" * (1024**2 + 1))
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "larger than 1 MiB")
    (tmp_path / "kv" / "chat_template.jinja").unlink()
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "has no chat template")
    (tmp_path / "elsewhere.jinja").write_text("{{ messages[0]['content'] }}")
    (tmp_path / "kv" / "chat_template.jinja").symlink_to(tmp_path / "elsewhere.jinja")  # a link is never followed
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--chat"), "is a symbolic link")
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--ids", "1,2", "--chat"), "give --prompt")
    assert_one_line_error(cli_main("generate", tmp_path / "kv", "--prompt", "hi", "--system", "x"), "add --chat")


def test_generate_streams_ids_and_samples_reproducibly(v1_folder):
    pytest.importorskip("onnxruntime_genai")
    first = cli_main("generate", v1_folder, "--ids", "1,2,3", "--max-new-tokens", "6", "--sample", "--top-k", "5",
                    "--seed", "3")
    again = cli_main("generate", v1_folder, "--ids", "1,2,3", "--max-new-tokens", "6", "--sample", "--top-k", "5",
                    "--seed", "3")
    assert first.returncode == 0 and first.stdout == again.stdout, first.stderr
    assert len(first.stdout.split()) <= 6 and all(t.isdigit() for t in first.stdout.split())


def test_generate_bad_requests(v1_folder):
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "0"),
                          "--max-new-tokens must be >= 1")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "-3"),
                          "--max-new-tokens must be >= 1")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,2", "--max-new-tokens", "2047"),
                          "exceeds the context length 2048")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,x"), "comma-separated integers")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1,99999"), "token ids in [0, 512)")
    assert_one_line_error(cli_main("generate", v1_folder, "--prompt", "hello"), "has no tokenizer")
    assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1", "--sample", "--top-p", "0"), "top-p")
    for seed in ("-1", str(2**40)):  # genai draws a fresh seed each run for -1, and takes 32 bits: check's rule
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "1", "--sample", "--seed", seed),
                              "--seed must be an integer in 0..2147483647 when sampling")


def test_generate_prompts_file_with_text_and_chat(hf_chat_kv, tmp_path):
    """`generate --prompts-file` with text prompts (the folder's tokenizer, --chat templating each)
    and ids (one ending with the pad id, 0 here): every answer is what the prompt gives alone, and
    its completion is the tokenizer's text of its tokens."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_chat_kv
    lines = [{"prompt": "the cat sat", "id": "a"}, {"prompt": "on a mat, said the dog"}, {"ids": [5, 6, 0]}]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    for chat in ([], ["--chat"]):
        out = cli_main("generate", kv, "--prompts-file", tmp_path / "p.jsonl", *chat, "--batch-size", "2",
                      "--max-new-tokens", "6")
        assert out.returncode == 0, out.stderr
        answers = [json.loads(line) for line in out.stdout.splitlines()]
        assert [a["line"] for a in answers] == [1, 2, 3] and answers[0]["id"] == "a" and "id" not in answers[1]
        for line, answer in zip(lines, answers):
            if "ids" in line:
                ids = line["ids"]
            else:
                template = (kv / "chat_template.jinja").read_text()
                text = tokenizer.apply_chat_template(json.dumps([{"role": "user", "content": line["prompt"]}]),
                                                     template_str=template, add_generation_prompt=True) \
                    if chat else line["prompt"]
                ids = [int(t) for t in tokenizer.encode(text)]
            alone = genai.generate_genai(kv, ids, 6, Sampling())
            assert answer["tokens"] == alone.tokens and answer["stop"] == alone.stop
            spoken = alone.tokens[:-1] if alone.stop == "eos" else alone.tokens
            assert answer["completion"] == tokenizer.decode(spoken)


def test_generate_interactive_is_a_chat_over_stdin(hf_chat_kv):
    """`generate --interactive`: every stdin line is a user turn (blank lines skipped), answered in the
    chat template with the conversation so far, the answers streamed one per line; on both backends
    each answer is what a single templated prompt of that conversation gives. When the conversation
    passes the context the oldest turns go; a turn too long alone is not answered, said on stderr,
    and the session goes on to exit 2."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_chat_kv
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    template = (kv / "chat_template.jinja").read_text()

    def ids_of(messages):
        text = tokenizer.apply_chat_template(json.dumps(messages), template_str=template, add_generation_prompt=True)
        return [int(t) for t in tokenizer.encode(text)]

    def answer(messages, new=10):  # as the session streams it (a random model's bytes need not be UTF-8)
        run = genai.generate_genai(kv, ids_of(messages), new, Sampling())
        stream = tokenizer.create_stream()
        return "".join(stream.decode(t) for t in (run.tokens[:-1] if run.stop == "eos" else run.tokens))

    system = {"role": "system", "content": "be brief"}
    first, second = {"role": "user", "content": "the cat sat"}, {"role": "user", "content": "on a mat, said the dog"}
    one = answer([system, first])
    two = answer([system, first, {"role": "assistant", "content": one}, second])
    long_turn = {"role": "user", "content": " ".join(["the dog sat on the mat"] * 26)}
    after_drop = answer([system, long_turn])
    assert len(ids_of([system, long_turn])) + 10 <= 512  # one long turn fits the context, two do not
    assert len(ids_of([system, long_turn, {"role": "assistant", "content": after_drop}, long_turn])) + 10 > 512
    too_long = " ".join(["the dog sat on the mat"] * 80)
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--interactive", "--system", "be brief", "--max-new-tokens", "10",
                      "--backend", backend, stdin=f"{first['content']}\n\n{second['content']}\n")
        assert out.returncode == 0, out.stderr
        assert out.stdout == f"{one}\n{two}\n" and out.stderr.count("new tokens in") == 2
        conversation, read = map(int, re.findall(r"conversation (\d+) tokens, (\d+) read", out.stderr)[1])
        assert read < conversation  # the session kept its cache
        out = cli_main("generate", kv, "--interactive", "--system", "be brief", "--max-new-tokens", "10",
                      "--backend", backend, stdin=f"{long_turn['content']}\n{too_long}\n{long_turn['content']}\n")
        assert out.returncode == 2, out.stderr  # the session went on, its status says a turn was not answered
        assert "exceeds the context length 512: not answered" in out.stderr and "dropped the oldest turn" in out.stderr
        assert out.stdout.splitlines()[-1] == after_drop  # the same long turn again, its first exchange dropped
    assert_one_line_error(cli_main("generate", kv, "--interactive", "--chat"), "drop --chat")


def test_generate_interactive_refuses_bad_input(hf_kv, hf_chat_kv, v1_folder):
    """--interactive's inputs: a folder without a tokenizer or a chat template, and stdin that is not
    UTF-8 or has a line over 1 MiB (refused before more of it is read): one line, exit 2."""
    pytest.importorskip("onnxruntime_genai")
    plain, kv = hf_kv, hf_chat_kv  # without and with a chat template
    assert_one_line_error(cli_main("generate", v1_folder, "--interactive", stdin="hi\n"), "has no tokenizer")
    assert_one_line_error(cli_main("generate", plain, "--interactive", stdin="hi\n"),
                          "has no chat template")
    assert_one_line_error(cli_main("generate", kv, "--interactive", stdin=b"\n caf\xe9\n"),
                          "stdin line 2 is not UTF-8 text")
    assert_one_line_error(cli_main("generate", kv, "--interactive", stdin=b"x" * (2**20 + 5)),
                          "stdin line 1 is longer than 1 MiB")
    out = cli_main("generate", kv, "--interactive", "--max-new-tokens", "2", stdin="")
    assert out.returncode == 0 and out.stdout == ""  # no turn: nothing to answer


def test_a_chat_template_that_raises_mid_session_is_one_line(hf_chat_kv, tmp_path):
    """A folder's template that answers the first turn and raises on the second (raise_exception, as
    transformers' templates do): the first answer is given, then one error line naming the template's
    message, exit 2, not a Jinja traceback."""
    pytest.importorskip("onnxruntime_genai")
    folder = shutil.copytree(hf_chat_kv, tmp_path / "kv")
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(
        "{% if messages | length > 2 %}{{ raise_exception('this template takes one turn') }}{% endif %}" + template)
    out = cli_main("generate", folder, "--interactive", "--max-new-tokens", "2", stdin="hello\nagain\n")
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors == ["error: the chat template refused the conversation: this template takes one turn"], out.stderr
    assert out.stderr.rstrip().endswith(errors[0]) and out.stderr.count("new tokens in") == 1  # turn 1 answered
    assert len(out.stdout.splitlines()) == 1


def test_generate_stops_at_stop_strings(hf_kv, tmp_path):
    """--stop ends an answer where its text first holds the string: the streamed text and a prompts
    file's completion are the free answer's text before it, the tokens the free answer's up to the
    one that completed it, on both backends; --stop needs text."""
    og = pytest.importorskip("onnxruntime_genai")
    kv = hf_kv
    tokenizer = og.Tokenizer(og.Model(str(kv)))
    prompts = ["the cat sat", "on a mat, said the dog"]
    free = {}
    for prompt in prompts:
        run = genai.generate_genai(kv, [int(t) for t in tokenizer.encode(prompt)], 24, Sampling(),
                                   min_new_tokens=24)
        free[prompt] = (run.tokens, tokenizer.decode(run.tokens))
    tokens, text = free[prompts[0]]
    stop = text[len(text) // 2:len(text) // 2 + 2]  # two characters from the middle of the free answer
    assert stop and text.index(stop) > 0
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--prompt", prompts[0], "--max-new-tokens", "24", "--stop", stop,
                      "--stop", "\u2603 never", "--backend", backend)
        assert out.returncode == 0, out.stderr
        assert out.stdout == text[:text.index(stop)] + "\n" and "stopped: stop_string" in out.stderr
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", kv, "--prompts-file", tmp_path / "p.jsonl", "--max-new-tokens", "24",
                      "--stop", stop, "--backend", backend)
        assert out.returncode == 0, out.stderr
        for prompt, answer in zip(prompts, map(json.loads, out.stdout.splitlines())):
            tokens, text = free[prompt]
            if stop in text:
                assert answer["stop"] == "stop_string" and answer["completion"] == text[:text.index(stop)]
                assert tokens[:len(answer["tokens"])] == answer["tokens"]
                assert stop in tokenizer.decode(answer["tokens"])
                assert stop not in tokenizer.decode(answer["tokens"][:-1])
            else:
                assert answer["stop"] != "stop_string" and answer["tokens"] == tokens[:len(answer["tokens"])]
    # each line's own "stop" in place of --stop's ([] for none), on both backends
    tokens, text = free[prompts[0]]
    for cli_stop, own in (([], stop), (["--stop", stop], [])):
        (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": prompts[0], "stop": own}) + "\n" +
                                            json.dumps({"prompt": prompts[0]}) + "\n")
        for backend in ("genai", "onnxruntime"):
            out = cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl", "--max-new-tokens",
                          "24", *cli_stop, "--backend", backend)
            assert out.returncode == 0, out.stderr
            answers = [json.loads(line) for line in out.stdout.splitlines()]
            cut, whole = (answers[0], answers[1]) if own else (answers[1], answers[0])
            assert cut["stop"] == "stop_string" and cut["completion"] == text[:text.index(stop)]
            assert whole["stop"] != "stop_string" and whole["tokens"] == tokens[:len(whole["tokens"])]
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl",
                                  "--num-beams", "2", "--stop", stop), "drop --stop")
    (tmp_path / "own.jsonl").write_text(json.dumps({"prompt": prompts[0], "stop": "x"}) + "\n")
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "own.jsonl",
                                  "--num-beams", "2"), "own.jsonl line 1: stop ends one streamed answer")
    assert_one_line_error(cli_main("generate", kv, "--ids", "5,6", "--stop", "x"),
                          "--stop matches generated text")
    (tmp_path / "ids.jsonl").write_text('{"ids": [5, 6]}\n')
    assert_one_line_error(cli_main("generate", kv, "--prompts-file", tmp_path / "ids.jsonl", "--stop", "x"),
                          "--stop matches generated text: the prompts file gives token ids only")
    assert_one_line_error(cli_main("generate", kv, "--prompt", "hi", "--stop", ""), "--stop needs non-empty text")


def test_genai_runs_on_the_machines_cores_unless_the_folder_says(v1_folder, tmp_path, monkeypatch):
    """onnxruntime-genai's default is one intra-op thread: a folder without --threads is opened with
    this machine's physical cores (overlaid, the folder not edited); a folder's own count is kept."""
    pytest.importorskip("onnxruntime_genai")
    og = genai.import_genai()
    overlays = []

    class RecordingConfig(og.Config):
        def overlay(self, text):
            overlays.append(json.loads(text))
            return super().overlay(text)

    monkeypatch.setattr(genai, "import_genai", lambda: type("og", (), {"Config": RecordingConfig,
                                                                          "Model": og.Model})())
    assert base.machine_threads() >= 1
    genai.open_genai_model(v1_folder)
    assert overlays == [{"model": {"decoder": {"session_options": {
        "intra_op_num_threads": base.machine_threads()}}}}]
    own = tmp_path / "own"
    shutil.copytree(v1_folder, own)
    config = json.loads((own / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    (own / "genai_config.json").write_text(json.dumps(config))
    overlays.clear()
    genai.open_genai_model(own)
    assert overlays == [] and json.loads((own / "genai_config.json").read_text()) == config


def test_generate_threads_overrides_the_folder(v1_folder, tmp_path):
    """`generate --threads N` (issue 46 j): genai and the onnxruntime loop run on N intra-op threads
    whatever the folder says, seen in the threads the process starts; out of range is one line."""
    pytest.importorskip("onnxruntime_genai")

    def threads_started(open_model) -> int:
        before = int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])
        held = open_model()
        after = int(next(line for line in open("/proc/self/status") if line.startswith("Threads:")).split()[1])
        del held
        return after - before

    own = tmp_path / "own"
    shutil.copytree(v1_folder, own)
    config = json.loads((own / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["intra_op_num_threads"] = 1
    (own / "genai_config.json").write_text(json.dumps(config))
    folder_says = threads_started(lambda: genai.open_genai_model(own))
    with base.intra_op_threads(6):
        user_says = threads_started(lambda: genai.open_genai_model(own))
        loop = step_loop.OrtDecoder(own)
    assert user_says >= folder_says + 5, (folder_says, user_says)
    assert loop.session.get_session_options().intra_op_num_threads == 6
    assert base.INTRA_OP_THREADS.get() is None  # only within
    result = cli_main("generate", own, "--ids", "1,2,3", "--max-new-tokens", "2", "--threads", "3")
    assert result.returncode == 0, result.stderr
    assert_one_line_error(cli_main("generate", own, "--ids", "1,2", "--threads", "0"), "--threads must be 1 to 1024, "
                                                                                       "got 0")
