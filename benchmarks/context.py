"""Context parallelism: activation memory per rank, per-rank attention work, hidden communication.

Three measurements, each on gloo ranks on this machine (``run_distributed``, one intra-op
thread per rank):

* **Activation memory per rank** against the context degree ``N``: the bytes one training
  forward of a small Llama (loss included) keeps for backward (``saved_activation_bytes``) on
  each rank of ``N`` with ring attention, against the unsplit model's bytes divided by ``N``.
  Target: ∝ 1/N within 15 %.
* **Per-rank attention work**, zigzag against contiguous: the (query, key) pairs each rank
  scores (exact, from the block plan) and the CPU time each rank's thread spends in one ring
  attention forward + backward (measured); max / min over ranks. Target: zigzag ≤ 1.1 while
  contiguous is about 2N − 1.
* **Communication hidden under compute**: the time ranks spend blocked on ring transfers when
  each transfer is posted before the compute it should hide behind (``overlap=True``), against
  the same with every transfer waited for at once (``overlap=False``: all of it exposed).
  Hidden fraction = 1 − exposed(overlap) / exposed(serial).

Run: ``python -m benchmarks.context`` (``--smoke``: tiny sizes, one repeat).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import Tensor

from benchmarks.common import Row, best_of, parse_args, report
from llmlab.models import Llama, LlamaConfig
from llmlab.parallel.context import ContextLayout, ContextParallel, attention_work
from llmlab.parallel.launch import run_distributed
from llmlab.parallel.memory import saved_activation_bytes


def _llama(T: int) -> Llama:
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=256, block_size=T, n_layer=2, n_head=4, n_kv_head=2,
                             n_embd=64, intermediate_size=128))  # fmt: skip


def _batch(T: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (1, T + 1), generator=g)
    return ids[:, :-1], ids[:, 1:]


def _lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def saved_bytes_on_rank(rank: int, world: int, T: int) -> int:
    """Saved activation bytes of one training forward on this rank of a context group."""
    model, (ids, targets) = _llama(T), _batch(T)
    cp = ContextParallel()
    cp.apply(model)  # its pre-hook passes this rank's global positions
    return saved_activation_bytes(model, (cp.shard(ids), cp.shard(targets)), _lm_loss).total_bytes


def unsplit_saved_bytes(T: int) -> int:
    ids, targets = _batch(T)
    return saved_activation_bytes(_llama(T), (ids, targets), _lm_loss).total_bytes


def _qkv(T: int, heads: int, kv_heads: int, D: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(2)
    shapes = [(1, heads, T, D), (1, kv_heads, T, D), (1, kv_heads, T, D), (1, heads, T, D)]
    return [torch.randn(s, generator=g) for s in shapes]


def ring_cpu_seconds(rank: int, world: int, scheme: str, T: int, repeats: int) -> float:
    """This rank's thread CPU time for one causal ring attention forward + backward (best of)."""
    cp = ContextParallel(scheme=scheme)
    q, k, v, do = (cp.shard(t, dim=2) for t in _qkv(T, 4, 2, 64))
    q.requires_grad_()

    def step() -> None:
        cp.attention(q, k, v).backward(do)

    return best_of(step, repeats=repeats, warmup=1, clock=time.thread_time)


def exposed_comm_seconds(rank: int, world: int, T: int, repeats: int) -> dict[str, float]:
    """Seconds blocked on transfers per forward + backward, with and without overlap (best of)."""
    out = {}
    for overlap in (True, False):
        cp = ContextParallel(overlap=overlap)
        q, k, v, do = (cp.shard(t, dim=2) for t in _qkv(T, 4, 4, 64))
        q.requires_grad_()
        best_wait, best_total = float("inf"), float("inf")
        for i in range(repeats + 1):  # the first run warms up
            cp.transport.waited_seconds = 0.0
            start = time.perf_counter()
            cp.attention(q, k, v).backward(do)
            if i:
                best_total = min(best_total, time.perf_counter() - start)
                best_wait = min(best_wait, cp.transport.waited_seconds)
        key = "overlap" if overlap else "serial"
        out[f"{key}_wait"], out[f"{key}_total"] = best_wait, best_total
    return out


