"""`diffexport onnx` and `diffexport check`: V1, V2 and HF DiffLlama checkpoints exported, run in
onnxruntime, compared with eager PyTorch, and the printed polygraphy command run."""

import os
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from helpers import cli_main  # noqa: E402

from diffexport.core import contract  # noqa: E402
from diffexport.export import ExportOptions, export_onnx  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_checkpoint, save_safetensors  # noqa: E402
from diffexport.modeling.families import build_model  # noqa: E402
from diffexport.modeling.presets import preset_config  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402
from diffexport.validation.prefill import run_prefill_check  # noqa: E402

QUICK_SHAPES = ((1, 1), (2, 17), (3, 30))


def _diff_nodes(path):
    graph = onnx.load(str(path), load_external_data=False).graph
    return [n for n in graph.node if n.op_type == contract.OP_NAME]


def _export_and_check(loaded, path, **options):
    summary = export_onnx(loaded, path, ExportOptions(**options), log=lambda _: None)
    report = run_prefill_check(path, loaded, CheckOptions(shapes=QUICK_SHAPES, provider="cpu"), log=lambda _: None)
    return summary, report


def _run_printed(command):
    """Run a printed command as a user would, with this interpreter's scripts first on PATH."""
    env = dict(os.environ, PATH=os.pathsep.join([os.path.dirname(sys.executable), os.environ.get("PATH", "")]))
    return subprocess.run(shlex.split(command), capture_output=True, text=True, timeout=300, env=env)


def _assert_unit_weights(path, width):
    model = onnx.load(str(path))
    inits = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    for node in _diff_nodes(path):
        assert len(node.input) == 5 and np.array_equal(inits[node.input[4]], np.ones(width, np.float32))


def _logits_max_abs(report):
    return max(float(line.split("max abs ")[1].split()[0]) for line in report.lines if line.startswith("logits"))


@pytest.fixture(scope="module")
def v1_ckpt(tmp_path_factory):
    """A native ckpt.pt of a V1 model with an affine head norm whose weights are not all ones."""
    cfg = preset_config("diff-v1-tiny")
    cfg.n_heads, cfg.n_kv_heads, cfg.head_dim = 4, 2, 16
    model = build_model(cfg, seed=11)
    with torch.no_grad():
        for layer in model.layers:
            layer.attn.head_norm.weight.add_(0.3 * torch.randn_like(layer.attn.head_norm.weight))
    return save_checkpoint(model, tmp_path_factory.mktemp("v1") / "ckpt.pt")


@pytest.fixture(scope="module")
def v1_export(v1_ckpt, tmp_path_factory):
    path = tmp_path_factory.mktemp("v1-onnx") / "model.onnx"
    loaded = load_model(v1_ckpt)
    summary, report = _export_and_check(loaded, path)
    return path, summary, report


@pytest.mark.slow
def test_v1_native_checkpoint_exports_and_checks(v1_export):
    path, summary, report = v1_export
    assert report.passed, report.text()
    assert _logits_max_abs(report) <= 1e-4
    assert summary.diff_attention_nodes == 2 and summary.data_path is None


def test_one_diff_attention_node_per_layer_with_plugin_fields(v1_export):
    path, _, _ = v1_export
    model = onnx.load(str(path))
    nodes = _diff_nodes(path)
    assert len(nodes) == 2
    for node in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert node.domain == contract.ONNX_DOMAIN
        assert attrs["plugin_namespace"] == contract.PLUGIN_NAMESPACE.encode()
        assert attrs["plugin_version"] == contract.PLUGIN_VERSION.encode()
        assert attrs["num_heads"] == 4 and attrs["num_kv_heads"] == 2 and attrs["head_dim"] == 16
        assert len(node.input) == 5  # affine head norm: the weight is passed
    # the lambda_init depth schedule reaches the nodes as output_scale = 1 - lambda_init
    scales = sorted(onnx.helper.get_attribute_value(a) for n in nodes for a in n.attribute if a.name == "output_scale")
    assert scales == pytest.approx([1 - 0.3555, 1 - 0.2], abs=1e-4)
    functions = [(f.domain, f.name) for f in model.functions]
    assert functions == [(contract.ONNX_DOMAIN, contract.OP_NAME)]
    assert {o.domain: o.version for o in model.opset_import}[contract.ONNX_DOMAIN] == contract.OP_VERSION
    onnx.checker.check_model(model, full_check=True)
    # documented interface: input_ids int64 [batch, sequence] -> logits [batch, sequence, vocab]
    (inp,), (out,) = model.graph.input, model.graph.output
    assert inp.name == "input_ids" and inp.type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert [d.dim_param for d in inp.type.tensor_type.shape.dim] == ["batch", "sequence"]
    assert out.name == "logits" and out.type.tensor_type.shape.dim[2].dim_value == 512


