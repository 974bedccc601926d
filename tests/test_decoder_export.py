"""`diffexport onnx --kv-cache`: KV-cache decoder folders of V1 (affine head norm, GQA), V2, the baseline
Transformer and an HF DiffLlama with its tokenizer, as written (graph, genai_config.json, tokenizer,
dtypes, providers, end ids, search defaults) and refused at export, run by onnxruntime-genai and the
onnxruntime step loop token for token against eager."""


import json
import shutil

import pytest
import torch

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")

from decoder_helpers import NEW_TOKENS, PROMPT, eager_tokens, genai_tokens  # noqa: E402
from helpers import (  # noqa: E402
    assert_one_line_error,
    byte_bpe_tokenizer,
    cli_main,
    perturb_norm_weights,
    quiet,
)

from diffexport.backends import genai, step_loop  # noqa: E402
from diffexport.core import contract  # noqa: E402
from diffexport.core.eager_generation import Sampling  # noqa: E402
from diffexport.export import ExportOptions  # noqa: E402
from diffexport.export.decoder import export_decoder_graph as export_decoder  # noqa: E402
from diffexport.format.decoder_folder import cache_width  # noqa: E402
from diffexport.modeling.checkpoint import load_model, save_checkpoint, save_safetensors  # noqa: E402
from diffexport.modeling.families import build_model  # noqa: E402
from diffexport.modeling.presets import preset_config  # noqa: E402
from diffexport.validation.decoder import run_decoder_check  # noqa: E402
from diffexport.validation.options import CheckOptions  # noqa: E402

pytestmark = pytest.mark.slow  # exports, emulation or training: see README (quick loop)


def test_v1_folder_graph_and_genai_config(v1_folder, v1_ckpt):
    model = onnx.load(str(v1_folder / "model.onnx"))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_NAME]
    assert len(nodes) == 2 and all(len(n.input) == 6 for n in nodes)
    assert {o.domain: o.version for o in model.opset_import}[contract.ONNX_DOMAIN] == contract.KEY_MASK_VERSION
    assert [a.s.decode() for n in nodes for a in n.attribute if a.name == "plugin_version"] == ["2", "2"]
    inputs = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in model.graph.input}
    width = cache_width(load_model(v1_ckpt).config)
    assert inputs["input_ids"] == ["batch", "sequence"] and inputs["attention_mask"] == ["batch", "total_sequence"]
    assert inputs["past_key_values.1.value"] == ["batch", 1, "past_sequence", width]
    # each DiffAttention reads the graph's present output (past + new tokens, a Concat) through a view of
    # its unit axis: no transpose or re-pack of the cache outside the op
    producers = {o: n for n in model.graph.node for o in n.output}
    outputs = {o.name for o in model.graph.output}
    for node in nodes:
        for key_or_value in node.input[1:3]:
            view = producers[key_or_value]
            assert view.op_type in ("Squeeze", "Reshape"), view.op_type
            concat = producers[view.input[0]]
            assert concat.op_type == "Concat" and concat.output[0] in outputs
            assert any(i.startswith("past_key_values.") for i in concat.input)
    config = json.loads((v1_folder / "genai_config.json").read_text())
    decoder = config["model"]["decoder"]
    assert (decoder["head_size"], decoder["num_key_value_heads"], decoder["num_hidden_layers"]) == (width, 1, 2)
    assert config["search"]["past_present_share_buffer"] is False


def test_v1_genai_and_onnxruntime_loop_equal_eager_tokens(v1_folder, v1_ckpt):
    loaded = load_model(v1_ckpt)
    eos = json.loads((v1_folder / "genai_config.json").read_text())["model"]["eos_token_id"]
    expected = eager_tokens(loaded, eos=eos)
    assert genai_tokens(v1_folder) == expected
    run = step_loop.generate_stepped(v1_folder, PROMPT, NEW_TOKENS, Sampling())
    assert run.tokens == expected and len(expected) >= 32


