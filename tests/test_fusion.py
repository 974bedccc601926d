"""Fusion: differential attention written out in standard ops (plain torch.onnx exports of models
without our op) becomes one DiffAttention node per layer, numerics kept; near misses are refused."""

import warnings

import numpy as np
import pytest
import torch

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from helpers import assert_same_logits, cli_main, ort_logits  # noqa: E402

from diffexport.core import contract  # noqa: E402
from diffexport.core.errors import DiffExportError  # noqa: E402
from diffexport.modeling.checkpoint import load_model  # noqa: E402
from diffexport.passes.optimize import optimize_model  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


def plain_export(preset, impl, path, seed=0, opset=18, dtype=torch.float32):
    """torch.onnx.export of a model whose attention is plain torch ops (no diffexport op)."""
    model = load_model(None, preset=preset, seed=seed, dtype=dtype).model.eval()
    for layer in model.layers:
        layer.attn.impl = impl
    ids = torch.randint(0, model.config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(model, (ids,), dynamo=True, opset_version=opset, dynamic_shapes=dims,
                                    input_names=["input_ids"], output_names=["logits"], verbose=False)
    program.save(str(path))
    return onnx.load(str(path))


EXPECTED_RULE = {"naive": "eq1", "flash_diff_1": "flash1", "flash_diff_2": "flash2"}


@pytest.fixture(scope="module")
def plain_exports(tmp_path_factory):
    """plain_export(preset, impl, opset) made once per module (the fusion cases and the near misses
    share V1's Eq. 1 graph at opset 18); each call returns a private copy of the graph."""
    made = {}

    def get(preset, impl, opset=18):
        if (preset, impl, opset) not in made:
            made[preset, impl, opset] = plain_export(preset, impl, tmp_path_factory.mktemp("plain") / "plain.onnx",
                                                     opset=opset)
        return onnx.ModelProto.FromString(made[preset, impl, opset].SerializeToString())
    return get


@pytest.mark.parametrize("preset,variant", [("diff-v1-tiny", 1), ("diff-v2-tiny", 2)])
@pytest.mark.parametrize("impl,opset", [("naive", 18), ("flash_diff_1", 18), ("flash_diff_2", 18), ("naive", 23),
                                        ("flash_diff_1", 23), ("flash_diff_2", 23)])
def test_every_layer_fuses_and_numerics_hold(preset, variant, impl, opset, plain_exports):
    source = plain_exports(preset, impl, opset)
    assert not any(n.op_type == contract.OP_NAME for n in source.graph.node)
    result = optimize_model(source)
    assert result.report.total == 2 and result.report.fired[EXPECTED_RULE[impl]] == 2, result.report
    fused = result.model
    nodes = [n for n in fused.graph.node if n.op_type == contract.OP_NAME]
    assert len(nodes) == 2 and not any(n.op_type in ("Softmax", "Attention") for n in fused.graph.node)
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert attrs["variant"] == variant and attrs["causal"] == 1
    # GQA is kept where the source shows it: Eq. 1's repeat_interleave and opset-23 Attention nodes;
    # torch's opset-18 SDPA decomposition hides it behind reshapes, so those nodes get num_kv_heads = num_heads
    gqa = impl == "naive" or opset == 23
    assert attrs["num_kv_heads"] == ({1: 1, 2: 2}[variant] if gqa else attrs["num_heads"])
    assert attrs["scale"] == pytest.approx(32 ** -0.5, rel=1e-6)
    if variant == 1:  # lambda, computed from its four parameter vectors in the source, is folded to a constant
        inits = {i.name: onnx.numpy_helper.to_array(i) for i in fused.graph.initializer}
        model = load_model(None, preset=preset, seed=0).model
        lambdas = [float(inits[n.input[3]].reshape(())) for n in nodes]
        assert lambdas == pytest.approx(model.lambdas(), rel=1e-6)
        # the head RMSNorm, its weight and (1 - lambda_init) after the attention moved into the nodes
        assert result.absorbed == 2
        for node, layer in zip(nodes, model.layers):
            got = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
            assert got["norm"] == 1 and got["output_scale"] == pytest.approx(1 - layer.attn.lambda_init, rel=1e-6)
            assert np.allclose(inits[node.input[4]], layer.attn.head_norm.weight.detach().numpy())
    onnx.checker.check_model(fused, full_check=True)
    assert_same_logits(source, fused, [(1, 1), (3, 29)], seed=5)


def test_fp16_source_fuses_with_its_dtype_bound(tmp_path):
    source = plain_export("diff-v1-tiny", "naive", tmp_path / "fp16.onnx", dtype=torch.float16)
    result = optimize_model(source)
    assert result.report.total == 2 and result.absorbed == 2 and result.max_abs is not None
    ids = np.random.default_rng(2).integers(0, 512, size=(2, 19), dtype=np.int64)
    out = ort_logits(result.model, ids)
    assert out.dtype == np.float16
    ref = ort_logits(source, ids).astype(np.float64)
    assert np.abs(out - ref).max() <= 1e-2 * max(1.0, np.abs(ref).max())


@pytest.fixture(scope="module")
def naive_v1(plain_exports):
    return plain_exports("diff-v1-tiny", "naive")


def _producer(model, name):
    return next((n for n in model.graph.node if name in n.output), None)


def _is_softmax(model, name):
    node = _producer(model, name)
    return node is not None and node.op_type == "Softmax"


def _diff_subs(model):
    """The Sub nodes that subtract the two softmax maps (one per layer)."""
    softmax_out = {n.output[0] for n in model.graph.node if n.op_type == "Softmax"}
    return [n for n in model.graph.node if n.op_type == "Sub" and n.input[0] in softmax_out]


def _assert_refused(near, reason):
    result = optimize_model(near)
    assert result.report.total == 0
    assert any(reason in miss for miss in result.report.misses), result.report.misses


def test_softmax_over_the_wrong_axis_is_refused(naive_v1):
    near = onnx.ModelProto.FromString(naive_v1.SerializeToString())
    for node in near.graph.node:
        if node.op_type == "Softmax":
            next(a for a in node.attribute if a.name == "axis").i = 2
    _assert_refused(near, "axis 2")


def test_lambda_on_the_wrong_branch_is_refused(naive_v1):
    """A1*lambda - A2 instead of A1 - lambda*A2."""
    near = onnx.ModelProto.FromString(naive_v1.SerializeToString())
    for sub in _diff_subs(near):
        first, scaled = sub.input
        mul = _producer(near, scaled)
        second = next(i for i in mul.input if _is_softmax(near, i))
        mul.input[list(mul.input).index(second)] = first
        sub.input[0], sub.input[1] = mul.output[0], second
    _assert_refused(near, "lambda multiplies the first term")


def test_difference_without_lambda_is_refused(naive_v1):
    """(A1 - A2) * lambda is not differential attention."""
    near = onnx.ModelProto.FromString(naive_v1.SerializeToString())
    for sub in _diff_subs(near):
        mul = _producer(near, sub.input[1])
        sub.input[1] = next(i for i in mul.input if _is_softmax(near, i))
    _assert_refused(near, "not Mul")


def test_cli_counts_expect_fused_and_lower(naive_v1, tmp_path):
    src = tmp_path / "in.onnx"
    onnx.save(naive_v1, src)
    ok = cli_main("optimize", src, "-o", tmp_path / "out.onnx", "--expect-fused", "2")
    assert ok.returncode == 0, ok.stderr
    assert "fused         2 differential attention(s)" in ok.stdout
    low = cli_main("optimize", tmp_path / "out.onnx", "-o", tmp_path / "low.onnx", "--lower")
    assert low.returncode == 0 and "lowered       2" in low.stdout, low.stderr
    lowered = onnx.load(str(tmp_path / "low.onnx"))
    assert not any(n.domain.startswith("diffexport") for n in lowered.graph.node) and not lowered.functions


def test_graph_without_differential_attention(tmp_path):
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, tmp_path / "plain.onnx")
    result = cli_main("optimize", tmp_path / "plain.onnx", "-o", tmp_path / "out.onnx")
    assert result.returncode == 0 and "fused         0" in result.stdout, result.stderr
    assert onnx.load(str(tmp_path / "out.onnx")).graph == model.graph
    strict = cli_main("optimize", tmp_path / "plain.onnx", "-o", tmp_path / "out2.onnx", "--expect-fused", "1")
    assert strict.returncode == 2 and "0 differential attention(s) fused, expected 1" in strict.stderr
    assert not (tmp_path / "out2.onnx").exists()


