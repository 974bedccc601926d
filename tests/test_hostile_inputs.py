"""Inputs from strangers (issue 14, first part): no library loaded because an input names it, no
write through a link a downloaded folder carries, no probing of files outside a model's folder."""

import json
import re
import shutil
import subprocess

import pytest
from helpers import assert_one_line_error, cli_main, resave_checkpoint, run_cli

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)

onnx = pytest.importorskip("onnx")


@pytest.fixture(scope="module")
def exported(artifacts, tmp_path_factory):
    return artifacts.copy(artifacts.cli_output("onnx", "--preset", "diff-v1-tiny"), tmp_path_factory.mktemp("exported"))


def test_engine_sidecar_cannot_make_check_load_a_library(exported, tmp_path, monkeypatch):
    """An engine's .json names the plugin library its build used; `check` never loads that path
    (a library is code). Here the sidecar names one that would leave a marker if loaded."""
    if shutil.which("cc") is None:
        pytest.skip("no C compiler to build the marker library")
    marker = tmp_path / "LOADED"
    src = tmp_path / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{'
                   f' FILE* f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')
    evil = tmp_path / "libevil.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(evil), str(src)], check=True)
    from diffexport.format.metadata import read_export_metadata

    engine = tmp_path / "m.engine"
    engine.write_bytes(b"not really an engine")
    record = {"onnx": str(exported), "onnx_metadata": read_export_metadata(exported), "module": "tensorrt",
              "attention": "plugin", "logit_bits": 16, "smooth_k": True, "precision": "float32",
              "profile": {"min": [1, 1], "opt": [1, 8], "max": [2, 64]}, "plugin_lib": str(evil)}
    (tmp_path / "m.engine.json").write_text(json.dumps(record))
    monkeypatch.setenv("DIFFEXPORT_PLUGIN_LIB", str(tmp_path / "no-plugin-here.so"))
    result = run_cli("check", engine, "--preset", "diff-v1-tiny")
    assert_one_line_error(result, "plugin library not found")
    assert str(evil) not in result.stderr and not marker.exists()


def test_check_files_never_go_through_links(exported, tmp_path):
    """A MODEL.check/ folder that arrived holding links to files elsewhere: the links are replaced,
    their targets untouched; a save folder that is itself a link is refused."""
    model = tmp_path / "m.onnx"
    shutil.copy(exported, model)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    check_dir = tmp_path / "m.check"
    check_dir.mkdir()
    (check_dir / "inputs.json").symlink_to(victim)
    (check_dir / "eager_outputs.json").symlink_to(victim)
    result = run_cli("check", model, "--preset", "diff-v1-tiny", "--shapes", "1x3")
    assert result.returncode == 0, result.stdout + result.stderr
    assert victim.read_text() == "precious"
    assert not (check_dir / "inputs.json").is_symlink() and (check_dir / "inputs.json").stat().st_size > 0

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.rmtree(check_dir)
    check_dir.symlink_to(elsewhere)
    refused = run_cli("check", model, "--preset", "diff-v1-tiny", "--shapes", "1x3")
    assert_one_line_error(refused, "is a symbolic link or not a folder")
    assert not any(elsewhere.iterdir())


def _with_external_weight(exported, path, location):
    """The export with its largest weight's bytes moved to external data at `location` (written
    as is: onnx.save itself refuses such locations); returns the weight's name and values."""
    from onnx import numpy_helper

    model = onnx.load(str(exported))
    weight = max(model.graph.initializer, key=lambda t: len(t.raw_data) or 0)
    values = numpy_helper.to_array(weight)
    tensor = numpy_helper.from_array(values, weight.name)
    tensor.ClearField("raw_data")
    tensor.data_location = onnx.TensorProto.EXTERNAL
    tensor.external_data.add(key="location", value=location)
    weight.CopyFrom(tensor)
    path.write_bytes(model.SerializeToString())
    return weight.name, values


def test_inspect_does_not_probe_files_outside_the_model_folder(exported, tmp_path):
    """External-data locations outside the folder are reported REFUSED whether or not they exist."""
    secret = tmp_path.parent / "secret.bin"
    secret.write_bytes(b"exists")
    for location in ("../secret.bin", str(secret), "../no-such-file.bin"):
        _with_external_weight(exported, tmp_path / "hostile.onnx", location)
        out = run_cli("inspect", tmp_path / "hostile.onnx")
        assert out.returncode == 0, out.stderr
        assert f"{location} (REFUSED)" in out.stdout


