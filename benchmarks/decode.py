"""Decode at the sizes users run: tokens/s per weight format, against HF and the memory roofline.

Two models with random weights (no downloads), built in ``transformers`` and loaded into llmlab
with the same weights: GPT-2 small (124 M parameters) and a Llama-3.2-1B-shaped model (16
layers, width 2048, 32 query heads over 8 KV heads, MLP 8192, vocab 128256, tied embeddings).
Greedy decoding of one 32-token prompt at batch 1 (and 16 prompts at batch 16), two threads.

Systems: HF ``generate`` (fp32), and llmlab's serving engine (``LLM``) with the model's weights
as they are (fp32) and quantized by ``EngineConfig.quantize`` (bf16, int8, int4 group 32), each
also with ``EngineConfig.compile`` (decode steps through ``torch.compile``) at batch 1, and fp32
compiled at GPT-2's batch 16. The targets sit on the compiled rows, the engine's fastest. The
decode rate excludes the prompt: ``(N - 1) / (t(N new tokens) - t(1 new token))``, each time the
best of ``repeats`` interleaved rounds after one warm-up of every system.

The roofline: decoding one token reads every weight once, so its rate is at most the machine's
read rate over the bytes a token reads. The read rate is measured in the same run: the fastest
of three one-pass reads (a one-row ``F.linear``, llmlab's few-row kernel, ``torch.sum``) of an
fp32 matrix at the model's largest linear shape, the LM head (GPT-2: 50257 × 768, 154 MB; the
Llama: 128256 × 2048, 1 GB: far larger than any cache), read again before each timed round of
each system and after its last, so that each round's window is bracketed by two reads; a
roofline row holds the system's fastest round against the mean of its two neighbouring reads:
the machine's rate in that round's own window (see :class:`ReadProbe`; each row's extra fields
also give the fraction against the fastest read of all the system's rounds, how these rows
were computed before). Bytes per token: every linear layer's stored bytes (weights, scales,
biases), as the format stores them.

llama.cpp is the peer at batch 1 on the Llama (``benchmarks/peer_llama_cpp.py``): the same
weights saved as an HF folder, converted to GGUF F32 by llama.cpp's own converter and quantized
to Q8_0 and Q4_0 by its own quantizer, decoded by ``llama-cpp-python`` (``make peers`` builds it;
``make bench`` runs that first) in a child process each, with the same prompt, token count and
rate formula, against the engine's fastest configuration (compiled decode steps). Where it is
not installed the rows are absent and the notes say so.

Run: ``.venv/bin/python -m benchmarks.decode`` (``--smoke``: tiny models, seconds).
"""

from __future__ import annotations

import argparse
import copy
import gc
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks.common import Row, decode_rate, parse_args, report

SCHEMES = (None, "bf16", "int8", "int4")
ROOFLINE_TARGETS = {"fp32 compiled": 0.9, "bf16 compiled": 0.8, "int8 compiled": 0.65}
PROMPT = 32
# engine/llama.cpp window pairs after llama.cpp's first window: this host's read rate moves by
# up to 2x within minutes, and one pair let a single slow window decide a row (F32: 1.154x in
# one run, 0.7877x in the next, same code)
LLAMA_CPP_PAIRS = 2
# llama.cpp's file per engine system (each side at its fastest) and the target
LLAMA_CPP_PEERS = {"fp32 compiled": ("f32", 1.0), "int8 compiled": ("q8_0", 1.0),
                   "int4 compiled": ("q4_0", 0.8)}  # fmt: skip


def gpt2(smoke: bool):
    from transformers import GPT2Config, GPT2LMHeadModel

    from llmlab.models import GPT

    sizes = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512) if smoke else {}
    hf = GPT2LMHeadModel(GPT2Config(bos_token_id=None, eos_token_id=None, **sizes)).eval()
    return "GPT-2 124M" if not smoke else "GPT-2 tiny", hf, GPT.from_hf_gpt2(hf).eval()


