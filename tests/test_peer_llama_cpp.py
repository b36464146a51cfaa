"""llama.cpp, the decode benchmark's peer, runs the weights the benchmark gives it: an HF Llama
converted by llama.cpp's own converter decodes greedily to HF ``generate``'s tokens (F32), and
its Q8_0 and Q4_0 files (llama.cpp's own quantizer) decode without a crash.

Skipped unless ``llama-cpp-python`` is installed (``make peers``; ``make install`` does not build
it) and llama.cpp's converter is where ``make install`` puts it."""

from __future__ import annotations

import pytest
import torch

from benchmarks import peer_llama_cpp as peer
from tests.helpers.hf_tiny import build_hf, hf_greedy

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(peer.unavailable() is not None, reason=str(peer.unavailable()))


def test_llama_cpp_decodes_the_benchmarks_weights_as_hf_does(tmp_path) -> None:
    # tied, as the benchmark's Llama; widths that Q4_0's blocks of 32 divide
    hf = build_hf("Llama", dict(tie_word_embeddings=True, intermediate_size=64))
    hf.save_pretrained(tmp_path / "hf")
    peer.add_tokenizer(tmp_path / "hf", hf.config.vocab_size)
    files = peer.convert(tmp_path / "hf", tmp_path / "gguf")
    assert set(files) == set(peer.TYPES)
    assert files["q4_0"].stat().st_size < files["q8_0"].stat().st_size < files["f32"].stat().st_size

    prompt = torch.randint(
        0, hf.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1)
    )
    want = hf_greedy(hf, prompt, 8)[0].tolist()
    for kind, path in files.items():
        got = peer.decode(path, prompt[0].tolist(), new_tokens=8, repeats=1)
        assert "error" not in got, (kind, got)
        assert len(got["tokens"]) == 8 and got["rate"] > 0
        if kind == "f32":
            assert got["tokens"] == want