def test_loading_weights_names_the_external_data_at_fault(exported, tmp_path):
    """A loader that needs the weights (quantize) refuses in one line naming the weight and its
    file: outside the folder (never read), or missing beside the model."""
    name, values = _with_external_weight(exported, tmp_path / "hostile.onnx", "no-such-file.bin")
    (tmp_path.parent / "secret.bin").write_bytes(values.tobytes())  # readable, were it followed
    (tmp_path / "link.bin").symlink_to(tmp_path.parent / "secret.bin")
    for location, says in (("../secret.bin", "outside the model's folder"), ("link.bin", "outside the model's folder"),
                           ("no-such-file.bin", "which is not beside the model")):
        _with_external_weight(exported, tmp_path / "hostile.onnx", location)
        out = run_cli("quantize", tmp_path / "hostile.onnx", "--weights", "int8", "-o", tmp_path / "q.onnx")
        assert_one_line_error(out, says)
        assert repr(name) in out.stderr and repr(location) in out.stderr
        assert not (tmp_path / "q.onnx").exists()


def test_check_refuses_a_diff_attention_node_outside_the_contract(exported, tmp_path):
    model = onnx.load(str(exported))
    node = next(n for n in model.graph.node if n.op_type == "DiffAttention")
    next(a for a in node.attribute if a.name == "variant").i = 9
    onnx.save(model, str(tmp_path / "tampered.onnx"))
    result = run_cli("check", tmp_path / "tampered.onnx", "--preset", "diff-v1-tiny")
    assert_one_line_error(result, "variant")
    assert "tampered.onnx: DiffAttention node" in result.stderr


@pytest.mark.parametrize("kind", ["fifo", "device"])
def test_non_regular_checkpoints_are_refused_at_once(kind, tmp_path):
    import os

    if kind == "fifo":
        path = tmp_path / "ckpt.pt"
        os.mkfifo(path)  # opening it for reading would block forever
    else:
        path = "/dev/zero"  # reading it would never end
    result = run_cli("info", path)
    assert_one_line_error(result, "is not a regular file or folder")


def test_cli_argument_mistakes_are_one_line(exported, tmp_path):
    """Swapped check arguments, an unknown flag (one error line, no usage block), a
    check shape the eager reference cannot hold."""
    swapped = run_cli("onnx", exported, "-o", tmp_path / "x.onnx")
    assert_one_line_error(swapped, "is an exported model, not a checkpoint")
    folder = tmp_path / "kv"  # a KV-cache export folder given where a checkpoint goes
    folder.mkdir()
    (folder / "genai_config.json").write_text("{}")
    assert_one_line_error(cli_main("info", folder), "is a KV-cache export folder, not a checkpoint")
    unknown = run_cli("inspect", exported, "--frobnicate")
    assert unknown.returncode == 2 and unknown.stderr.strip().splitlines() == [
        "error: diffexport inspect: unrecognized argument: --frobnicate; see `diffexport inspect --help`"]
    huge = run_cli("check", exported, "--preset", "diff-v1-tiny", "--shapes", "1x100000")
    assert_one_line_error(huge, "at most 64 sequences of 16384 tokens")


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    """SIGTERM during an export: exit 130, no temporary folder, no partial file."""
    import signal
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "diffexport", "onnx", "--preset", "diff-v1-tiny", "-o",
                             str(tmp_path / "m.onnx")], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not list(tmp_path.glob(".m.onnx.*")):
        time.sleep(0.01)  # wait until the export has made its temporary folder
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 0:
        pytest.skip("the export finished before the signal arrived")
    assert proc.returncode == 130 and "error: interrupted" in err
    assert list(tmp_path.iterdir()) == []


def test_a_large_non_pickle_file_is_not_read_whole(tmp_path):
    """2 GiB (sparse) of a pickle header then zeros: one line, quickly; the pickle check reads a
    bounded prefix, never the whole file into memory (it once read it whole: 4.4 GB, 15 s)."""
    import sys
    import time

    path = tmp_path / "big.pt"
    with path.open("wb") as f:
        f.write(b"\x80\x04garbage")
        f.truncate(2 << 30)
    # the child's own peak: /proc's VmHWM of its memory map (ru_maxrss would carry over the peak of
    # the forked test process itself, which a long session makes large)
    code = ("import sys; from diffexport.cli import main; rc = main(['info', sys.argv[1]]); "
            "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM:')), file=sys.stderr); "
            "sys.exit(rc)")
    start = time.monotonic()
    result = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120)
    assert time.monotonic() - start < 30
    *lines, peak_kb = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and "not a readable checkpoint" in lines[0], result.stderr
    assert int(peak_kb) < 1_500_000, f"peak {int(peak_kb) // 1024} MB"