def test_polygraphy_command_printed_by_check_passes(v1_export):
    pytest.importorskip("polygraphy")
    _, _, report = v1_export
    assert report.inputs_path.is_file() and report.outputs_path.is_file()
    assert report.polygraphy_command.startswith("polygraphy run ")
    result = _run_printed(report.polygraphy_command)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "PASSED" in result.stdout + result.stderr


def test_printed_tolerances_round_up():
    """A bound printed for polygraphy is never below the one computed (3 significant digits, up)."""
    from diffexport.core.tolerances import elementwise_atol, format_at_least

    for x in (0.30824, 0.308, 1e-5, 0.99951, 123456.0, 2.5e-7, 7.0000001):
        assert float(format_at_least(x)) >= x and len(format_at_least(x).replace(".", "").lstrip("0")) <= 3 + 4
    assert format_at_least(0.30824) == "0.309" and format_at_least(0.308) == "0.308"

    class Bound:  # a comparison's bound (the dtype rule's, or a quantised model's observed max)
        bound = 0.3

    # the difference seen on the saved calls (padding rows included) raises the atol above the bound
    assert elementwise_atol([Bound()], "float32", 1.0, observed_max=0.31) > 0.31
    assert elementwise_atol([Bound()], "float32", 1.0) > 0.3


def test_the_printed_atol_covers_every_element_polygraphy_compares(tmp_path):
    """A check may judge only some rows (not a prompt's padding); polygraphy compares all of them.
    The printed atol covers the largest difference the runtime showed on the saved calls."""
    pytest.importorskip("polygraphy")
    import re

    from diffexport.core.tolerances import compare
    from diffexport.validation.compare import finish_report

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 5, 16)).astype(np.float32)
    got = ref.copy()
    got[1, :2] += 0.25  # padding rows: far off, and not judged
    judged = compare("logits", got[0], ref[0], "float32")
    feeds = [{"input_ids": np.zeros((2, 5), np.int64)}]
    report = finish_report(["polygraphy run", "m.onnx", "--onnxrt"], tmp_path, feeds,
                           [{"logits": ref}], [("logits", judged)], [], ["logits"], "float32",
                           observed=[{"logits": got}])
    atol = float(re.search(r"--atol logits:(\S+)", report.polygraphy_command).group(1))
    assert report.passed and atol >= float(np.abs(got - ref).max()) > judged.bound


@pytest.mark.slow
def test_polygraphy_command_fails_when_the_model_differs(v1_export, tmp_path):
    """The saved outputs really constrain the model: another seed's export must fail the same command."""
    pytest.importorskip("polygraphy")
    path, _, report = v1_export
    cfg = preset_config("diff-v1-tiny")
    cfg.n_heads, cfg.n_kv_heads, cfg.head_dim = 4, 2, 16
    other = tmp_path / "other.onnx"
    export_onnx(load_model(None, config=cfg, seed=12), other, log=lambda _: None)
    result = _run_printed(report.polygraphy_command.replace(shlex.quote(str(path)), shlex.quote(str(other))))
    assert result.returncode != 0 and "FAILED" in result.stdout + result.stderr


@pytest.mark.slow
def test_v2_checkpoint_exports_and_checks(tmp_path):
    model = build_model(preset_config("diff-v2-tiny"), seed=5)
    save_safetensors(model, tmp_path / "v2")
    loaded = load_model(tmp_path / "v2")
    summary, report = _export_and_check(loaded, tmp_path / "v2.onnx")
    assert report.passed, report.text()
    assert _logits_max_abs(report) <= 1e-4
    _assert_unit_weights(tmp_path / "v2.onnx", 32)  # V2 has no norm weight: the contract passes ones


