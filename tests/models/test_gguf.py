"""GGUF files of the Llama family in: weights equal the ``gguf`` package's own dequantization,
logits match the HF model the file was made from (F32: 1e-5; F16 and Q8_0: 2e-2 relative), and
what cannot be read exactly is refused by name.

The files are written the way llama.cpp's ``convert_hf_to_gguf.py`` writes them (its metadata
keys, tensor names, q/k row permutation, 1-D tensors kept F32, ``gguf.quants.quantize`` for the
block types), with the ``gguf`` package's writer. Where llama.cpp's own converter is at hand
(``make install`` extracts it from llama-cpp-python's source package into
``.venv/peers/llama.cpp``; ``LLMLAB_LLAMA_CPP`` names another checkout), a test converts an HF
folder with it too: F32 within 1e-5 of HF's logits, Q8_0 within 2e-2."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")

from gguf.quants import dequantize, quantize  # noqa: E402

from llmlab.models import from_pretrained  # noqa: E402
from llmlab.models.gguf import read_gguf, unpermute  # noqa: E402

Q = gguf.GGMLQuantizationType


def hf_llama(tied: bool = False):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rms_norm_eps=1e-5, tie_word_embeddings=tied,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).eval()


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half pairs -> adjacent pairs)."""
    return (
        w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def write_gguf(hf, path: Path, qtype) -> Path:
    c = hf.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.detach().numpy().astype(np.float32)
        if name.startswith("model.layers."):
            _, _, layer, leaf = name.split(".", 3)
            new = f"blk.{layer}.{LAYER[leaf]}"
            if leaf == "self_attn.q_proj.weight":
                data = permute(data, c.num_attention_heads)
            elif leaf == "self_attn.k_proj.weight":
                data = permute(data, c.num_key_value_heads)
        else:
            new = NAMES[name]
        if data.ndim == 1 or qtype == Q.F32:  # the converter keeps 1-D tensors in F32
            writer.add_tensor(new, data)
        elif qtype == Q.F16:
            writer.add_tensor(new, data.astype(np.float16))
        else:
            writer.add_tensor(new, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def logits(model, ids):
    with torch.no_grad():
        out = model(ids)
    return out.logits if hasattr(out, "logits") else out


@pytest.mark.parametrize(
    ("qtype", "rel"), [(Q.F32, 1e-5), (Q.F16, 2e-2), (Q.Q8_0, 2e-2), (Q.Q4_0, None)]
)
@pytest.mark.parametrize("tied", [False, True])
def test_a_gguf_file_loads_as_the_model_it_was_made_from(tmp_path, qtype, rel, tied):
    hf = hf_llama(tied)
    path = write_gguf(hf, tmp_path / "model.gguf", qtype)
    model = from_pretrained(path).eval()
    # every weight is the gguf package's dequantization of what the file holds
    reader = gguf.GGUFReader(path)
    held = {t.name: t for t in reader.tensors}
    q = held["blk.1.attn_q.weight"]
    want = torch.from_numpy(dequantize(q.data, q.tensor_type).reshape(64, 64).copy())
    assert torch.equal(model.blocks[1].attn.q_proj.weight, unpermute(want, 4))
    emb = held["token_embd.weight"]
    want = dequantize(emb.data, emb.tensor_type).reshape(96, 64)
    assert torch.equal(model.embed.tokens.weight, torch.from_numpy(want.copy()))
    assert (model.head.lm_head.weight is model.embed.tokens.weight) == tied
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    got, ref = logits(model, ids), logits(hf, ids)
    if rel is not None:
        assert float((got - ref).abs().max() / ref.abs().max()) < rel
    if qtype == Q.F32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_unreadable_and_unsupported_files_are_refused_by_name(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match=r"bad.gguf: not a readable GGUF file"):
        from_pretrained(bad)
    writer = gguf.GGUFWriter(tmp_path / "gpt2.gguf", "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=r"general.architecture='gpt2' is not supported"):
        read_gguf(tmp_path / "gpt2.gguf")


# make install puts llama.cpp's converter here (from llama-cpp-python's source package)
LLAMA_CPP = os.environ.get("LLMLAB_LLAMA_CPP") or str(
    Path(__file__).resolve().parents[2] / ".venv" / "peers" / "llama.cpp"
)


@pytest.mark.skipif(
    not (Path(LLAMA_CPP) / "convert_hf_to_gguf.py").is_file(),
    reason=f"llama.cpp's own converter is not at {LLAMA_CPP} (make install puts it there; or set "
    "LLMLAB_LLAMA_CPP to a llama.cpp checkout)",
)
@pytest.mark.parametrize(("outtype", "rel"), [("f32", 1e-5), ("q8_0", 2e-2)])
def test_a_file_from_llama_cpps_converter_loads(tmp_path, outtype, rel):
    import sentencepiece as spm

    hf = hf_llama()
    hf.save_pretrained(tmp_path / "hf")
    # the converter reads the folder's tokenizer too: a SentencePiece model of the same 96 ids
    text = tmp_path / "text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the dog" for i in range(200)))
    prefix = str(tmp_path / "hf" / "tokenizer")
    spm.SentencePieceTrainer.train(input=str(text), model_prefix=prefix, vocab_size=96,
                                   model_type="bpe", minloglevel=2)  # fmt: skip
    out = tmp_path / f"model-{outtype}.gguf"
    script = Path(LLAMA_CPP) / "convert_hf_to_gguf.py"
    env = {**os.environ, "PYTHONPATH": str(Path(LLAMA_CPP) / "gguf-py")}
    command = [sys.executable, script, tmp_path / "hf", "--outfile", out, "--outtype", outtype]
    subprocess.run(command, check=True, env=env, capture_output=True)
    ids = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(3))
    got, ref = logits(from_pretrained(out).eval(), ids), logits(hf, ids)
    assert float((got - ref).abs().max() / ref.abs().max()) < rel