def test_check_against_and_plugin_lib_bad_inputs(exported, tmp_path):
    """--against: a missing file, a corrupt file, a graph taking other inputs; --plugin-lib that
    does not exist. Each one line, exit 2."""
    from onnx import TensorProto, helper

    assert_one_line_error(cli_main("check", exported, "--against", tmp_path / "nope.onnx"), "does not exist")
    (tmp_path / "corrupt.onnx").write_bytes(b"\x08\x07not a protobuf" * 20)
    assert_one_line_error(cli_main("check", exported, "--against", tmp_path / "corrupt.onnx"),
                          "is not a valid ONNX model")
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["logits"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 3])])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10),
              tmp_path / "other.onnx")
    assert_one_line_error(cli_main("check", exported, "--against", tmp_path / "other.onnx"), "take different inputs")
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"x")
    from diffexport.format.metadata import read_export_metadata

    (tmp_path / "m.engine.json").write_text(json.dumps({
        "onnx_metadata": read_export_metadata(exported), "module": "tensorrt", "attention": "plugin",
        "profile": {"min": [1, 1], "opt": [1, 8], "max": [2, 64]}, "plugin_lib": None}))
    assert_one_line_error(cli_main("check", engine, "--preset", "diff-v1-tiny", "--plugin-lib", tmp_path / "no.so"),
                          "plugin library not found")


# ------------------------------------------------------------ issue 14, second part

@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from diffexport.modeling.checkpoint import load_model, save_checkpoint

    return save_checkpoint(load_model(preset="diff-v1-tiny").model, tmp_path_factory.mktemp("ckpt") / "good.pt")


def _set_tensor(make):
    def edit(obj):
        obj["state_dict"]["embed.weight"] = make(obj["state_dict"]["embed.weight"])
    return edit


@pytest.mark.parametrize("edit,message", [
    (lambda o: o["config"].update(lambda_init="abc"), "lambda_init must be a finite number or null, got 'abc'"),
    (lambda o: o["config"].update(n_heads="four"), "n_heads must be an int, got 'four'"),
    (lambda o: o["config"].update(lambda_std=[0.1]), "lambda_std must be a finite number"),
    (lambda o: o["config"].update(head_norm_affine=1), "head_norm_affine must be true or false"),
    (lambda o: o["config"].update(rope_scaling="linear"), "rope_scaling must be an object or null, got 'linear'"),
    (_set_tensor(lambda t: t.to(__import__("torch").float8_e4m3fn)), "has dtype float8_e4m3fn"),
    (_set_tensor(lambda t: t.to_sparse()), "embed.weight is a sparse_coo tensor"),
    (_set_tensor(lambda t: __import__("torch").empty_like(t, device="meta")), "embed.weight is a meta tensor"),
    (_set_tensor(lambda t: t.to(__import__("torch").int8)), "has dtype int8"),
], ids=["lambda-abc", "heads-four", "list-number", "int-as-bool", "rope-string", "fp8", "sparse", "meta", "int8"])
def test_wrong_typed_configs_and_tensors_are_one_line(checkpoint, tmp_path, edit, message):
    assert_one_line_error(cli_main("info", resave_checkpoint(checkpoint, tmp_path, edit)), message)