def measure_rank(rank: int, world: int, sizes: dict[str, int], repeats: int) -> dict:
    """Every measurement of one context degree, in one spawn (a spawn costs seconds)."""
    out = {
        "saved_bytes": saved_bytes_on_rank(rank, world, sizes["memory"]),
        "cpu_seconds": {
            scheme: ring_cpu_seconds(rank, world, scheme, sizes["work"], repeats)
            for scheme in ("zigzag", "contiguous")
        },
    }
    if world == 2:
        out["comm"] = exposed_comm_seconds(rank, world, sizes["comm"], repeats)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    args = parse_args(parser)  # --smoke: tiny sizes, one repeat, results to a scratch directory
    torch.set_num_threads(1)
    degrees = (2,) if args.smoke else (2, 4)
    repeats = 1 if args.smoke else 5
    sizes = {"memory": 64, "work": 64, "comm": 64}
    if not args.smoke:  # long enough that one rank's work is ~0.1-0.5 s of CPU
        sizes = {"memory": 2048, "work": 4096, "comm": 2048}
    rows: list[Row] = []

    whole = unsplit_saved_bytes(sizes["memory"])
    notes = [f"memory: Llama 2x64 (4 heads, 2 KV heads, vocab 256), loss included, "
             f"T={sizes['memory']}: unsplit {whole / 2**20:.2f} MiB saved"]  # fmt: skip
    results = {n: run_distributed(measure_rank, n, sizes, repeats) for n in degrees}
    for n, ranks in results.items():
        per_rank = max(r["saved_bytes"] for r in ranks)
        rows.append(Row(f"saved activations per rank, context={n}", per_rank / 2**20,
                        whole / n / 2**20, "unsplit / N", "MiB", higher_is_better=False,
                        target=1 / 1.15))  # fmt: skip
    for n, ranks in results.items():
        T = sizes["work"]
        pairs = {s: attention_work(ContextLayout(n, s), T) for s in ("zigzag", "contiguous")}
        timed = {s: [r["cpu_seconds"][s] for r in ranks] for s in pairs}
        for what, per_rank in (("pairs", pairs), ("CPU time", timed)):
            spread = {s: max(v) / min(v) for s, v in per_rank.items()}
            rows.append(Row(f"work max/min, zigzag vs 1.1 bound, context={n} ({what})",
                            spread["zigzag"], 1.1, "bound", "x", higher_is_better=False,
                            target=1.0))  # fmt: skip
            rows.append(Row(f"work max/min, zigzag vs contiguous, context={n} ({what})",
                            spread["zigzag"], spread["contiguous"], "contiguous", "x",
                            higher_is_better=False))  # fmt: skip
        notes.append(f"work context={n} (causal, T={T}, 4 heads, 2 KV heads, D=64): 2N-1 = "
                     f"{2 * n - 1}; CPU s per rank zigzag {[round(t, 3) for t in timed['zigzag']]}"
                     f", contiguous {[round(t, 3) for t in timed['contiguous']]}")  # fmt: skip

    comm = [r["comm"] for r in results[2]]
    worst = {key: max(rank[key] for rank in comm) for key in comm[0]}
    hidden = 1 - worst["overlap_wait"] / worst["serial_wait"]
    rows.append(Row("communication hidden under compute, context=2", hidden, 1.0, "all of it",
                    "fraction"))  # fmt: skip
    rows.append(Row("ring fwd+bwd time, overlapped vs serialised, context=2",
                    worst["overlap_total"], worst["serial_total"], "serialised", "s",
                    higher_is_better=False))  # fmt: skip
    notes.append(
        f"comm (causal zigzag, T={sizes['comm']}, 4 heads, D=64): blocked on transfers "
        f"{worst['overlap_wait']:.4f} s overlapped vs {worst['serial_wait']:.4f} s serialised "
        f"(slowest rank, best of {repeats}); CPU time is thread time (waits excluded), one "
        "thread per rank"
    )
    report("context", rows, notes="\n".join(notes))


if __name__ == "__main__":
    main()
