"""An export's metadata as a typed record (format/metadata.py), every key named once
(format/metadata_keys.py), and the model families' attention facts on their config classes."""

import json

import pytest

from diffexport.core import contract
from diffexport.core.errors import DiffExportError
from diffexport.format import metadata_keys as keys
from diffexport.format.decoder_folder import cache_width
from diffexport.format.metadata import ExportMetadata, check_export_metadata, quant_budget
from diffexport.modeling.diff_v1 import DiffV1Config
from diffexport.modeling.diff_v2 import DiffV2Config
from diffexport.modeling.families import FAMILIES
from diffexport.modeling.transformer import TransformerConfig


def test_each_family_states_its_attention():
    v1 = DiffV1Config(d_model=96, n_heads=3, n_kv_heads=1, head_dim=16)
    v2 = DiffV2Config(d_model=96, n_heads=6, n_kv_heads=2, head_dim=16)
    base = TransformerConfig(d_model=96, n_heads=6, n_kv_heads=3, head_dim=16)
    def facts(cfg):
        return cfg.differential, cfg.attention_maps, cfg.value_dim, cfg.contract_variant

    assert facts(v1) == (True, 6, 32, contract.VARIANT_V1) and facts(v2) == (True, 12, 16, contract.VARIANT_V2)
    assert facts(base) == (False, 6, 16, None)
    # the KV cache's width per token: one kv head's keys (two maps in V1) equal its value's width
    assert [cache_width(c) for c in (v1, v2, base)] == [1 * 32, 2 * 16, 3 * 16]
    assert set(FAMILIES) == {c.family for c in (v1, v2, base)}


def _stored(**extra):
    return {keys.FAMILY: "diff_v1", keys.CONFIG: json.dumps(DiffV1Config().to_dict()), keys.DTYPE: "float16",
            **extra}


def test_the_record_reads_what_the_keys_hold():
    meta = check_export_metadata(_stored(**{keys.KV_CACHE: "1", keys.ATTENTION: "gqa",
                                            keys.WEIGHT_QUANT: json.dumps({"bits": 4})}), "model.onnx")
    assert isinstance(meta, ExportMetadata) and meta[keys.DTYPE] == "float16"  # the stored strings stay
    assert (meta.family, meta.dtype, meta.is_decoder, meta.attention) == ("diff_v1", "float16", True, "gqa")
    assert meta.model_config == DiffV1Config() and meta.model_config is meta.model_config  # parsed once
    assert meta.record(keys.WEIGHT_QUANT) == {"bits": 4} and meta.record(keys.QDQ) is None
    assert quant_budget(meta).what == quant_budget({keys.WEIGHT_QUANT: json.dumps({"bits": 4})}).what
    assert quant_budget(check_export_metadata(_stored(), "m.onnx")) is None
    assert keys.stored_key(keys.CONFIG) == "diffexport.config"


@pytest.mark.parametrize("stored, message", [
    (_stored(**{keys.DTYPE: "float8"}), "unknown dtype 'float8'"),
    (_stored(**{keys.CONFIG: "{not json"}), "is not a model configuration"),
    (_stored(**{keys.FAMILY: "diff_v9"}), "is not a model configuration"),
])
def test_the_record_refuses_what_is_not_an_export(stored, message):
    with pytest.raises(DiffExportError) as caught:
        check_export_metadata(stored, "model.onnx")
    assert message in str(caught.value)


def test_a_record_that_is_not_json_is_one_line():
    meta = check_export_metadata(_stored(**{keys.QDQ: "[1, 2"}), "model.onnx")
    with pytest.raises(DiffExportError) as caught:
        meta.record(keys.QDQ)
    assert "diffexport.qdq metadata is not a quantisation record" in str(caught.value)