def test_onnx_weights_are_checked_against_their_declared_shapes(tmp_path):
    """An initializer declaring [2**31, 2**31] over 64 bytes, inline or in its external file (or an
    external length past the file), is refused in one line when the file is opened, before a
    quantizer or runtime reads or allocates from the shape; an honest file still opens."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    def model_with(weight):
        node = helper.make_node("MatMul", ["x", "w"], ["y"])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])], [weight])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])

    from diffexport.core.files import load_onnx

    honest = model_with(numpy_helper.from_array(np.ones((4, 4), np.float32), "w"))
    onnx.save(honest, str(tmp_path / "honest.onnx"))
    assert load_onnx(tmp_path / "honest.onnx").graph.initializer[0].dims == [4, 4]
    inline = model_with(numpy_helper.from_array(np.ones((4, 4), np.float32), "w"))
    inline.graph.initializer[0].dims[:] = [2**31, 2**31]
    onnx.save(inline, str(tmp_path / "inline.onnx"))
    external = model_with(numpy_helper.from_array(np.ones((4, 4), np.float32), "w"))
    onnx.save(external, str(tmp_path / "external.onnx"), save_as_external_data=True, location="external.onnx.data",
              size_threshold=0)
    stored = onnx.load(str(tmp_path / "external.onnx"), load_external_data=False)
    stored.graph.initializer[0].dims[:] = [2**31, 2**31]
    onnx.save(stored, str(tmp_path / "external.onnx"))
    shutil.copyfile(tmp_path / "external.onnx.data", tmp_path / "long.onnx.data")
    long = onnx.load(str(tmp_path / "honest.onnx"))
    onnx.save(long, str(tmp_path / "long.onnx"), save_as_external_data=True, location="long.onnx.data",
              size_threshold=0)
    long = onnx.load(str(tmp_path / "long.onnx"), load_external_data=False)
    for entry in long.graph.initializer[0].external_data:
        if entry.key == "length":
            entry.value = str(1 << 40)
    onnx.save(long, str(tmp_path / "long.onnx"))
    (tmp_path / "long.onnx.data").write_bytes(b"\0" * 16)  # 16 bytes where 64 are declared
    for name in ("inline", "external", "long"):
        for command in (("inspect", tmp_path / f"{name}.onnx"),
                        ("quantize", tmp_path / f"{name}.onnx", "-o", tmp_path / f"{name}-q.onnx")):
            assert_one_line_error(cli_main(*command), "but holds")
        assert not (tmp_path / f"{name}-q.onnx").exists()


def test_zip_members_are_checked_against_their_declared_sizes(checkpoint, tmp_path):
    """torch.load(mmap=True) trusts the pickle's sizes: a storage member cut short would load the
    next member's bytes as weights, a deflated member its compressed bytes. Both are refused."""
    import zipfile

    with zipfile.ZipFile(checkpoint) as source:
        members = [(info.filename, source.read(info.filename)) for info in source.infolist()]
    short, deflated = tmp_path / "short.pt", tmp_path / "deflated.pt"
    victim = next(name for name, data in members if "/data/" in name and len(data) > 64)
    with zipfile.ZipFile(short, "w", zipfile.ZIP_STORED) as out:
        for name, data in members:
            out.writestr(name, data[:64] if name == victim else data)
    with zipfile.ZipFile(deflated, "w", zipfile.ZIP_DEFLATED) as out:
        for name, data in members:
            out.writestr(name, data)
    assert_one_line_error(cli_main("info", short), "holds 64 bytes but its tensor declares")
    assert_one_line_error(cli_main("info", deflated), "is compressed")


def test_output_names_the_file_system_or_onnx_cannot_take(tmp_path):
    """A legal 245-character name works (its temporary twin is shortened); a name whose .data twin
    would pass the 255-byte limit, and a name that is not UTF-8, are refused before any work."""
    ok = tmp_path / ("a" * 240 + ".onnx")
    assert run_cli("onnx", "--preset", "diff-v1-tiny", "-o", ok).returncode == 0 and ok.is_file()
    too_long = tmp_path / ("b" * 248 + ".onnx")
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "-o", too_long), "longer than 255 bytes")
    not_utf8 = tmp_path / "m\udcff.onnx"  # the bytes b"m\xff.onnx", as Python names them
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "-o", not_utf8), "is not valid UTF-8")
    assert sorted(p.name for p in tmp_path.iterdir()) == [ok.name]


def test_a_closed_pipe_ends_quietly(exported):
    """`diffexport inspect m.onnx | head -0`: no traceback, no error line, the shell's SIGPIPE status."""
    import sys

    proc = subprocess.Popen([sys.executable, "-m", "diffexport", "inspect", str(exported)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141 and err == b""


def test_a_full_disk_is_one_line_and_leaves_nothing(tmp_path):
    """A file-size limit makes every write past 200 kB fail as a full disk would (EFBIG)."""
    import sys

    code = ("import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
            "resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, 200_000)); "
            "from diffexport.cli import main; sys.exit(main(sys.argv[1:]))")
    out = tmp_path / "out"
    result = subprocess.run([sys.executable, "-c", code, "onnx", "--preset", "diff-v1-tiny", "-o", out / "m.onnx"],
                            capture_output=True, text=True, timeout=300)
    # the export's progress lines ("tracing       ...": a word padded to 14 columns), then one error
    *progress, last = result.stderr.splitlines()
    assert result.returncode == 2 and all(re.match(r"[a-z]+ +\S", line) for line in progress), result.stderr
    assert last.startswith("error: the file system refused: File too large"), result.stderr
    assert not out.exists() or list(out.iterdir()) == []


def test_the_cleanup_is_linear_in_the_node_count():
    """`diffexport optimize` once spent quadratic time in onnxscript's SlicesSplit rule (10k nodes:
    26 s). Counted in Python calls, not seconds: doubling the graph must about double the work."""
    import cProfile
    import pstats

    from onnx import TensorProto, helper

    from diffexport.passes.cleanup import cleanup

    def chain(n):
        nodes = [helper.make_node("Relu" if i % 2 else "Neg", [f"t{i - 1}" if i else "x"], [f"t{i}"])
                 for i in range(n)]
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                                  [helper.make_tensor_value_info(f"t{n - 1}", TensorProto.FLOAT, [1, 3])])
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)

    cleanup(chain(8))  # imports and first-use caches out of the count
    calls = {}
    for n in (400, 800):
        model, profiler = chain(n), cProfile.Profile()
        profiler.enable()
        cleaned = cleanup(model)
        profiler.disable()
        assert len(cleaned.graph.node) == n
        calls[n] = pstats.Stats(profiler).total_calls
    assert calls[800] / calls[400] < 2.2, calls


