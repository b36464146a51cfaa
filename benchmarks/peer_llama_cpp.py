"""llama.cpp as the decode benchmark's peer: the same weights as GGUF files, decoded greedily.

Files: F32 by llama.cpp's own converter (``convert_hf_to_gguf.py``, which ``make install``
extracts into ``.venv/peers/llama.cpp``) from the HF folder the benchmark saves; Q8_0 and Q4_0
from that F32 file by llama.cpp's own quantizer (``llama_model_quantize``, what ``llama-quantize``
runs), every 2-D tensor in the named type (``pure``: no mixture of k-quants), except that the
Q4_0 file keeps its output layer (and an embedding tied to it) at Q8_0, as llmlab's int4 keeps
it at int8: both read about the same bytes per token. The decoder is ``llama-cpp-python``
(``make peers`` builds it from source; it is not part of ``make install``).

Each measurement runs in its own process (``python -m benchmarks.peer_llama_cpp FILE ...``): a
crash in the native library ends that process only, and the benchmark reports it as a row's note.
The decode rate is the engine's (``benchmarks.common.decode_rate``): ``(N - 1) / (t(N new tokens)
- t(1))``, each time the best of ``repeats`` rounds after a warm-up, the prompt evaluated afresh
every round.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks.common import decode_rate

ROOT = Path(__file__).resolve().parents[1]
CONVERTER = Path(os.environ.get("LLMLAB_LLAMA_CPP") or ROOT / ".venv" / "peers" / "llama.cpp")
TYPES = ("f32", "q8_0", "q4_0")
FTYPES = {"q8_0": 7, "q4_0": 2}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q8_0, LLAMA_FTYPE_MOSTLY_Q4_0
GGML_TYPE_Q8_0 = 8


def unavailable() -> str | None:
    """Why llama.cpp cannot be measured here (None: it can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (make peers builds it)"
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        return f"llama.cpp's converter is not at {CONVERTER} (make install puts it there)"
    return None


def add_tokenizer(folder: Path, vocab_size: int) -> None:
    """A SentencePiece tokenizer in ``folder``: the converter reads one with the weights. Its
    pieces are few; the converter pads the vocabulary to ``vocab_size`` ids (decoding here works
    on ids, never text)."""
    import sentencepiece as spm

    text = folder / "tokenizer-text.txt"
    text.write_text("\n".join(f"the quick brown fox {i} jumps over the dog" for i in range(200)))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(folder / "tokenizer"),
        vocab_size=min(96, vocab_size),
        model_type="bpe",
        minloglevel=2,
    )
    text.unlink()


def convert(hf_folder: Path, out_dir: Path, types: tuple[str, ...] = TYPES) -> dict[str, Path]:
    """GGUF files of ``hf_folder`` (weights and config saved by ``save_pretrained``), one per
    type in ``types``: F32 by llama.cpp's converter, the others quantized from it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    f32 = out_dir / "model-f32.gguf"
    env = {**os.environ, "PYTHONPATH": str(CONVERTER / "gguf-py")}
    command = [
        sys.executable,
        str(CONVERTER / "convert_hf_to_gguf.py"),
        str(hf_folder),
        "--outfile",
        str(f32),
        "--outtype",
        "f32",
    ]
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed: {done.stderr[-2000:]}")
    files = {"f32": f32}
    for kind in types:
        if kind != "f32":
            files[kind] = out_dir / f"model-{kind}.gguf"
            command = [
                sys.executable,
                "-m",
                "benchmarks.peer_llama_cpp",
                "quantize",
                str(f32),
                str(files[kind]),
                kind,
            ]
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
            if done.returncode:
                raise RuntimeError(
                    f"llama_model_quantize to {kind} failed (exit "
                    f"{done.returncode}): {done.stderr[-2000:]}"
                )
    return files


def decode(file: Path, prompt: list[int], new_tokens: int, repeats: int, threads: int = 2) -> dict:
    """``{"rate": tokens/s, "tokens": [...], "bytes": file size}`` of greedy decoding of
    ``prompt`` from ``file``, measured in a child process; ``{"error": ...}`` where it failed
    (a crash included)."""
    command = [
        sys.executable,
        "-m",
        "benchmarks.peer_llama_cpp",
        "decode",
        str(file),
        ",".join(map(str, prompt)),
        str(new_tokens),
        str(repeats),
        str(threads),
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        tail = done.stderr.strip().splitlines()[-3:]
        return {"error": f"exit {done.returncode} ({' | '.join(tail)[-300:]})"}
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------ in the child process
def _quantize(source: str, target: str, kind: str) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.pure, params.nthread = FTYPES[kind], True, 2
    if kind == "q4_0":  # the output layer (the embedding where tied) at Q8_0, as llmlab's int4
        params.output_tensor_type = params.token_embedding_type = GGML_TYPE_Q8_0
    code = llama_cpp.llama_model_quantize(source.encode(), target.encode(), params)
    if code:
        raise SystemExit(f"llama_model_quantize returned {code}")


def _decode(file: str, prompt: list[int], new_tokens: int, repeats: int, threads: int) -> dict:
    import llama_cpp

    llm = llama_cpp.Llama(
        model_path=file,
        n_ctx=len(prompt) + new_tokens + 8,
        n_batch=64,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(n: int) -> list[int]:
        llm.reset()  # the prompt is evaluated afresh every round, as the other systems do
        out = []
        for token in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            out.append(token)
            if len(out) == n:
                return out
        return out

    rate = decode_rate(run, new_tokens, repeats)
    tokens = run(new_tokens)
    return {"rate": rate, "tokens": tokens, "bytes": Path(file).stat().st_size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quantize", help="SOURCE.gguf TARGET.gguf TYPE (q8_0 or q4_0)")
    q.add_argument("source")
    q.add_argument("target")
    q.add_argument("kind", choices=sorted(FTYPES))
    d = sub.add_parser("decode", help="FILE PROMPT_IDS NEW_TOKENS REPEATS THREADS: prints JSON")
    d.add_argument("file")
    d.add_argument("prompt", help="comma-separated token ids")
    d.add_argument("new_tokens", type=int)
    d.add_argument("repeats", type=int)
    d.add_argument("threads", type=int)
    args = parser.parse_args()
    if args.command == "quantize":
        _quantize(args.source, args.target, args.kind)
    else:
        prompt = [int(t) for t in args.prompt.split(",")]
        result = _decode(args.file, prompt, args.new_tokens, args.repeats, args.threads)
        print(json.dumps(result))


if __name__ == "__main__":
    main()
