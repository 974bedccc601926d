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
    for ports, pattern in ((("--http-port", "0"), "port 0 is not in 1..65535"),
                           (("--http-port", "9000", "--grpc-port", "9000"), "ports must differ")):
        assert_one_line_error(cli_main("triton", folder, "-o", tmp_path / "r", "--serve", *ports), pattern)
    assert not (tmp_path / "r").exists()  # refused before the repository was written


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


def _ask(service, prompt, stream=False, max_tokens=12, sampling=GREEDY, cancelled=lambda: False, ids=None):
    """Submit a prompt (its ids when given: encoding takes a forked child's time) -> its responses."""
    from diffexport.serving.triton_model import Request

    out = Collected()
    ids = service.prompt(prompt.encode(), None) if ids is None else ids
    service.submit(Request(ids, service.check_length(ids, max_tokens), sampling, stream, out.send, out.fail,
                           cancelled))
    return out


def test_batched_requests_answer_as_each_alone(service, alone):
    """Requests submitted together are decoded as one batch; greedy rows give what each prompt gives
    alone, streamed or not."""
    answers = [_ask(service, p, stream=i % 2 == 1) for i, p in enumerate(PROMPTS)]
    for i, (prompt, out) in enumerate(zip(PROMPTS, answers)):
        assert out.done.wait(60) and out.error is None and out.final
        want = streamed(alone[prompt]) if i % 2 else alone[prompt][:2]
        assert (out.ids, out.text) == want, prompt


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
    running = triton_server.start_server(repo.path, _free_port(), _free_port(), ready_timeout=90)
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
    """The gRPC stream (tritonclient, as Triton's LLM clients use it) gives the unary call's tokens."""
    grpcclient = pytest.importorskip("tritonclient.grpc")
    import queue

    import numpy as np

    answers = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
    try:
        client.start_stream(callback=lambda result, error: answers.put((result, error)))
        prompt = grpcclient.InferInput("text_input", [1], "BYTES")
        prompt.set_data_from_numpy(np.array([PROMPTS[3].encode()], dtype=np.object_))
        tokens = grpcclient.InferInput("max_tokens", [1], "INT32")
        tokens.set_data_from_numpy(np.array([12], np.int32))
        stream = grpcclient.InferInput("stream", [1], "BOOL")
        stream.set_data_from_numpy(np.array([True]))
        client.async_stream_infer("diff", [prompt, tokens, stream], enable_empty_final_response=True)
        ids = []
        while True:
            result, error = answers.get(timeout=60)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            ids += result.as_numpy("output_ids").tolist()
    finally:
        client.stop_stream()
        client.close()
    assert ids == alone[PROMPTS[3]][0]


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
