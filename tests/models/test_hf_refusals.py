"""What ``from_pretrained`` refuses, and what it reads past: every config field is translated,
required at the implemented value, or inert metadata; damaged folders fail in one line naming
the file, before a single weight is loaded."""

from __future__ import annotations

import json
import shutil

import pytest

from llmlab.models import from_pretrained
from llmlab.models.hf import CheckpointError
from tests.helpers.hf_tiny import save_variant


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("refusals")
    return {n: save_variant(n, root)[1] for n in ("llama-gqa-bias-sharded", "gpt2-tied")}


def _copy_with(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is _DROP:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


_DROP = object()

# field -> (value, what the one-line message must say)
LLAMA_REFUSED = {
    "hidden_act": ("gelu", "hidden_act='gelu' is not supported"),
    "mlp_bias": (True, "mlp_bias=True is not supported"),
    "attention_dropout": (0.1, "attention_dropout=0.1 is not supported"),
    "rope_parameters": (
        {"rope_type": "longrope", "factor": 4.0, "rope_theta": 500.0},
        "rope_type='longrope' is not implemented",
    ),
    "rope_scaling": ({"type": "linear", "factor": 3.0}, "rope_scaling={'type': 'linear'"),
    "quantization_config": ({"quant_method": "gptq"}, "field 'quantization_config'"),
    "auto_map": ({"AutoModel": "x.y"}, "field 'auto_map'"),
    "num_experts": (8, "field 'num_experts'"),
    "model_type": ("llama4", "model_type='llama4' is not supported"),
    "architectures": (["LlamaForSequenceClassification"], "only the causal-LM head"),
    "partial_rotary_factor": (0.5, "partial_rotary_factor=0.5 is not supported"),
}
GPT2_REFUSED = {
    "activation_function": ("relu", "activation_function='relu' is not supported"),
    "n_inner": (64, "n_inner=64 is not supported"),
    "attn_pdrop": (0.2, "dropouts"),
    "scale_attn_by_inverse_layer_idx": (True, "scale_attn_by_inverse_layer_idx=True"),
    "reorder_and_upcast_attn": (True, "reorder_and_upcast_attn=True"),
    "add_cross_attention": (True, "add_cross_attention=True"),
}
# Metadata that changes neither the function nor its training: read past.
INERT = {
    "pretraining_tp": 1,
    "bos_token_id": 1,
    "eos_token_id": [2, 3],
    "initializer_range": 0.5,
    "use_cache": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.31.0",
    "max_length": 20,
    "_name_or_path": "meta-llama/Llama-3.2-1B",
}


@pytest.mark.parametrize(
    "family,field",
    [("llama", f) for f in LLAMA_REFUSED] + [("gpt2", f) for f in GPT2_REFUSED],
)
def test_an_unsupported_field_is_refused_in_one_line_naming_it(family, field, saved, tmp_path):
    value, message = (LLAMA_REFUSED if family == "llama" else GPT2_REFUSED)[field]
    src = saved["llama-gqa-bias-sharded" if family == "llama" else "gpt2-tied"]
    folder = _copy_with(src, tmp_path / "m", **{field: value})
    with pytest.raises(CheckpointError) as err:
        from_pretrained(folder)
    text = str(err.value)
    assert message in text and "config.json" in text and "\n" not in text, text


def test_inert_metadata_is_read_past(saved, tmp_path):
    folder = _copy_with(saved["llama-gqa-bias-sharded"], tmp_path / "m", **INERT)
    model = from_pretrained(folder)
    assert model.config.n_layer == 2


def test_a_missing_shard_names_the_file(saved, tmp_path):
    folder = _copy_with(saved["llama-gqa-bias-sharded"], tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=rf"{shard.name}: missing") as err:
        from_pretrained(folder)
    assert "\n" not in str(err.value)


def test_a_truncated_file_names_the_file(saved, tmp_path):
    folder = _copy_with(saved["gpt2-tied"], tmp_path / "m")
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated") as err:
        from_pretrained(folder)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"num_hidden_layers": 3}, "lacks tensor 'model.layers.2."),
        ({"num_hidden_layers": 1}, "holds tensor 'model.layers.1."),
        ({"intermediate_size": 40}, "has shape"),
        ({"attention_bias": False}, "holds tensor"),
        ({"tie_word_embeddings": True}, "holds tensor 'lm_head.weight', which differs"),
    ],
)
def test_a_config_that_disagrees_with_the_weights_names_the_folder(
    changes, message, saved, tmp_path
):
    folder = _copy_with(saved["llama-gqa-bias-sharded"], tmp_path / "m", **changes)
    with pytest.raises(CheckpointError, match=message) as err:
        from_pretrained(folder)
    assert str(folder) in str(err.value) and "\n" not in str(err.value)


def test_no_config_or_no_weights(saved, tmp_path):
    folder = _copy_with(saved["gpt2-tied"], tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no model\.safetensors and no"):
        from_pretrained(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match=r"config\.json: not valid JSON"):
        from_pretrained(folder)


def test_the_legacy_rope_spelling_reads_like_transformers_5s(tmp_path):
    """Hub folders of Llama 3.1/3.2 carry ``rope_theta`` and ``rope_scaling`` (written before
    transformers 5's ``rope_parameters``): both spellings give the same model."""
    import torch

    hf, folder = save_variant("llama3.2-rope-tied-headdim", tmp_path)
    config = json.loads((folder / "config.json").read_text())
    params = config.pop("rope_parameters")
    config["rope_theta"] = params.pop("rope_theta")
    config["rope_scaling"] = params
    (folder / "config.json").write_text(json.dumps(config))
    ours = from_pretrained(folder)
    assert ours.config.rope_scaling["rope_type"] == "llama3"
    ids = torch.randint(0, 96, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-5, rtol=0)


def _rename_in_header(file, old, new):
    """Rename tensor ``old`` to ``new`` in a safetensors file's JSON header, the data untouched
    (the header is re-padded to 8 bytes, as safetensors writes it)."""
    import struct

    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    header[new] = header.pop(old)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    file.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


def test_a_renamed_key_in_the_header_names_the_file_and_both_names(saved, tmp_path):
    """The model would miss a weight: refused, naming the file, the tensor config.json implies
    and the one the file holds instead."""
    folder = _copy_with(saved["gpt2-tied"], tmp_path / "m")
    _rename_in_header(folder / "model.safetensors", "transformer.ln_f.bias", "transformer.lnf.bias")
    with pytest.raises(CheckpointError) as err:
        from_pretrained(folder)
    message = str(err.value)
    assert message.startswith(
        f"{folder / 'model.safetensors'}: lacks tensor 'transformer.ln_f.bias'"
    )
    assert "'transformer.lnf.bias' instead" in message and "\n" not in message


def test_a_renamed_key_in_a_shard_names_the_shard(saved, tmp_path):
    folder = _copy_with(saved["llama-gqa-bias-sharded"], tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    name, shard = next(iter(sorted(index.items())))
    _rename_in_header(folder / shard, name, name + "_renamed")
    with pytest.raises(CheckpointError, match=rf"{shard}: lacks 1 tensor\(s\) the index") as err:
        from_pretrained(folder)
    assert repr(name) in str(err.value) and "\n" not in str(err.value)