def llama_1b(smoke: bool):
    import transformers

    from llmlab.models import Llama

    sizes = dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8,
    )  # fmt: skip
    if smoke:
        sizes = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config = transformers.LlamaConfig(
        **sizes, max_position_embeddings=2048, tie_word_embeddings=True, rope_theta=500000.0,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    hf = transformers.LlamaForCausalLM(config).eval()
    return "Llama-1B-shaped" if not smoke else "Llama tiny", hf, Llama.from_hf(hf).eval()


class ReadProbe:
    """The roofline's read rate: the fastest one-pass read of an fp32 matrix at the model's
    largest linear shape, measured once at the start and again in each system's own rounds.

    Three reads compete: a one-row ``F.linear`` (BLAS), llmlab's few-row kernel and
    ``torch.sum``. One alone is no bound: MKL's one-row product runs at 0.4-0.55x the others on
    the AMD EPYC hosts, and ``sum`` at ~0.7x a product on the Xeon hosts. The machines are
    shared, and what their memory delivers moves with the neighbours (the 1 GB matrix: 32-59
    GB/s within one run on an AMD EPYC): so before each timed round of a system and after
    its last (untimed for it) the probe reads the matrix with the fastest read for ~0.3 s, and
    a system's roofline is the read rate of its fastest round's window (:meth:`paired`).
    """

    def __init__(self, model: nn.Module, repeats: int) -> None:
        from llmlab.kernels.cpu_linear import linear

        shape = max((m.weight.shape for m in model.modules() if isinstance(m, nn.Linear)),
                    key=lambda s: s[0] * s[1])  # fmt: skip
        weight, x = torch.randn(*shape), torch.randn(1, shape[1])
        reads = {
            "one-row F.linear": lambda: F.linear(x, weight),
            "one-row llmlab kernel": lambda: linear(x, weight),
            "torch.sum": weight.sum,
        }
        times = {name: min(self._time(read) for _ in range(repeats + 1))
                 for name, read in reads.items()}  # fmt: skip
        self.method = min(times, key=times.get)
        self.read, self.shape, self.nbytes = reads[self.method], tuple(shape), weight.numel() * 4
        self.start_rate = self.nbytes / times[self.method]
        self.windows: dict[str, list[float]] = {}  # per key, each probe's mean rate (bytes/s)

    @staticmethod
    def _time(read) -> float:
        start = time.perf_counter()
        read()
        return time.perf_counter() - start

    def watching(self, key: str, seconds: float = 0.3):
        """A ``between`` for ``decode_rate``: reads for about ``seconds`` (as long as a round
        of a small model's decode: one read alone may catch a quiet instant that a round
        seconds long does not), kept as ``key``'s if its mean rate is the fastest yet."""

        def probe() -> None:
            reads, start = 0, time.perf_counter()
            while reads == 0 or time.perf_counter() - start < seconds:
                self.read()
                reads += 1
            per_read = (time.perf_counter() - start) / reads
            self.windows.setdefault(key, []).append(self.nbytes / per_read)

        return probe

    def rate(self, key: str) -> float:
        """Bytes/s: the fastest probe (its mean over its reads) in ``key``'s rounds."""
        return max(self.windows[key])

    def paired(self, key: str, rounds: list, batch: int, new_tokens: int):
        """``(tokens/s, bytes/s)`` of ``key``'s fastest round and the read rate of its own
        window (the mean of the probes just before and just after it), or None where no round
        has a positive decode time. The best probe of all rounds may fall in a window that no
        round saw: on the AMD host one 0.3 s probe read 59.8 GB/s while the compiled int8
        engine's rounds decoded at ~31 GB/s of weights, and ~37 between llama.cpp's windows of
        the same run (in a steadier window, each round against its own probes: 0.77-0.84)."""
        windows, best = self.windows.get(key, []), None
        for k, (one, everything) in enumerate(rounds):
            if everything <= one or k >= len(windows):
                continue
            rate = batch * (new_tokens - 1) / (everything - one)
            read = sum(windows[k : k + 2]) / len(windows[k : k + 2])
            if best is None or rate > best[0]:
                best = (rate, read)
        return best


def product_rows(name: str, shape: tuple[int, int], repeats: int) -> list[Row]:
    """One-row products at ``shape`` per weight format (``llmlab.kernels.quantized``) against
    the fp32 product, each as the fp32-equivalent read rate (weights × 4 bytes / time)."""
    from llmlab.kernels.cpu_linear import linear
    from llmlab.kernels.quantized import pack, quantized_matmul

    weight, x = torch.randn(*shape), torch.randn(1, shape[1])

    def best(fn) -> float:
        fn()
        times = []
        for _ in range(repeats + 2):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return min(times)

    fp32 = best(lambda: F.linear(x, weight))
    rows = []
    for kind, group in (("bf16", None), ("int8", None), ("int4", 32)):
        data, scales = pack(weight, kind, group)
        t = best(
            lambda data=data, scales=scales, kind=kind: quantized_matmul(x, data, scales, kind)
        )
        rows.append(Row(f"one-row product {shape[0]}x{shape[1]} ({name}'s LM head): {kind} vs fp32",
                        weight.numel() * 4 / t / 1e9, weight.numel() * 4 / fp32 / 1e9,
                        "fp32 F.linear", "fp32-equivalent GB/s"))  # fmt: skip
    # fp32 itself: the models' linear layers take llmlab's few-row kernel up to 8 rows
    for n in (1, 4, 8):
        xs = torch.randn(n, shape[1])
        ours, mkl = best(lambda xs=xs: linear(xs, weight)), best(lambda xs=xs: F.linear(xs, weight))
        rows.append(Row(f"{n}-row product {shape[0]}x{shape[1]} ({name}'s LM head): fp32 "
                        "few-row kernel vs F.linear", weight.numel() * 4 / ours / 1e9,
                        weight.numel() * 4 / mkl / 1e9, "fp32 F.linear (MKL)", "GB/s"))  # fmt: skip
    return rows


def bytes_per_token(model: nn.Module) -> int:
    """Stored bytes of every linear layer (what a batch-1 token reads), ties counted once."""
    seen: dict[int, int] = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "QuantizedLinear":
            for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)):
                seen[t.data_ptr()] = t.numel() * t.element_size()
    return sum(seen.values())