def test_an_unwritable_output_folder_is_refused_before_any_work():
    """/sys refuses new files even to root (for whom permission bits say yes): one line, before the
    model is built or traced (no progress line)."""
    import os

    if not os.path.isdir("/sys/kernel"):
        pytest.skip("no /sys on this system")
    assert_one_line_error(cli_main("onnx", "--preset", "diff-v1-tiny", "-o", "/sys/kernel/m.onnx"),
                          "/sys/kernel is not writable")


@pytest.mark.parametrize("key,value", [("config", "{not json"), ("config", '{"n_layers": "x"}'), ("family", "[1, 2]"),
                                       ("op_version", "99"), ("dtype", ""), ("weights", "null")])
def test_malformed_export_metadata_is_one_line(exported, tmp_path, key, value):
    """A diffexport export whose metadata was edited: inspect still describes the file (or says
    why not, in one line); check refuses in one line instead of trusting it."""
    model = onnx.load(str(exported))
    next(p for p in model.metadata_props if p.key == f"diffexport.{key}").value = value
    path = tmp_path / "edited.onnx"
    onnx.save(model, str(path))
    described = run_cli("inspect", path)
    assert described.returncode == 0 or (described.returncode == 2 and len(described.stderr.splitlines()) == 1)
    assert "Traceback" not in described.stderr and "internal error" not in described.stderr
    checked = run_cli("check", path, "--preset", "diff-v1-tiny", "--shapes", "1x3")
    if key == "weights":  # only a fingerprint: a mismatch is said, not fatal to the comparison
        assert checked.returncode in (0, 2) and "internal error" not in checked.stderr
    else:
        assert_one_line_error(checked, "")
        # the same metadata recorded in an engine's sidecar: refused before anything runs
        from diffexport.format.metadata import read_export_metadata

        meta = read_export_metadata(exported)
        meta[key] = value
        (tmp_path / "m.engine").write_bytes(b"x")
        (tmp_path / "m.engine.json").write_text(json.dumps({
            "onnx_metadata": meta, "module": "tensorrt", "attention": "native",
            "profile": {"min": [1, 1], "opt": [1, 8], "max": [2, 64]}}))
        assert_one_line_error(cli_main("check", tmp_path / "m.engine", "--preset", "diff-v1-tiny"), "m.engine")


def test_generation_config_search_values_from_strangers(tmp_path):
    """A checkpoint's generation_config.json feeds the folder's search block: a link, a huge or a
    broken file is passed over whole, values of another type or range one by one (said, not used)."""
    from diffexport.format.decoder_folder import hf_search

    folder = tmp_path / "ckpt"
    folder.mkdir()
    path = folder / "generation_config.json"
    path.write_text(json.dumps({"do_sample": "yes", "temperature": -1, "top_k": 2.5, "top_p": 0.9,
                                "num_beams": 2, "num_return_sequences": 3, "repetition_penalty": float("inf")}))
    found, skipped = hf_search(folder)
    assert found == {"top_p": 0.9, "num_beams": 2}
    assert [note.split("=")[0] for note in skipped] == ["do_sample", "temperature", "top_k", "repetition_penalty",
                                                        "num_return_sequences"]
    real = tmp_path / "elsewhere.json"
    real.write_text(json.dumps({"do_sample": True}))
    path.unlink()
    path.symlink_to(real)
    assert hf_search(folder) == ({}, [])  # a link is not followed
    path.unlink()
    path.write_text('{"do_sample": true, ' + '"x": 0, ' * 200_000 + '"y": 1}')  # over 1 MiB
    assert hf_search(folder) == ({}, [])
    path.write_text("{broken")
    assert hf_search(folder) == ({}, [])
    path.write_text("[true]")
    assert hf_search(folder) == ({}, [])