def test_bad_input_files(tmp_path):
    (tmp_path / "bad.onnx").write_bytes(b"not an onnx file at all")
    result = cli_main("optimize", tmp_path / "bad.onnx", "-o", tmp_path / "out.onnx")
    assert result.returncode == 2 and result.stderr.startswith("error: ") and "bad.onnx" in result.stderr
    with pytest.raises(DiffExportError, match="already has DiffAttention"):
        from diffexport.export import export_onnx

        export_onnx(load_model(None, preset="diff-v1-tiny"), tmp_path / "ours.onnx", log=lambda _: None)
        optimize_model(onnx.load(str(tmp_path / "ours.onnx")))


def hf_export(impl, opset, path, heads=8, kv_heads=4):
    """A plain torch.onnx export of an HF DiffLlamaForCausalLM (halves layout, GQA, weightless head norm)."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(heads + kv_heads)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
                                       num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=16,
                                       attn_implementation=impl)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    ids = torch.randint(0, 96, (2, 17), generator=torch.Generator().manual_seed(0))
    dims = ({0: torch.export.Dim("batch"), 1: torch.export.Dim("sequence")},)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        program = torch.onnx.export(Logits(hf), (ids,), dynamo=True, opset_version=opset, dynamic_shapes=dims,
                                    input_names=["input_ids"], output_names=["logits"], verbose=False)
    program.save(str(path))
    return hf, onnx.load(str(path))


@pytest.mark.parametrize("impl,opset,batch", [("eager", 18, 3), ("sdpa", 18, 3), ("eager", 23, 1), ("sdpa", 23, 1)])
def test_hf_diffllama_graphs_fuse(impl, opset, batch, tmp_path):
    """HF DiffLlama eager and sdpa at opsets 18 and 23 (at 23 its RotaryEmbedding nodes only run at batch 1)."""
    hf, source = hf_export(impl, opset, tmp_path / "hf.onnx")
    result = optimize_model(source)
    assert result.report.fired["stacked"] == 3 and result.report.total == 3, result.report
    assert result.verified_batch == (2 if opset == 18 else 1)
    nodes = [n for n in result.model.graph.node if n.op_type == contract.OP_NAME]
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in nodes[0].attribute}
    assert (attrs["variant"], attrs["num_heads"], attrs["head_dim"], attrs["causal"]) == (1, 4, 16, 1)
    # repeat_kv absorbed (8 query maps over 4 kv heads = 4 diff-heads over 2 kv-groups), except
    # behind the reshapes of torch's opset-18 SDPA decomposition
    assert attrs["num_kv_heads"] == (4 if (impl, opset) == ("sdpa", 18) else 2)
    # the weightless head norm and (1 - lambda_init) move into the nodes at opset 18; at opset 23 the
    # norm is an RMSNormalization whose (all-ones) scale is computed, not a constant, and stays
    if opset == 18:
        assert result.absorbed == 3 and attrs["norm"] == 1 and attrs["output_scale"] == pytest.approx(0.8)
    ids = np.random.default_rng(8).integers(0, 96, size=(batch, 21), dtype=np.int64)
    with torch.no_grad():
        expected = hf(input_ids=torch.from_numpy(ids), use_cache=False).logits.numpy()
    assert np.abs(ort_logits(result.model, ids) - expected).max() <= 1e-4


def test_optimize_records_provenance_and_check_against_the_input(naive_v1, tmp_path):
    """A third-party graph and what optimize made of it: `check fused --against plain` runs both
    on the same inputs under the dtype rule; a changed weight fails it; without --against the
    message says how to check such a file."""
    import json

    src, fused = tmp_path / "plain.onnx", tmp_path / "fused.onnx"
    onnx.save(naive_v1, src)
    assert cli_main("optimize", src, "-o", fused).returncode == 0
    meta = {p.key: p.value for p in onnx.load(str(fused), load_external_data=False).metadata_props}
    assert meta["diffexport.optimized_from"] == "plain.onnx"
    report = json.loads(meta["diffexport.optimize_report"])
    assert report["fused"] == 2 and report["rules"]["eq1"] == 2 and report["verified_max_abs"] < 1e-4

    ok = cli_main("check", fused, "--against", src, "--shapes", "1x1,2x9")
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "against plain.onnx" in ok.stderr and "PASS: 2/2" in ok.stdout and "polygraphy run" in ok.stdout

    tampered = onnx.ModelProto.FromString(naive_v1.SerializeToString())
    weight = max(tampered.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    values = onnx.numpy_helper.to_array(weight).copy()
    values *= 1.01  # a 1% change of the largest weight: far outside the fp32 rule, well inside atol 100
    weight.CopyFrom(onnx.numpy_helper.from_array(values, weight.name))
    onnx.save(tampered, tmp_path / "tampered.onnx")
    bad = cli_main("check", fused, "--against", tmp_path / "tampered.onnx", "--shapes", "2x9")
    assert bad.returncode == 1 and "FAIL" in bad.stdout

    loose = cli_main("check", fused, "--against", tmp_path / "tampered.onnx", "--shapes", "2x9", "--atol", "100")
    assert loose.returncode == 0 and "(user bounds)" in loose.stdout and "--atol 100 --rtol 0" in loose.stdout

    alone = cli_main("check", fused, "--preset", "diff-v1-tiny")
    assert alone.returncode == 2 and "--against THE_ORIGINAL.onnx" in alone.stderr