@dataclass
class Measured:
    """What :func:`measure` found for one model and batch size."""

    rates: dict  # tokens/s per system ("hf", "generate+compile", "fp32", "int8 compiled", ...)
    same: dict  # per engine system: how many of HF's tokens it reproduced
    sizes: dict  # per engine system: weight bytes a token reads
    ids: torch.Tensor  # the prompt
    want: list  # HF's greedy tokens
    runs: dict  # decode functions of the systems asked to be kept (engines still alive)
    paired: dict  # per system: (tokens/s of its fastest round, read rate of that round's window)


def measure(
    hf,
    model,
    batch: int,
    new_tokens: int,
    repeats: int,
    smoke: bool,
    compiled_schemes: tuple,
    probe: ReadProbe,
    keep: tuple = (),
) -> Measured:
    """Decode rates per system (each with ``probe`` reading in its rounds), tokens equal to
    HF's, bytes per token, the prompt, HF's tokens, and the ``run`` of the systems in ``keep``
    (their engines stay alive for the llama.cpp rows)."""
    from llmlab.decoding import GenerationConfig
    from llmlab.serving import LLM

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (batch, PROMPT), generator=torch.Generator().manual_seed(1))
    prompts = ids.tolist()

    def hf_run(n: int):
        return hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                           max_new_tokens=n, min_new_tokens=n, pad_token_id=0)  # fmt: skip

    rounds: dict[str, list] = {}

    def timed(key: str, run) -> float:
        """``decode_rate`` of ``run`` with ``probe`` reading before each round and once after
        the last (each round's window is bracketed), its rounds kept as ``key``'s."""
        watch = probe.watching(key)
        rate = decode_rate(run, new_tokens, repeats, batch, watch, rounds.setdefault(key, []))
        watch()
        return rate

    rates = {"hf": timed("hf", hf_run)}
    want = hf_run(new_tokens)[:, PROMPT:].tolist()
    same, sizes, kept = {}, {}, {}
    if batch == 1 and not smoke:  # llmlab's generate, its forward compiled over a static cache
        from llmlab.decoding import generate

        def compiled(n: int):
            return generate(model, ids, max_new_tokens=n, compile=True)

        rates["generate+compile"] = timed("generate+compile", compiled)
    systems = [(scheme or "fp32", scheme, False) for scheme in SCHEMES]
    # EngineConfig.compile (decode steps through torch.compile) for ``compiled_schemes``
    systems += [(f"{scheme or 'fp32'} compiled", scheme, True) for scheme in compiled_schemes]
    for key, scheme, compile_steps in systems:
        # the engine quantizes the model it is given in place: give it a copy, keep the original
        target = model if scheme is None else copy.deepcopy(model)
        llm = LLM(target, block_size=16, max_num_seqs=batch, max_num_batched_tokens=512,
                  max_model_len=PROMPT + new_tokens + 8, quantize=scheme,
                  compile=compile_steps)  # fmt: skip

        def run(n: int, llm=llm):
            cfg = GenerationConfig(max_new_tokens=n)
            return llm.generate(prompts, cfg, progress=False)

        rates[key] = timed(key, run)
        got = [o.token_ids[0] for o in run(new_tokens)]
        same[key] = sum(g == w for g, w in zip(got, want))
        sizes[key] = bytes_per_token(target)
        if key in keep:
            kept[key] = run
        del llm, target, run
        gc.collect()
    paired = {key: probe.paired(key, r, batch, new_tokens) for key, r in rounds.items()}
    return Measured(rates, same, sizes, ids, want, kept, paired)


