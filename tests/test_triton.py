"""Serving a KV-cache folder with NVIDIA Triton Inference Server (`diffexport triton`): the model
repository, the batching and streaming model in-process, and the real server (nvidia-pytriton's
bundled tritonserver, the `serve` extra) on 127.0.0.1: greedy answers token for token those of
`diffexport generate`, streaming as the unary call, concurrent clients each with their own answer,
bad requests and gone clients refused or dropped while the server keeps serving, a clean stop."""

import http.client
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import assert_one_line_error, checkout_env, cli_main, process_ends

from diffexport.core.eager_generation import Sampling
from diffexport.core.errors import DiffExportError

pytestmark = pytest.mark.slow  # an export, and a server start: see README (quick loop)

PROMPTS = ["hello world", "the cat sat on", "a", "differential attention cancels noise"]
GREEDY = Sampling(greedy=True)


@pytest.fixture(scope="module")
def folder(artifacts):
    """An HF DiffLlama KV-cache folder with its byte-level BPE tokenizer (built once per session)."""
    return artifacts.cli_output("onnx", artifacts.hf_diffllama_with_chat_template(), "--kv-cache", output="kv")


@pytest.fixture(scope="module")
def alone(folder):
    """prompt text -> what `diffexport generate --greedy` gives it alone: (new ids, the end id left
    out; their text; their text through the tokenizer's stream decoder)."""
    from diffexport.backends.runtimes import open_runtime
    from diffexport.format.decoder_folder import eos_token_ids, read_decoder_folder
    from diffexport.generation.text_generation import encode, folder_tokenizer

    config = read_decoder_folder(folder)[1]
    tokenizer, eos = folder_tokenizer(folder), set(eos_token_ids(config))
    answers = {}
    for prompt in PROMPTS:
        run = open_runtime("genai", folder).generate(encode(tokenizer, folder, prompt), 12, GREEDY)
        ids = run.tokens[:-1] if run.tokens and run.tokens[-1] in eos else run.tokens
        stream = tokenizer.create_stream()
        answers[prompt] = (ids, tokenizer.decode(ids), "".join(stream.decode(t) for t in ids))
    return answers


def streamed(answer):
    """What a stream gives of an answer: its ids, and the text the tokenizer's stream decoder gives
    them piece by piece (it holds back the bytes of an unfinished character, where decoding the whole
    answer at once turns invalid bytes into U+FFFD: this random model's bytes often are)."""
    ids, _, pieces = answer
    return ids, pieces


# ---------------------------------------------------------------- the repository (no server)


def test_repository_layout_and_config(folder, tmp_path):
    from diffexport.serving.repository import INPUTS, OUTPUTS, write_repository

    repo = write_repository(folder, tmp_path / "repo", name="diff", max_batch=4, instances=2)
    assert repo.text and not repo.gpu
    config = (tmp_path / "repo" / "diff" / "config.pbtxt").read_text()
    for name, kind, _, _ in INPUTS:
        assert f'name: "{name}"\n    data_type: {kind}' in config
    for name, kind, _ in OUTPUTS:
        assert f'name: "{name}"\n    data_type: {kind}' in config
    assert "decoupled: true" in config and "count: 2\n    kind: KIND_CPU" in config and '"4"' in config
    assert 'key: "scheduler"\n  value: { string_value: "inflight" }' in config  # the default
    copied = sorted(p.name for p in repo.folder.iterdir())
    assert copied == sorted(p.name for p in folder.iterdir() if p.is_file())
    assert "from diffexport.serving.triton_model import TritonPythonModel" in \
        (tmp_path / "repo" / "diff" / "1" / "model.py").read_text()