@pytest.mark.parametrize("preset", ["diff-v2-tiny", "transformer-tiny"])
def test_v2_and_transformer_folders_generate_and_check(preset, tmp_path):
    model = perturb_norm_weights(build_model(preset_config(preset), seed=4), 4)
    save_safetensors(model, tmp_path / "st")
    loaded = load_model(tmp_path / "st")
    summary = export_decoder(loaded, tmp_path / "kv", log=quiet)
    assert summary.diff_attention_nodes == (0 if preset.startswith("transformer") else 2)
    eos = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["eos_token_id"]
    assert genai_tokens(tmp_path / "kv") == eager_tokens(loaded, eos=eos)
    report = run_decoder_check(tmp_path / "kv", loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()


def test_fp16_folder_passes_its_rule(tmp_path):
    loaded = load_model(None, preset="diff-v1-tiny", seed=6, dtype=torch.float16)
    export_decoder(loaded, tmp_path / "kv16", ExportOptions(dtype="float16"), log=quiet)
    model = onnx.load(str(tmp_path / "kv16" / "model.onnx"))
    assert {i.name: i.type.tensor_type.elem_type for i in model.graph.input}["past_key_values.0.key"] == \
        onnx.TensorProto.FLOAT16
    report = run_decoder_check(tmp_path / "kv16", loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed, report.text()
    assert "torch low-precision baseline" in report.text()


def test_hf_diffllama_folder_with_tokenizer(hf_dir, hf_kv):
    pytest.importorskip("onnxruntime_genai")
    assert (hf_kv / "tokenizer.json").is_file()
    config = json.loads((hf_kv / "genai_config.json").read_text())["model"]
    assert (config["eos_token_id"], config["pad_token_id"], config["context_length"]) == (2, 0, 512)
    loaded = load_model(hf_dir)
    # genai greedy tokens == eager == transformers' generate (HF stops at eos: compare up to it)
    import transformers

    hf = transformers.DiffLlamaForCausalLM.from_pretrained(hf_dir).eval()
    prompt = [1, 40, 41, 42, 60, 61]
    with torch.no_grad():
        hf_tokens = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False,
                                pad_token_id=0)[0, len(prompt):].tolist()
    ours = eager_tokens(loaded, prompt, eos=2)
    assert ours == hf_tokens
    assert genai_tokens(hf_kv, prompt) == ours
    report = run_decoder_check(hf_kv, loaded, CheckOptions(provider="cpu"), log=quiet)
    assert report.passed and "transformers generate() == eager" in report.text(), report.text()
    text = cli_main("generate", hf_kv, "--prompt", "the cat sat", "--max-new-tokens", "8")
    assert text.returncode == 0, text.stderr
    assert "decode" in text.stderr and "tokens/s" in text.stderr
    looped = cli_main("generate", hf_kv, "--prompt", "the cat sat", "--max-new-tokens", "8",
                     "--backend", "onnxruntime")
    assert looped.returncode == 0 and looped.stdout == text.stdout, looped.stderr


def test_hf_folder_without_tokenizer_exports_ids_only(tmp_path):
    """save_pretrained writes generation_config.json but no tokenizer: token ids only, eos from the config."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, eos_token_id=5)
    transformers.DiffLlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    summary = export_decoder(load_model(tmp_path / "hf"), tmp_path / "kv", log=quiet)
    assert not summary.tokenizer and not (tmp_path / "kv" / "tokenizer.json").exists()
    assert json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]["eos_token_id"] == 5


def test_kv_export_refuses_a_linked_tokenizer_file(tmp_path):
    real = tmp_path / "real"
    byte_bpe_tokenizer(real)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "tokenizer.json").symlink_to(real / "tokenizer.json")
    result = cli_main("onnx", "--preset", "diff-v1-tiny", "--kv-cache", "--tokenizer", linked, "-o", tmp_path / "kv")
    assert_one_line_error(result, "symbolic link")
    assert not (tmp_path / "kv").exists()


def test_kv_export_bad_targets_and_tokenizers(tmp_path, v1_ckpt):
    existing = tmp_path / "exists"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "-o", existing), "already exists")
    assert (existing / "keep.txt").read_text() == "mine"
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "--provider", "cpu", "-o", tmp_path / "a"),
                          "CPU provider has no bfloat16 kernels")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "--attention", "gqa", "-o", tmp_path / "a"),
                          "gqa folders are float32 or float16")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--provider", "cuda", "-o", tmp_path / "a.onnx"),
                          "belong to --kv-cache")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "-o", tmp_path / "a.onnx"), "writes a folder")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--tokenizer", tmp_path, "-o", tmp_path / "b.onnx"),
                          "belong to --kv-cache")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--threads", "0", "-o", tmp_path / "e"),
                          "--threads must be in 1..1024")
    for context in ("67108864", str(10**12)):  # gqa's rotary caches would grow with it: refused before tracing
        assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--attention", "gqa", "--context-length", context,
                                       "-o", tmp_path / "long"), "--context-length must be in 2..1,048,576")
    assert not (tmp_path / "long").exists()
    small = tmp_path / "tok"
    byte_bpe_tokenizer(small)  # 279 tokens: more than a 128-token vocabulary holds
    cfg = preset_config("diff-v1-tiny")
    cfg.vocab_size = 128
    too_small = save_checkpoint(build_model(cfg, seed=1), tmp_path / "v128.pt")
    result = cli_main("onnx", too_small, "--kv-cache", "--tokenizer", small, "-o", tmp_path / "c")
    assert_one_line_error(result, "not this model's tokenizer")
    assert_one_line_error(cli_main("onnx", v1_ckpt, "--kv-cache", "--tokenizer", tmp_path / "nope", "-o",
                                  tmp_path / "d"), "is not a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists", "tok", "v128.pt"]  # nothing half-written


def test_provider_in_the_folder_and_at_generate(v1_folder, v1_ckpt, tmp_path):
    """--provider names genai's execution provider in the folder; `generate --provider` overrides it."""
    pytest.importorskip("onnxruntime_genai")
    cuda = tmp_path / "cuda"
    assert cli_main("onnx", v1_ckpt, "--kv-cache", "--provider", "cuda", "-o", cuda).returncode == 0
    options = json.loads((cuda / "genai_config.json").read_text())["model"]["decoder"]["session_options"]
    assert options["provider_options"] == [{"cuda": {}}]
    assert json.loads((v1_folder / "genai_config.json").read_text())["model"]["decoder"]["session_options"][
        "provider_options"] == []  # the default: genai's CPU provider
    on_cpu = cli_main("generate", cuda, "--ids", "5,17,42", "--max-new-tokens", "6", "--provider", "cpu")
    as_exported = cli_main("generate", v1_folder, "--ids", "5,17,42", "--max-new-tokens", "6")
    assert on_cpu.returncode == 0 and on_cpu.stdout == as_exported.stdout != ""
    import onnxruntime_genai as og

    if not og.is_cuda_available():  # this onnxruntime-genai has no CUDA: one line that says what is missing
        assert_one_line_error(cli_main("generate", cuda, "--ids", "5,17", "--max-new-tokens", "2"), "needs the "
                              "onnxruntime-genai-cuda package")
    if "CUDAExecutionProvider" not in __import__("onnxruntime").get_available_providers():
        assert_one_line_error(cli_main("generate", v1_folder, "--ids", "5", "--backend", "onnxruntime", "--provider",
                                      "cuda"), "install onnxruntime-gpu")


def test_bf16_folder_is_for_cuda_and_tensorrt(v1_ckpt, tmp_path):
    """A bf16 folder names genai's CUDA provider, holds a bf16 cache, builds in TensorRT(-RTX) and is
    refused in one line where this machine's runtimes cannot run it (no bf16 CPU kernels)."""
    folder = tmp_path / "bf16"
    result = cli_main("onnx", v1_ckpt, "--kv-cache", "--bf16", "-o", folder)
    assert result.returncode == 0, result.stderr
    assert "cuda provider" in result.stdout
    config = json.loads((folder / "genai_config.json").read_text())
    assert config["model"]["decoder"]["session_options"]["provider_options"] == [{"cuda": {}}]
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    types = {i.name: i.type.tensor_type.elem_type for i in [*model.graph.input, *model.graph.output]}
    assert types["past_key_values.0.key"] == types["present.1.value"] == types["logits"] == onnx.TensorProto.BFLOAT16
    assert_one_line_error(cli_main("check", folder, "--ckpt", v1_ckpt), "bfloat16 folder")
    assert_one_line_error(cli_main("generate", folder, "--ids", "1,2", "--backend", "onnxruntime"), "bfloat16 folder")
    pytest.importorskip("tensorrt_rtx")
    engine = tmp_path / "bf16.engine"
    built = cli_main("trt", folder, "-o", engine, "--attention", "native", "--builder", "tensorrt-rtx", "--bf16",
                    "--max", "2x64", "--max-past", "64")
    assert built.returncode == 0, built.stderr
    assert "bf16" in built.stdout and json.loads(engine.with_name("bf16.engine.json").read_text())[
        "onnx_metadata"]["dtype"] == "bfloat16"


def test_generation_config_becomes_the_folders_search_defaults(tmp_path):
    """A checkpoint's generation_config.json (sampling, penalty, beams) lands in the folder's genai
    search block (values genai cannot take passed over, said in the log); `generate` follows it as
    transformers' generate() does: greedy with the checkpoint's repetition penalty equals
    transformers' tokens, the folder's sampling is used unless --greedy, the options override it."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    from diffexport.cli import build_parser
    from diffexport.cli.generate import generate_request
    from diffexport.format.decoder_folder import SEARCH_DEFAULTS

    torch.manual_seed(12)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                                       pad_token_id=0, bos_token_id=1, eos_token_id=2, max_position_embeddings=256)
    hf = transformers.DiffLlamaForCausalLM(cfg).eval()
    hf.generation_config.update(do_sample=True, temperature=0.7, top_p=0.9, repetition_penalty=1.3)
    hf.save_pretrained(tmp_path / "hf")
    path = tmp_path / "hf" / "generation_config.json"
    values = json.loads(path.read_text())
    values["early_stopping"] = "never"  # transformers' third value: genai takes a bool
    values["no_repeat_ngram_size"] = 2  # processors genai's folder leaves out; `check` must not apply them
    values["bad_words_ids"] = [[t] for t in range(3, 96, 2)]
    path.write_text(json.dumps(values))
    result = cli_main("onnx", tmp_path / "hf", "--kv-cache", "-o", tmp_path / "kv")
    assert result.returncode == 0, result.stderr
    assert "passed over early_stopping='never'" in result.stdout + result.stderr
    search = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["search"]
    assert {k: search[k] for k in SEARCH_DEFAULTS} == {**SEARCH_DEFAULTS, "do_sample": True, "temperature": 0.7,
                                                       "top_p": 0.9, "repetition_penalty": 1.3}
    prompt = [5, 17, 42, 9, 60]
    hf = transformers.DiffLlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():  # transformers reads the same generation_config: greedy, penalty 1.3
        expected = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                               pad_token_id=0, no_repeat_ngram_size=0, bad_words_ids=None)[0, len(prompt):].tolist()
        plain = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=12, min_new_tokens=12,
                            pad_token_id=0, repetition_penalty=1.0)[0, len(prompt):].tolist()
    assert expected != plain  # the checkpoint's penalty matters here
    for backend in ("genai", "onnxruntime"):
        out = cli_main("generate", tmp_path / "kv", "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "12",
                      "--greedy", "--backend", backend)
        assert out.returncode == 0, out.stderr
        assert [int(t) for t in out.stdout.split()] == expected, backend
        assert "repetition penalty 1.3" in out.stderr
    # check compares plain greedy decoding: transformers' side must not take the checkpoint's penalty
    report = run_decoder_check(tmp_path / "kv", load_model(tmp_path / "hf"), CheckOptions(provider="cpu"), log=quiet)
    assert report.passed and "transformers generate() == eager" in report.text(), report.text()
    config = json.loads((tmp_path / "kv" / "genai_config.json").read_text())

    def sampling(*flags):
        args = build_parser().parse_args(["generate", str(tmp_path / "kv"), "--ids", "1", *flags])
        return generate_request(args).sampling(config)

    folder = sampling()
    assert (folder.greedy, folder.temperature, folder.top_k, folder.top_p, folder.repetition_penalty) == \
        (False, 0.7, 50, 0.9, 1.3)
    assert sampling("--greedy").greedy and sampling("--greedy").repetition_penalty == 1.3
    mine = sampling("--temperature", "1.2", "--top-k", "0", "--repetition-penalty", "1.0")
    assert (mine.greedy, mine.temperature, mine.top_k, mine.top_p, mine.repetition_penalty) == (False, 1.2, 0, 0.9, 1.0)
    config["search"] = dict(SEARCH_DEFAULTS)  # a folder that does not sample: diffexport's own defaults
    plain = sampling("--sample")
    assert (plain.greedy, plain.temperature, plain.top_k, plain.top_p, plain.repetition_penalty) == \
        (False, 1.0, 0, 1.0, 1.0)
    assert sampling().greedy


def test_several_end_ids_all_stop_generation(tmp_path):
    """generation_config.json's eos_token_id as a list (Llama 3 chat models end a turn with
    <|eot_id|>, not the list's first id): the folder keeps the whole list, and genai, the
    onnxruntime loop and eager generate all stop at the first id of it that is generated."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("onnxruntime_genai")
    torch.manual_seed(5)
    cfg = transformers.DiffLlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=112, num_hidden_layers=1,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    transformers.DiffLlamaForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    loaded = load_model(tmp_path / "hf")
    prompt = [3, 4, 5, 6]
    free = eager_tokens(loaded, prompt, n=12)
    stop_at = next(i for i in range(1, 12) if free[i] not in free[:i])  # a token generated for the first time
    unused = next(t for t in range(96) if t not in free)
    generation = json.loads((tmp_path / "hf" / "generation_config.json").read_text())
    generation["eos_token_id"] = [unused, free[stop_at]]  # the first id is never generated
    (tmp_path / "hf" / "generation_config.json").write_text(json.dumps(generation))
    export_decoder(loaded, tmp_path / "kv", log=quiet)
    config = json.loads((tmp_path / "kv" / "genai_config.json").read_text())["model"]
    assert config["eos_token_id"] == [unused, free[stop_at]]
    expected = free[:stop_at + 1]
    assert eager_tokens(loaded, prompt, n=12, eos=config["eos_token_id"]) == expected
    assert genai.generate_genai(tmp_path / "kv", prompt, 12, Sampling()).tokens == expected
    looped = step_loop.generate_stepped(tmp_path / "kv", prompt, 12, Sampling())
    assert looped.tokens == expected and looped.stop == "eos"


def test_special_ids_outside_the_vocabulary_are_refused_at_export(artifacts, tmp_path):
    """A checkpoint folder whose generation_config.json names an eos (or pad, bos) id the model has
    no logit for: generation could never stop there, and the folder's reader would refuse it, so
    the export says so in one line and writes nothing (issue 43)."""
    source = tmp_path / "hf"
    shutil.copytree(artifacts.hf_diffllama(), source)
    (source / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 99_999], "pad_token_id": 0}))
    result = cli_main("onnx", source, "--kv-cache", "-o", tmp_path / "kv")
    assert_one_line_error(result, "eos_token_id 99999 (from the checkpoint's or tokenizer's generation_config.json")
    assert "vocabulary of 320 ids" in result.stderr and not (tmp_path / "kv").exists()