def window_roofline(found: Measured, probe: ReadProbe, key: str, token_bytes: float):
    """``(tokens/s, read bytes/s, extra)`` for ``key``'s roofline row: its fastest round and the
    read rate of that round's own window (:meth:`ReadProbe.paired`; where no round qualifies,
    as at smoke sizes, its best-of rate and fastest probe). ``extra``: the row's extra fields,
    with the fraction against the fastest probe of all its rounds (how these rows were computed
    before); ``token_bytes``: bytes a token reads (per sequence)."""
    paired = found.paired.get(key)
    rate, read = paired if paired else (found.rates[key], probe.rate(key))
    fastest = probe.rate(key)
    extra = {
        "read GB/s": round(read / 1e9, 1),
        "fastest probe GB/s": round(fastest / 1e9, 1),
        "of the fastest probe's roofline": round(found.rates[key] * token_bytes / fastest, 4),
    }
    return rate, read, extra  # fmt: skip


def llama_cpp_rows(name: str, hf, found: Measured, new_tokens: int, repeats: int):
    """Rows of llmlab's engine against llama.cpp on ``hf``'s weights (F32 against fp32, Q8_0
    against int8, Q4_0 against int4 group 32, batch 1; each side at its fastest: the engine's
    compiled decode steps), and a note (what failed, file sizes).
    Each format alternates windows: llama.cpp, then the engine (``found.runs``) and llama.cpp
    again ``LLAMA_CPP_PAIRS`` times; each side's rate is its best window (the engine's first
    window is ``found.rates``'s), so that neither side alone meets a busy neighbour."""
    import tempfile
    from pathlib import Path

    from benchmarks import peer_llama_cpp as peer

    why = peer.unavailable()
    if why:
        return [], f"llama.cpp not measured ({why})"
    rows, notes = [], []
    with tempfile.TemporaryDirectory(prefix="llmlab-gguf-") as tmp:
        folder = Path(tmp) / "hf"
        hf.save_pretrained(folder)
        peer.add_tokenizer(folder, hf.config.vocab_size)
        try:
            files = peer.convert(folder, Path(tmp) / "gguf")
        except RuntimeError as err:
            return [], f"llama.cpp not measured (GGUF conversion failed: {err})"
        for path in folder.glob("*.safetensors"):
            path.unlink()  # the weights now live in the GGUF files: free the disk and cache
        prompt = found.ids[0].tolist()
        for key, (kind, target) in LLAMA_CPP_PEERS.items():
            ours = [found.rates[key]]
            windows = [peer.decode(files[kind], prompt, new_tokens, repeats)]
            for _ in range(LLAMA_CPP_PAIRS):  # the engine again, between windows of llama.cpp
                if "error" in windows[-1]:
                    break
                ours.append(decode_rate(found.runs[key], new_tokens, repeats))
                windows.append(peer.decode(files[kind], prompt, new_tokens, repeats))
            got = windows[-1]
            if "error" in got:
                notes.append(f"llama.cpp {kind.upper()} failed: {got['error']}")
                continue
            same = sum(g == w for g, w in zip(got["tokens"], found.want[0]))
            extra = {
                "llama.cpp same as HF": f"{same}/{len(found.want[0])}",
                "GGUF MB": round(got["bytes"] / 1e6),
                "windows (engine; llama.cpp)": "; ".join(
                    ", ".join(f"{r:.3g}" for r in side)
                    for side in (ours, [w["rate"] for w in windows])
                ),
            }
            label = f"decode {name} batch 1 {key}: engine vs llama.cpp {kind.upper()}"
            rows.append(
                Row(
                    label,
                    max(ours),
                    max(w["rate"] for w in windows),
                    f"llama.cpp {kind.upper()}",
                    "tokens/s",
                    target=target,
                    extra=extra,
                )
            )
    notes.append(
        "llama.cpp: llama-cpp-python 0.3.36 (built here without AMX), 2 threads, "
        "Q8_0/Q4_0 quantized from the F32 file with pure=True, Q4_0's output layer "
        "(tied embedding) at Q8_0 as llmlab's int4 keeps it at int8"
    )
    return rows, "; ".join(notes)