def test_repository_refusals(folder, tmp_path, artifacts, monkeypatch):
    from diffexport.serving.repository import write_repository

    with pytest.raises(DiffExportError, match="model name"):
        write_repository(folder, tmp_path / "r", name="../x")
    with pytest.raises(DiffExportError, match="--max-batch must be 1 to 32"):
        write_repository(folder, tmp_path / "r", max_batch=33)
    with pytest.raises(DiffExportError, match="--instances"):
        write_repository(folder, tmp_path / "r", instances=0)
    with pytest.raises(DiffExportError, match="unknown --scheduler 'fifo'"):
        write_repository(folder, tmp_path / "r", scheduler="fifo")
    # a bfloat16 folder (read here as one): the in-flight scheduler's onnxruntime loop cannot feed its cache
    from diffexport.format.metadata import ExportMetadata
    from diffexport.serving import repository

    real = repository.read_decoder_folder(folder)
    bf16 = ExportMetadata({**real[2], "dtype": "bfloat16"})
    monkeypatch.setattr(repository, "read_decoder_folder", lambda path: (real[0], real[1], bf16))
    with pytest.raises(DiffExportError, match="--scheduler inflight .* use --scheduler batch"):
        write_repository(folder, tmp_path / "r")
    batch = write_repository(folder, tmp_path / "bf16-batch", scheduler="batch").path
    assert 'string_value: "batch"' in next(batch.glob("*/config.pbtxt")).read_text()
    shutil.rmtree(batch)
    monkeypatch.undo()
    with pytest.raises(DiffExportError, match="is not a folder"):
        write_repository(tmp_path / "nope", tmp_path / "r")
    (tmp_path / "r").mkdir()
    with pytest.raises(DiffExportError, match="already exists"):
        write_repository(folder, tmp_path / "r")
    (tmp_path / "link").symlink_to(tmp_path / "r")
    with pytest.raises(DiffExportError, match="symbolic link"):
        write_repository(folder, tmp_path / "link", force=True)
    # a hostile genai_config (a library onnxruntime-genai would load) is refused by generate's reader
    hostile = artifacts.copy(folder, tmp_path, "hostile")
    config = json.loads((hostile / "genai_config.json").read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = "libevil.so"
    (hostile / "genai_config.json").write_text(json.dumps(config))
    with pytest.raises(DiffExportError, match="custom_ops_library"):
        write_repository(hostile, tmp_path / "r2")
    assert not (tmp_path / "r2").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hostile", "link", "r"]


def test_triton_command_line(folder, tmp_path):
    result = cli_main("triton", folder, "-o", tmp_path / "repo", "--name", "m")
    assert result.returncode == 0, result.stderr
    assert "wrote         " in result.stdout and (tmp_path / "repo" / "m" / "config.pbtxt").is_file()
    assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "repo", "--name", "m"), "already exists")
    assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--max-batch", "0"), "--max-batch")
    assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--scheduler", "fifo"), "--scheduler")
    result = cli_main("triton", folder, "-o", tmp_path / "batch", "--scheduler", "batch")
    assert result.returncode == 0 and "(batch scheduler)" in result.stdout
    assert 'string_value: "batch"' in next((tmp_path / "batch").glob("*/config.pbtxt")).read_text()
    for ports, pattern in ((("--http-port", "0"), "--http-port 0 is not in 1..65535"),
                           (("--http-port", "9000", "--grpc-port", "9000"), "--grpc-port must differ"),
                           (("--metrics-port", "8001"), "--grpc-port and --metrics-port must differ")):
        assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--serve", *ports), pattern)
    assert not (tmp_path / "r").exists()  # refused before the repository was written
    assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--metrics-port", "9100"), "for --serve")
    with socket.socket() as taken:  # a metrics port another server holds is refused like the others
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--serve", "--http-port",
                                       str(_free_port()), "--grpc-port", str(_free_port()), "--metrics-port",
                                       str(port)), f"port {port} on 127.0.0.1 is taken")
    assert not (tmp_path / "r").exists()


# ---------------------------------------------------------------- the model in-process (no server)