@pytest.mark.slow
@pytest.mark.parametrize("heads,kv_heads", [(8, 4), (8, 2)])
def test_hf_diffllama_exports_checks_and_matches_transformers(heads, kv_heads, tmp_path, rng):
    """GQA DiffLlama: halves layout, weightless head norm; also compared with transformers itself."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(heads + kv_heads)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    hf.save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    summary, report = _export_and_check(loaded, tmp_path / "hf.onnx")
    assert report.passed, report.text()
    assert _logits_max_abs(report) <= 1e-4
    session = ort.InferenceSession(str(tmp_path / "hf.onnx"), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 96, (2, 19), generator=rng)
    with torch.no_grad():
        expected = hf(ids).logits.numpy()
    got = session.run(None, {"input_ids": ids.numpy()})[0]
    assert np.abs(got - expected).max() <= 1e-4
    _assert_unit_weights(tmp_path / "hf.onnx", 32)  # weightless head norm: the contract passes ones


@pytest.mark.slow
def test_fp16_export_passes_its_tolerance(tmp_path):
    loaded = load_model(None, preset="diff-v1-tiny", seed=2, dtype=torch.float16)
    summary, report = _export_and_check(loaded, tmp_path / "fp16.onnx", dtype="float16")
    assert report.passed, report.text()
    model = onnx.load(str(tmp_path / "fp16.onnx"))
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert "torch low-precision baseline" in report.text()


@pytest.mark.slow
def test_attention_body_hidden_output_and_external_data(tmp_path):
    loaded = load_model(None, preset="diff-v1-tiny", seed=4)
    path = tmp_path / "att.onnx"
    summary, report = _export_and_check(loaded, path, body_style="attention", hidden=True, external_data=True)
    assert report.passed, report.text()
    assert summary.opset == 23 and summary.data_path == tmp_path / "att.onnx.data"
    assert any(line.startswith("last_hidden_state") for line in report.lines)
    model = onnx.load(str(path), load_external_data=False)
    assert [o.name for o in model.graph.output] == ["logits", "last_hidden_state"]
    assert {n.op_type for n in model.functions[0].node} >= {"Attention"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["att.check", "att.onnx", "att.onnx.data"]


def test_legacy_exporter_fallback(tmp_path):
    loaded = load_model(None, preset="diff-v2-tiny", seed=6)
    summary, report = _export_and_check(loaded, tmp_path / "legacy.onnx", legacy=True)
    assert summary.exporter == "legacy"
    assert report.passed, report.text()
    assert len(_diff_nodes(tmp_path / "legacy.onnx")) == 2


@pytest.mark.slow
def test_check_of_an_hf_checkpoint_compares_with_transformers_itself(tmp_path):
    """`check` on an HF DiffLlama export: against diffexport's port and against transformers'
    DiffLlamaForCausalLM (the default when transformers is installed), each line saying which;
    a unilm-style or native checkpoint names the port as its only reference."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(3)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16)
    transformers.DiffLlamaForCausalLM(cfg).eval().save_pretrained(tmp_path / "hf")
    assert cli_main("onnx", tmp_path / "hf", "-o", tmp_path / "hf.onnx").returncode == 0
    both = cli_main("check", tmp_path / "hf.onnx", "--ckpt", tmp_path / "hf", "--shapes", "1x1,2x9")
    assert both.returncode == 0, both.stdout + both.stderr
    assert "reference     diffexport's port (eager PyTorch) and transformers' DiffLlamaForCausalLM" in both.stdout
    assert both.stdout.count("] vs transformers") == 2 and "PASS: 4/4" in both.stdout
    assert "Loading weights" not in both.stdout
    only = cli_main("check", tmp_path / "hf.onnx", "--ckpt", tmp_path / "hf", "--shapes", "2x9", "--reference",
                   "transformers")
    assert only.returncode == 0 and "PASS: 1/1" in only.stdout, only.stdout + only.stderr
    assert cli_main("onnx", "--preset", "diff-v1-tiny", "-o", tmp_path / "tiny.onnx").returncode == 0
    native = cli_main("check", tmp_path / "tiny.onnx", "--preset", "diff-v1-tiny", "--reference", "transformers")
    assert native.returncode == 2 and "no library model exists for it" in native.stderr


def test_reported_numbers_read_as_numbers():
    """Perplexity prints without a dangling point ("2100." read as a typo), and a KL is never
    negative (rounding below 0 is reported as the 0 it is)."""
    from diffexport.analysis.sweep import Damage
    from diffexport.core.tolerances import QuantBudget, compare_distributions
    from diffexport.validation.options import TextIds

    text = TextIds.__new__(TextIds)  # only what line() reads
    text.source, text.count = "t.txt (UTF-8 bytes)", 10
    text.nll = {"onnxruntime": 10 * np.log(2100.0), "eager": 10 * np.log(2100.0)}
    line = text.line("onnxruntime", "eager")
    assert "onnxruntime 2100.00, eager 2100.00 (+0.00%)" in line, line
    logits = np.random.default_rng(1).standard_normal((3, 50)) * 30
    same = compare_distributions("logits", logits + 1e-9, logits, QuantBudget(0.05, 0.9), logits=True)
    assert same.mean_kl is not None and same.mean_kl >= 0.0
    stats = Damage()
    ref = torch.randn(4, 64, dtype=torch.float64) * 30
    stats.add(ref, ref, ref.log_softmax(-1))
    assert stats.means()[2] >= 0.0