def main() -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.split("\n")[0]))
    torch.set_num_threads(2)
    torch.manual_seed(0)
    new_tokens, repeats = (6, 1) if args.smoke else (24, 3)
    rows, notes = [], []
    for build in (gpt2, llama_1b) if not args.smoke else (llama_1b,):
        name, hf, model = build(args.smoke)
        with torch.inference_mode():
            probe = ReadProbe(model, repeats)
            rows += product_rows(name, probe.shape, repeats)
            for batch in (1, 16) if not args.smoke else (1, 2):
                # batch 16's prefills cost minutes at 1B: one timed round of fewer tokens
                tokens, rounds = (new_tokens, repeats) if batch == 1 else (12, 1)
                # compile=True too: every format at batch 1, fp32 at GPT-2's batch 16 (a 1B
                # model's batch-16 rounds are minutes each already)
                compiled = SCHEMES if batch == 1 else (None,) if build is gpt2 else ()
                with_peer = batch == 1 and build is llama_1b
                found = measure(
                    hf, model, batch, tokens, rounds, args.smoke, compiled, probe,
                    keep=tuple(LLAMA_CPP_PEERS) if with_peer else (),
                )  # fmt: skip
                if with_peer:
                    peer_rows, peer_note = llama_cpp_rows(name, hf, found, tokens, rounds)
                    rows += peer_rows
                    notes.append(peer_note)
                found.runs.clear()  # the kept engines: free their weights and pools
                gc.collect()
                rates, same, sizes = found.rates, found.same, found.sizes
                for key in sizes:
                    # tokens/s if only the weights' bytes mattered, at the rate the machine read
                    # in the window of this system's fastest round
                    rate, read, extra = window_roofline(found, probe, key, sizes[key] / batch)
                    roof = read / sizes[key] * batch
                    label = f"{name} batch {batch} {key}"
                    # the targets, on the engine's fastest configuration (compiled):
                    # 1.3x HF on GPT-2 in fp32, fractions of the roofline on the 1B model
                    goal = (key, batch, build) == ("fp32 compiled", 1, gpt2)
                    at_1b = build is llama_1b and not args.smoke
                    roof_goal = ROOFLINE_TARGETS.get(key) if at_1b else None
                    rows.append(Row(f"decode {label}: engine vs HF generate (fp32)", rates[key],
                                    rates["hf"], "HF generate fp32", "tokens/s",
                                    target=1.3 if goal else None,
                                    extra={"same as HF": f"{same[key]}/{batch}"}))  # fmt: skip
                    if batch == 1:
                        rows.append(Row(f"decode {label}: engine vs its roofline", rate, roof,
                                        f"roofline ({sizes[key] / 1e6:.0f} MB/token)",
                                        "tokens/s", target=roof_goal,
                                        extra=extra))  # fmt: skip
                if "generate+compile" in rates:
                    rows.append(Row(f"decode {name} batch 1: llmlab generate(compile=True) vs "
                                    "HF generate", rates["generate+compile"], rates["hf"],
                                    "HF generate fp32", "tokens/s"))  # fmt: skip
                rate, read, extra = window_roofline(found, probe, "hf", sizes["fp32"] / batch)
                rows.append(Row(f"decode {name} batch {batch}: HF generate vs its roofline",
                                rate, read / sizes["fp32"] * batch, "roofline (fp32)",
                                "tokens/s", extra=extra))  # fmt: skip
            rates_seen = [probe.rate(key) / 1e9 for key in probe.windows]
            notes.append(f"{name}: read rate {probe.start_rate / 1e9:.1f} GB/s at the start (the "
                         f"fastest read of an fp32 {probe.shape[0]} x {probe.shape[1]} matrix: "
                         f"{probe.method}), {min(rates_seen):.1f}-{max(rates_seen):.1f} GB/s in "
                         "the systems' rounds (each roofline row: its own)")  # fmt: skip
        del hf, model
        gc.collect()
    notes.append(
        f"Greedy, prompt {PROMPT}, decode rate over {new_tokens - 1} tokens after the first "
        f"(best of {repeats}; batch 16: one round of 12 tokens), 2 threads, random weights. "
        "Quantized tokens differ from fp32's by design (the error is judged by perplexity, not "
        "here)."
    )
    report("decode", rows, "; ".join(notes))


if __name__ == "__main__":
    start = time.perf_counter()
    main()
    print(f"total {time.perf_counter() - start:.0f}s")