class Collected:
    """A request's responses as the server would send them."""

    def __init__(self):
        self.ids, self.text, self.final, self.error, self.done = [], "", False, None, threading.Event()

    def send(self, ids, text, final):
        self.ids += list(ids)
        self.text += text or ""
        if final:
            self.final = True
            self.done.set()

    def fail(self, message):
        self.error = message
        self.done.set()


@pytest.fixture(scope="module", params=["inflight", "batch"])
def service(folder, request):
    from diffexport.serving.triton_model import DecoderService

    service = DecoderService(folder, max_batch=4, scheduler=request.param)
    yield service
    service.stop()


def _ask(service, prompt, stream=False, max_tokens=12, sampling=GREEDY, cancelled=lambda: False, ids=None,
         stops=(), echo=None):
    """Submit a prompt (its ids when given: encoding takes a forked child's time) -> its responses."""
    from diffexport.serving.triton_model import Request

    out = Collected()
    ids = service.prompt(prompt.encode(), None) if ids is None else ids
    service.submit(Request(ids, service.check_length(ids, max_tokens), sampling, stream, out.send, out.fail,
                           cancelled, stops=service.stop_words(stops), echo=service.echoed(echo, prompt, ids)))
    return out


def _stop_word(text: str) -> tuple[str, str]:
    """A stop word from the middle of an answer's text -> (it, the text before its first occurrence)."""
    word = next((text[k:k + 2] for k in range(len(text) // 2, len(text) - 1)
                 if text[k:k + 2].strip() and text.find(text[k:k + 2]) > 0), None)
    assert word is not None, text  # a stop that cuts the answer inside it (this could fail)
    return word, text[:text.find(word)]


def test_batched_requests_answer_as_each_alone(service, alone):
    """Requests submitted together are decoded as one batch; greedy rows give what each prompt gives
    alone, streamed or not. The service's metrics count what it sent: a first token per request, a
    gap per later token, every token, and the gauges back at zero once all have ended."""
    metrics = service.metrics
    before = (metrics.first_tokens, metrics.token_gaps, metrics.tokens)
    answers = [_ask(service, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
    for i, (prompt, out) in enumerate(zip(PROMPTS, answers)):
        assert out.done.wait(60) and out.error is None and out.final
        want = streamed(alone[prompt]) if i % 2 else alone[prompt][:2]
        assert (out.ids, out.text) == want, prompt
    sent = [len(out.ids) for out in answers]
    assert min(sent) > 0  # every answer has a first token (this could fail)
    assert (metrics.first_tokens, metrics.token_gaps, metrics.tokens) == \
        (before[0] + len(sent), before[1] + sum(sent) - len(sent), before[2] + sum(sent))
    assert 0 < metrics.first_token_seconds and 0 < metrics.token_gap_seconds
    deadline = time.monotonic() + 10
    while (metrics.waiting, metrics.rows) != (0, 0) and time.monotonic() < deadline:
        time.sleep(0.01)  # the worker reports after it has answered
    assert (metrics.waiting, metrics.rows) == (0, 0)


@pytest.mark.parametrize("stream", [False, True])
def test_stop_words_and_echo_as_the_llm_contract_names_them(service, alone, stream):
    """stop_words: the answer's text ends before the first of them (streamed text is held back while
    it could still begin one), and the row stops there; exclude_input_in_output false: the prompt
    comes first, ids and text."""
    prompt = PROMPTS[1]
    ids, _, pieces = alone[prompt]
    word, before = _stop_word(pieces)
    cut = _ask(service, prompt, stream=stream, stops=[word.encode(), b""])
    echoed = _ask(service, prompt, stream=stream, echo=False)
    assert cut.done.wait(60) and echoed.done.wait(60) and cut.error is None and echoed.error is None
    assert cut.text == before and len(cut.ids) < len(ids) and cut.ids == ids[:len(cut.ids)]
    prompt_ids = service.prompt(prompt.encode(), None)
    assert echoed.ids == prompt_ids + ids
    assert echoed.text == prompt + (pieces if stream else alone[prompt][1])


@pytest.mark.parametrize("call, pattern", [
    (lambda s: s.stop_words([b"x"] * 17), "at most 16"),
    (lambda s: s.stop_words([b"x" * 300]), "larger than 256 bytes"),
    (lambda s: s.stop_words([b"\xff"]), "not UTF-8"),
    (lambda s: s.check_penalty("presence_penalty", 0.5), "presence_penalty is not supported"),
])
def test_bad_contract_inputs_are_one_line(service, call, pattern):
    with pytest.raises(DiffExportError, match=pattern):
        call(service)
    assert service.stop_words([b""]) == () and service.check_penalty("frequency_penalty", 0.0) is None


def test_a_request_joins_a_running_answer_and_does_not_wait_for_it(folder, alone):
    """In-flight: a request that arrives while a long answer streams (submitted when that answer's
    third token is sent, from the worker itself, so the timing is the schedule's and not the test
    machine's) is answered before that one ends, and both answers are those of generate alone."""
    from diffexport.backends.runtimes import open_runtime
    from diffexport.serving.triton_model import DecoderService, Request

    service = DecoderService(folder, max_batch=4, scheduler="inflight")
    try:
        long_ids, short_ids = (service.prompt(p.encode(), None) for p in (PROMPTS[3], PROMPTS[1]))
        want = open_runtime("genai", folder).generate(long_ids, 40, GREEDY).tokens
        assert len(want) == 40  # no end id before 40 tokens: the long answer runs on (this could fail)
        short, long, streamed_when_short_ended = Collected(), Collected(), []

        def long_send(ids, text, final):
            Collected.send(long, ids, text, final)
            if len(long.ids) == 3 and ids:
                service.submit(Request(short_ids, 12, GREEDY, False, short_send, short.fail))

        def short_send(ids, text, final):
            streamed_when_short_ended.append(len(long.ids))
            Collected.send(short, ids, text, final)

        service.submit(Request(long_ids, 40, GREEDY, True, long_send, long.fail))
        assert short.done.wait(60) and long.done.wait(60) and short.error is None and long.error is None
        assert streamed_when_short_ended[-1] < 40  # the short answer ended while the long one ran
        assert (short.ids, short.text) == alone[PROMPTS[1]][:2] and long.ids == want
    finally:
        service.stop()


def test_a_gone_client_stops_its_row_only(service, alone):
    gone = threading.Event()
    dropped = _ask(service, PROMPTS[0], stream=True, cancelled=gone.is_set)
    kept = _ask(service, PROMPTS[1], stream=True)
    gone.set()
    assert dropped.done.wait(60) and kept.done.wait(60)
    assert (kept.ids, kept.text) == streamed(alone[PROMPTS[1]])
    assert len(dropped.ids) <= len(alone[PROMPTS[0]][0])  # ended early, or refused before it started
    assert dropped.final or dropped.error == "the request was cancelled"


@pytest.mark.parametrize("call, pattern", [
    (lambda s: s.prompt(None, None), "text_input or as input_ids"),
    (lambda s: s.prompt(b"x", [1]), "text_input or as input_ids"),
    (lambda s: s.prompt(None, []), "input_ids is empty"),
    (lambda s: s.prompt(None, [1, 10**6]), "outside the vocabulary"),
    (lambda s: s.prompt(None, [1] * 10**6), "leave no room"),
    (lambda s: s.prompt(b"\xff\xfe", None), "not UTF-8"),
    (lambda s: s.prompt(b"x" * (2 << 20), None), "larger than 1 MiB"),
    (lambda s: s.check_length([1] * 600, 4), "leave no room"),
    (lambda s: s.check_length([1] * 10, 600), "exceeds the context length"),
    (lambda s: s.check_length([1], 0), "max_tokens must be >= 1"),
    (lambda s: s.draw(float("nan"), None, None, None), "temperature"),
    (lambda s: s.draw(None, -1, None, None), "top_k"),
    (lambda s: s.draw(None, None, 0.0, None), "top_p"),
    (lambda s: s.draw(None, None, None, 2**40), "seed"),
])
def test_bad_requests_are_one_line(service, call, pattern):
    with pytest.raises(DiffExportError, match=pattern):
        call(service)


def test_the_model_refuses_a_folder_changed_after_the_repository_was_written(folder, tmp_path):
    """The copy in the repository is read again when Triton loads the model: a library named since
    is refused in the reader's words, and the model does not load."""
    from diffexport.serving.repository import write_repository
    from diffexport.serving.triton_model import TritonPythonModel

    repo = write_repository(folder, tmp_path / "repo", name="diff")
    path = repo.folder / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"]["session_options"]["custom_ops_library"] = "libevil.so"
    path.write_text(json.dumps(config))
    model_config = (tmp_path / "repo" / "diff" / "config.pbtxt").read_text()
    args = {"model_repository": str(tmp_path / "repo" / "diff"), "model_version": "1",
            "model_config": json.dumps({"parameters": {"decoder_folder": {"string_value": "decoder"},
                                                       "max_batch": {"string_value": "8"}}})}
    assert '"decoder"' in model_config and '"8"' in model_config  # what the server hands initialize
    with pytest.raises(RuntimeError, match="custom_ops_library"):
        TritonPythonModel().initialize(args)


# ---------------------------------------------------------------- the real server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    from diffexport.serving import server as triton_server
    from diffexport.serving.repository import write_repository

    try:
        triton_server.find_tritonserver()
        triton_server.check_bundled_numpy() if triton_server.find_tritonserver().bundled_root else None
    except DiffExportError as exc:
        pytest.skip(f"no Triton server to test against: {exc}")
    repo = write_repository(folder, tmp_path_factory.mktemp("triton") / "repo", name="diff", max_batch=8)
    running = triton_server.start_server(repo.path, _free_port(), _free_port(), ready_timeout=90,
                                         metrics_port=_free_port())
    yield running
    assert running.stop() == 0, running.log.read_text(errors="replace")[-2000:]


def _post(server, path, body, timeout=60):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=timeout)
    try:
        connection.request("POST", f"/v2/models/diff/{path}", json.dumps(body), {"Content-Type": "application/json"})
        reply = connection.getresponse()
        return reply.status, reply.read().decode()
    finally:
        connection.close()


def _events(text):
    return [json.loads(line[len("data: "):]) for line in text.splitlines() if line.startswith("data: ")]


def test_server_greedy_and_streamed_answers_are_those_of_generate(server, alone):
    for prompt in PROMPTS:
        status, body = _post(server, "generate", {"text_input": prompt, "max_tokens": 12, "temperature": 0})
        assert status == 200, body
        reply = json.loads(body)
        assert (reply["output_ids"], reply["text_output"]) == alone[prompt][:2], prompt
        status, body = _post(server, "generate_stream", {"text_input": prompt, "max_tokens": 12, "temperature": 0,
                                                         "stream": True})
        events = _events(body)
        assert status == 200 and all("error" not in e for e in events), body
        ids = [e["output_ids"] for e in events]
        assert (ids, "".join(e["text_output"] for e in events)) == streamed(alone[prompt])


def _scrape(server) -> dict[str, float]:
    """The model's diffexport_* samples on Triton's Prometheus endpoint: 'name{labels}' -> value."""
    import urllib.request

    with urllib.request.urlopen(server.metrics_url, timeout=10) as reply:
        text = reply.read().decode()
    samples = {}
    for line in text.splitlines():
        if line.startswith("diffexport_"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_server_metrics_count_what_it_served(server):
    """--metrics-port: Triton's endpoint carries the model's own metrics, and they move by what a
    request was sent (its tokens, one first token, a gap per later token); the gauges are there."""
    before = _scrape(server)
    label = '{model="diff"}'
    status, body = _post(server, "generate_stream", {"input_ids": [5, 6, 7], "max_tokens": 9, "temperature": 0,
                                                     "stream": True})
    ids = [i for e in _events(body) for i in (e["output_ids"] if isinstance(e["output_ids"], list)
                                               else [e["output_ids"]])]
    assert status == 200 and ids, body
    deadline, after = time.monotonic() + 10, before
    while after.get(f"diffexport_batch_rows{label}", 1) != 0 or after == before:
        assert time.monotonic() < deadline, after
        time.sleep(0.1)
        after = _scrape(server)

    def moved(name):
        return after[name] - before.get(name, 0.0)
    assert moved(f"diffexport_generated_tokens_total{label}") == len(ids)
    assert moved(f"diffexport_time_to_first_token_seconds_count{label}") == 1
    assert moved(f"diffexport_inter_token_latency_seconds_count{label}") == len(ids) - 1
    assert moved(f"diffexport_time_to_first_token_seconds_sum{label}") > 0
    assert after[f"diffexport_requests_waiting{label}"] == 0
    buckets = [k for k in after if k.startswith("diffexport_time_to_first_token_seconds_bucket")]
    assert len(buckets) == 11 and any('le="+Inf"' in k for k in buckets)


def test_server_concurrent_clients_get_their_own_answers(server, alone):
    """16 clients x 4 requests at once: none lost, none mixed (the model batches what waits)."""
    jobs = [PROMPTS[(client + k) % len(PROMPTS)] for client in range(16) for k in range(4)]

    def ask(prompt):
        status, body = _post(server, "generate", {"text_input": prompt, "max_tokens": 12, "temperature": 0}, 120)
        return prompt, status, body

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(ask, jobs))
    for prompt, status, body in results:
        assert status == 200, body
        reply = json.loads(body)
        assert (reply["output_ids"], reply["text_output"]) == alone[prompt][:2], prompt


def test_server_a_burst_over_max_batch_queues_and_all_complete(server, alone):
    """100 requests at once against 8 rows: the rest queue, every one is answered (its own answer),
    and the model's gauges are back at zero after."""
    jobs = [PROMPTS[k % len(PROMPTS)] for k in range(100)]

    def ask(prompt):
        status, body = _post(server, "generate", {"text_input": prompt, "max_tokens": 4, "temperature": 0}, 300)
        return prompt, status, body

    with ThreadPoolExecutor(100) as pool:
        results = list(pool.map(ask, jobs))
    assert [status for _, status, _ in results] == [200] * 100, [b for _, s, b in results if s != 200][:2]
    for prompt, _, body in results:
        assert json.loads(body)["output_ids"] == alone[prompt][0][:4], prompt
    label = '{model="diff"}'
    deadline = time.monotonic() + 10
    while (after := _scrape(server)).get(f"diffexport_batch_rows{label}") != 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert after[f"diffexport_batch_rows{label}"] == 0 and after[f"diffexport_requests_waiting{label}"] == 0


def test_server_refuses_bad_requests_and_keeps_serving(server, alone):
    cases = [({"max_tokens": 4}, "text_input or as input_ids"),
             ({"input_ids": [1, 2], "max_tokens": 100000}, "exceeds the context length"),
             ({"text_input": "x " * 400, "max_tokens": 4}, "context length"),
             ({"input_ids": [1, 99999]}, "outside the vocabulary"),
             ({"text_input": "hi", "temperature": -1}, "temperature")]
    for body, pattern in cases:
        status, text = _post(server, "generate", body)
        assert status != 200 and pattern in json.loads(text)["error"], (body, text)
    status, text = _post(server, "generate", {"text_input": "hi", "max_tokens": "many"})
    assert status != 200 and "error" in json.loads(text)
    status, body = _post(server, "generate", {"text_input": PROMPTS[0], "max_tokens": 12, "temperature": 0})
    assert status == 200 and json.loads(body)["output_ids"] == alone[PROMPTS[0]][0]


def test_server_survives_a_client_that_leaves_mid_stream(server, alone):
    connection = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    connection.request("POST", "/v2/models/diff/generate_stream",
                       json.dumps({"input_ids": [5, 6, 7], "max_tokens": 200, "stream": True}),
                       {"Content-Type": "application/json"})
    reply = connection.getresponse()
    assert reply.status == 200 and reply.readline().startswith(b"data: ")  # the first token came
    connection.sock.shutdown(socket.SHUT_RDWR)
    connection.close()
    status, body = _post(server, "generate", {"text_input": PROMPTS[1], "max_tokens": 12, "temperature": 0})
    assert status == 200 and json.loads(body)["output_ids"] == alone[PROMPTS[1]][0]


def test_server_grpc_streaming(server, alone):
    """The gRPC stream (tritonclient, as Triton's LLM clients use it) gives the unary call's tokens,
    for tensors shaped as Triton's OpenAI-compatible frontend sends them to a Python-backend model
    (its TensorRT-LLM request: [1, 1] each, max_tokens INT32, temperature FP32, seed UINT64, stop
    words BYTES [1, n]), and a stop word cuts the streamed text there."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import queue

    import numpy as np

    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))

        def tensor(name, array):
            kind = {np.object_: "BYTES", np.int32: "INT32", np.float32: "FP32", np.uint64: "UINT64",
                    np.bool_: "BOOL"}[array.dtype.type]
            data = grpcclient.InferInput(name, list(array.shape), kind)
            data.set_data_from_numpy(array)
            return data

        def ask(stop_words=None):
            inputs = [tensor("text_input", np.array([[PROMPTS[1].encode()]], dtype=np.object_)),
                      tensor("stream", np.array([[True]])), tensor("max_tokens", np.array([[12]], np.int32)),
                      tensor("temperature", np.array([[0.0]], np.float32)), tensor("seed", np.array([[7]], np.uint64))]
            if stop_words:
                inputs.append(tensor("stop_words", np.array([[w.encode() for w in stop_words]], dtype=np.object_)))
            client.async_stream_infer("diff", inputs, enable_empty_final_response=True)
            ids, text = [], ""
            while True:
                result, error = answers.get(timeout=60)
                assert error is None, error
                if result.get_response().parameters["triton_final_response"].bool_param:
                    return ids, text
                ids += result.as_numpy("output_ids").tolist()
                text += result.as_numpy("text_output")[0].decode()

        ids, text = ask()
        assert (ids, text) == streamed(alone[PROMPTS[1]])
        word, before = _stop_word(text)
        cut_ids, cut_text = ask([word])
        assert cut_text == before and cut_ids == ids[:len(cut_ids)] and len(cut_ids) < len(ids)
    finally:
        client.stop_stream()
        client.close()


# ---------------------------------------------------------------- the server's lifecycle


def _tritonserver_of(pid: int) -> int | None:
    """The tritonserver process a `diffexport triton --serve` process started, else None."""
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as stat:
                name, rest = stat.read().rsplit(")", 1)
        except OSError:
            continue
        if name.endswith("(tritonserver") and int(rest.split()[1]) == pid:
            return int(entry)
    return None


def _serve(folder, repo):
    command = [sys.executable, "-m", "diffexport", "triton", str(folder), "-o", str(repo), "--serve",
               "--http-port", str(_free_port()), "--grpc-port", str(_free_port())]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=checkout_env(),
                            stdin=subprocess.DEVNULL)


def _until(process, word: str) -> None:
    for line in process.stdout:
        if line.startswith(word):
            return
    pytest.fail(f"no {word!r} line: {process.stderr.read()}")


def test_the_server_never_outlives_its_supervisor_and_a_crash_is_an_error(folder, tmp_path):
    """SIGTERM while the model loads stops the server and exits 130; a supervisor killed outright
    (SIGKILL runs no handler) takes its server along (the server gets SIGTERM when its parent dies);
    a server that crashes makes `--serve` exit non-zero with one line naming the log. A second
    server on a taken port is refused before anything is written."""
    from diffexport.serving import server as triton_server

    try:
        binary = triton_server.find_tritonserver()
        triton_server.check_bundled_numpy() if binary.bundled_root else None
    except DiffExportError as exc:
        pytest.skip(f"no Triton server to test against: {exc}")
    loading = _serve(folder, tmp_path / "r1")
    _until(loading, "starting")
    for _ in range(600):
        if (started := _tritonserver_of(loading.pid)) is not None:
            break
        time.sleep(0.05)
    loading.send_signal(signal.SIGTERM)
    assert loading.wait(timeout=60) == 130 and process_ends(started)

    supervised = _serve(folder, tmp_path / "r2")
    _until(supervised, "ready")
    serving = _tritonserver_of(supervised.pid)
    supervised.kill()
    supervised.wait()
    assert serving is not None and process_ends(serving)

    crashing = _serve(folder, tmp_path / "r3")
    _until(crashing, "ready")
    port = int(next(a for a in crashing.args if a.isdigit()))
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        assert taken.connect_ex(("127.0.0.1", port)) == 0  # the running server holds it
    assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r4", "--serve", "--http-port", str(port)),
                          f"port {port} on 127.0.0.1 is taken")
    assert not (tmp_path / "r4").exists()
    os.kill(_tritonserver_of(crashing.pid), signal.SIGSEGV)
    out, err = crashing.communicate(timeout=60)
    result = subprocess.CompletedProcess(crashing.args, crashing.returncode, out, err)
    assert_one_line_error(result, "tritonserver ended on its own (killed by signal 11)")
    assert "(log: " in err


def test_a_stalling_tokenizer_is_refused_and_the_model_keeps_serving(folder, tmp_path, alone):
    """A folder whose tokenizer pattern is polynomial (`\\\\s*\\\\s*\\\\s*$`: minutes of native matching
    on 150 spaces, which held every other request of the model) refuses such a text_input in a
    few CPU seconds, and a text longer than the context could hold at once; the next request is
    answered as before."""
    import shutil

    from diffexport.serving.triton_model import DecoderService

    hostile = shutil.copytree(folder, tmp_path / "kv")
    tree = json.loads((hostile / "tokenizer.json").read_text())
    tree["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": r"\s*\s*\s*$"}, "behavior": "Isolated", "invert": False},
        tree["pre_tokenizer"]]}
    (hostile / "tokenizer.json").write_text(json.dumps(tree))
    service = DecoderService(hostile, max_batch=2)
    try:
        with pytest.raises(DiffExportError, match="s of CPU time: the tokenizer's regular expressions backtrack"):
            service.prompt((" " * 100 + "x").encode(), None)
        with pytest.raises(DiffExportError, match="more than the context could hold"):
            service.prompt(b"a" * (service.tokenizer.max_chars + 1), None)
        answer = _ask(service, PROMPTS[1])
        assert answer.done.wait(60) and answer.error is None and answer.ids == alone[PROMPTS[1]][0]
    finally:
        service.stop()


def test_bench_triton_exports_the_format_it_names(tmp_path):
    """tools/bench_triton.py called the export step that refuses a format with a pass, so its own
    default (--attention gqa) was refused: it now calls the export every format goes through."""
    import importlib.util
    from pathlib import Path

    from diffexport.format.decoder_folder import read_decoder_folder
    from diffexport.modeling.checkpoint import load_model

    path = Path(__file__).resolve().parent.parent / "tools" / "bench_triton.py"
    spec = importlib.util.spec_from_file_location("bench_triton", path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    folder = tool.export_decoder(load_model(None, preset="diff-v1-tiny", seed=0), tmp_path / "kv", threads=1,
                                 attention="gqa", log=lambda _: None).folder
    assert read_decoder_folder(folder).format.name == "gqa"
