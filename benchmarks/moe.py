"""The MoE block, forward + backward: llmlab's grouped path against transformers' own block on
the same weights, with ``experts_implementation="eager"`` (its per-expert loop) and with its
default (``"grouped_mm"``), and against llmlab's per-expert loop (the reference).

Two shapes, scaled from real models so a CPU step takes well under a second:

* Mixtral-shaped: 8 experts, top-2, expert width 3.5 x the residual (Mixtral's 14336 / 4096),
  HF ``MixtralSparseMoeBlock``; 1 x 512 tokens (~128 assignments per expert) and 4 x 512
  (~512 per expert: the matmuls' share grows with the tokens, so the ratios shrink);
* Qwen3-MoE-shaped: 64 experts, top-8, narrow experts (Qwen3-30B-A3B's 768 / 2048),
  HF ``Qwen3MoeSparseMoeBlock``, 2 x 512 tokens (~128 assignments per expert).

Each HF block is the MoE layer of a one-layer ``*ForCausalLM`` built from a config, so its
experts implementation is whatever transformers picks by default (checked to be
``"grouped_mm"``) or ``"eager"`` when asked. Random router and expert weights (the router's
spread makes every expert take at least 64 of the assignments: checked) are copied into
llmlab's ``MoE`` (``gate_up_proj`` split into ``gate_proj`` / ``up_proj``). Before timing, every
side's output, input gradient and weight gradients are checked against HF eager's.

One step: the block's forward on (B, T, C) fp32 inputs, ``(y * g).sum().backward()``, the
gradients cleared. Best process CPU time of interleaved rounds (one step of each side per round,
each warmed up once), one thread (shared CPUs: OpenMP threads would spin waiting for each
other, and under load torch's two-thread accumulating ``index_put`` / ``index_add`` cost 10-100x
their one-thread time). Tokens/s = tokens per step / seconds. On CPU ``grouped_mm`` runs at the
per-expert loop's matmul speed, so what separates the sides is dispatch: sorting, gathering,
weighting and combining, and how each gradient gets back to its rows (HF eager: a full-size
weight gradient per expert slice; autograd's ``x[idx]``: an accumulating scatter).

GPU rows (``moe_gpu.json``): the same cases in bf16 on CUDA, wall time after a synchronize;
skipped with the reason where no CUDA device is present.

All-to-all bytes (``moe_ep.json``, untimed): the Mixtral-shaped layer split over 2 gloo ranks
(expert parallelism, 512 tokens each), one forward and backward; the bytes each rank counted
(``comm/ep_bytes``) against the formula of ``llmlab.parallel.expert`` from the routing it did
(``2·(S + R)·C·b`` + the counts), and against what a perfectly balanced router would move.

``python -m benchmarks.moe`` (``--smoke``: a tiny case, one round).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass
from typing import Any

import torch

from benchmarks.common import Row, fair, parse_args, report, untimed
from benchmarks.serving import interleaved_best
from llmlab.models.moe import MoE, MoEConfig
from llmlab.models.ops import get_ops


@dataclass(frozen=True)
class Case:
    name: str
    family: str  # "mixtral" or "qwen3_moe"
    dim: int
    intermediate: int
    experts: int
    top_k: int
    batch: int
    seq: int

    @property
    def tokens(self) -> int:
        return self.batch * self.seq


CASES = (
    Case("Mixtral-shaped C=512 E=8x1792 k=2 1x512", "mixtral", 512, 1792, 8, 2, 1, 512),
    Case("Mixtral-shaped C=512 E=8x1792 k=2 4x512", "mixtral", 512, 1792, 8, 2, 4, 512),
    Case("Qwen3-MoE-shaped C=512 E=64x192 k=8 2x512", "qwen3_moe", 512, 192, 64, 8, 2, 512),
)
SMOKE = (Case("smoke C=32 E=4x48 k=2", "mixtral", 32, 48, 4, 2, 2, 64),)
MIN_TOKENS_PER_EXPERT = 64  # the condition on the timed cases


def hf_block(case: Case, implementation: str | None) -> torch.nn.Module:
    """The MoE block of a one-layer HF model; ``implementation=None``: transformers' default."""
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    common: dict[str, Any] = dict(vocab_size=64, hidden_size=case.dim, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  num_experts_per_tok=case.top_k)  # fmt: skip
    if implementation is not None:
        common["experts_implementation"] = implementation
    if case.family == "mixtral":
        config = MixtralConfig(intermediate_size=case.intermediate,
                               num_local_experts=case.experts, **common)  # fmt: skip
        model = MixtralForCausalLM(config)
    else:
        config = Qwen3MoeConfig(moe_intermediate_size=case.intermediate, intermediate_size=64,
                                num_experts=case.experts, norm_topk_prob=True, head_dim=32,
                                **common)  # fmt: skip
        model = Qwen3MoeForCausalLM(config)
    chosen = model.config._experts_implementation
    if chosen != (implementation or "grouped_mm"):
        raise RuntimeError(f"{case.family}: transformers chose experts_implementation={chosen!r}")
    return model.model.layers[0].mlp


def build(case: Case, device: str, dtype: torch.dtype) -> dict[str, torch.nn.Module]:
    """HF eager, HF default (grouped_mm), llmlab grouped and loop, all on the same weights."""
    eager, grouped = hf_block(case, "eager"), hf_block(case, None)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in eager.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    grouped.load_state_dict(eager.state_dict())
    config = MoEConfig(dim=case.dim, num_experts=case.experts, top_k=case.top_k,
                       intermediate_size=case.intermediate)  # fmt: skip
    # llmlab's block as a CPU user runs it: the "cpu" op table (fused SwiGLU, llmlab.kernels);
    # the same block on PyTorch's ops ("torch", the models' default) is timed beside it
    ours = MoE(config, get_ops("cpu" if device == "cpu" else "torch"))
    I = case.intermediate
    with torch.no_grad():
        ours.router.weight.copy_(eager.gate.weight)
        ours.experts.gate_proj.copy_(eager.experts.gate_up_proj[:, :I])
        ours.experts.up_proj.copy_(eager.experts.gate_up_proj[:, I:])
        ours.experts.down_proj.copy_(eager.experts.down_proj)
    loop = MoE(MoEConfig(**{**config.__dict__, "implementation": "loop"}))
    loop.load_state_dict(ours.state_dict())
    blocks = {"llmlab": ours, "hf_eager": eager, "hf_grouped": grouped, "llmlab_loop": loop}
    if device == "cpu":  # ours on PyTorch's ops: what kernels="cpu" adds
        blocks["llmlab_torch_ops"] = MoE(config)
        blocks["llmlab_torch_ops"].load_state_dict(ours.state_dict())
    return {name: m.to(device=device, dtype=dtype) for name, m in blocks.items()}


def _grads(name: str, m: torch.nn.Module, I: int) -> dict[str, torch.Tensor]:
    """Weight gradients under HF's names (llmlab's gate/up stacked back into gate_up_proj)."""
    if name.startswith("llmlab"):
        e = m.experts
        return {"gate.weight": m.router.weight.grad,
                "experts.gate_up_proj": torch.cat([e.gate_proj.grad, e.up_proj.grad], dim=1),
                "experts.down_proj": e.down_proj.grad}  # fmt: skip
    return {n: p.grad for n, p in m.named_parameters()}


def check_agreement(case: Case, blocks: dict, x: torch.Tensor, g: torch.Tensor) -> int:
    """Every side's output, input gradient and weight gradients against HF eager's; returns
    the fewest assignments any expert takes."""

    def same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        if x.dtype == torch.float32:
            # fp32 sums in another order: their error scales with the largest term (the router's
            # gradient sums thousands of tokens' terms, entries up to ~80 here: 3e-5 seen on
            # AMD EPYC, where an entry near 0 fails a purely elementwise 1e-5)
            atol = 1e-5 * max(1.0, float(b.abs().max()))
            torch.testing.assert_close(a, b, atol=atol, rtol=1e-4, msg=f"{case.name}: {what}")
            return
        # bf16: sums in another order differ elementwise by its ~3 digits; compare as a whole
        err = float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))
        if err > 2e-2:
            raise AssertionError(f"{case.name}: {what}: relative error {err:.3g} > 2e-2")

    results = {}
    for name, m in blocks.items():
        xx = x.clone().requires_grad_()
        y = m(xx)
        (y * g).sum().backward()
        results[name] = (y.detach(), xx.grad, _grads(name, m, case.intermediate))
        m.zero_grad(set_to_none=True)
    y0, gx0, gw0 = results["hf_eager"]
    for name, (y, gx, gw) in results.items():
        same(y, y0, f"{name} output")
        same(gx, gx0, f"{name} input gradient")
        for n, t in gw0.items():
            same(gw[n], t, f"{name} grad {n}")
    return int(blocks["llmlab"].stats.tokens_per_expert.min())


def step_fn(m: torch.nn.Module, x: torch.Tensor, g: torch.Tensor, sync: Any = None) -> Any:
    def step() -> None:
        xx = x.clone().requires_grad_()
        (m(xx) * g).sum().backward()
        m.zero_grad(set_to_none=True)
        if sync is not None:
            sync()

    return step


def measure(case: Case, repeats: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    """Rows for one case: llmlab grouped vs HF eager (target 1.5), vs HF grouped_mm (1.0), vs
    llmlab's loop (no target)."""
    torch.manual_seed(0)
    blocks = build(case, device, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(case.batch, case.seq, case.dim, generator=gen).to(device, dtype)
    g = torch.randn(x.shape, generator=gen).to(device, dtype)
    min_load = check_agreement(case, blocks, x, g)
    if min_load < MIN_TOKENS_PER_EXPERT and case not in SMOKE:
        raise RuntimeError(f"{case.name}: an expert took only {min_load} assignments")
    if device == "cuda":
        sync, clock, warmup = torch.cuda.synchronize, time.perf_counter, 3
    else:
        sync, clock, warmup = None, time.process_time, 1
    steps = {name: step_fn(m, x, g, sync) for name, m in blocks.items()}
    for step in steps.values():
        for _ in range(warmup):
            step()
    if device == "cuda":
        best = dict.fromkeys(steps, float("inf"))
        for _ in range(repeats):
            for name, step in steps.items():
                start = clock()
                step()
                best[name] = min(best[name], clock() - start)
    else:
        best = interleaved_best(steps, repeats)
    rate = {name: case.tokens / t for name, t in best.items()}
    tag = "" if device == "cpu" else f" [{device} {str(dtype).removeprefix('torch.')}]"
    hf = {"mixtral": "HF MixtralSparseMoeBlock", "qwen3_moe": "HF Qwen3MoeSparseMoeBlock"}[
        case.family
    ]
    extra = {"tokens": case.tokens, "min assignments per expert": min_load,
             "seconds": {k: round(v, 5) for k, v in best.items()}}  # fmt: skip

    def row(other: str, label: str, short: str, target: float | None,
            ours: str = "llmlab") -> Row:  # fmt: skip
        kernels = "torch" if ours == "llmlab_torch_ops" or device != "cpu" else "cpu"
        timing = fair(False, repeats, warmup, (f"llmlab MoE grouped, kernels={kernels}", label))
        return Row(f"{case.name}{tag} kernels={kernels} vs {short}", rate[ours], rate[other],
                   label, "tokens/s fwd+bwd", target=target, extra={**timing, **extra})  # fmt: skip

    rows = [
        row("hf_eager", f"{hf} eager", "HF eager", 1.5),
        row("hf_grouped", f"{hf} grouped_mm (default)", "HF grouped_mm", 1.0),
        row("llmlab_loop", "llmlab MoE loop", "llmlab loop", None),
    ]
    if "llmlab_torch_ops" in rate:  # the default op table: what the fused SwiGLU adds
        rows += [
            row("hf_eager", f"{hf} eager", "HF eager", None, "llmlab_torch_ops"),
            row("hf_grouped", f"{hf} grouped_mm (default)", "HF grouped_mm", None,
                "llmlab_torch_ops"),
        ]  # fmt: skip
    return rows


def _ep_bytes(rank: int, world: int, case: Case) -> dict[str, int]:
    """One rank of the expert-parallel layer: the bytes it counted and the formula's."""
    import torch.distributed as dist

    from llmlab.parallel.expert import ExpertParallel

    torch.manual_seed(0)  # the same layer on every rank; each keeps its experts
    layer = MoE(MoEConfig(dim=case.dim, num_experts=case.experts, top_k=case.top_k,
                          intermediate_size=case.intermediate))  # fmt: skip
    ep = ExpertParallel(dist.group.WORLD, world, rank)
    ep.apply(layer)
    gen = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(case.tokens, case.dim, generator=gen).requires_grad_()
    layer(x).sum().backward()
    counts = [torch.empty(case.experts, dtype=torch.long) for _ in range(world)]
    dist.all_gather(counts, layer.stats.tokens_per_expert)
    per = case.experts // world
    mine = slice(rank * per, (rank + 1) * per)
    sent = int(counts[rank].sum() - counts[rank][mine].sum())  # S: rows to other ranks
    received = sum(int(c[mine].sum()) for r, c in enumerate(counts) if r != rank)  # R
    row = case.dim * x.element_size()
    count_bytes = 8 * case.experts * (world - 1) // world
    return {
        "counted": ep.stats.take(),
        "formula": 2 * (sent + received) * row + count_bytes,
        "balanced": 2 * 2 * case.tokens * case.top_k * (world - 1) // world * row + count_bytes,
    }


def ep_rows(case: Case, world: int = 2) -> list[Row]:
    """``comm/ep_bytes`` of rank 0 against the formula (must be equal: raises otherwise) and
    against a balanced router's bytes."""
    from llmlab.parallel.launch import run_distributed

    results = run_distributed(_ep_bytes, world, case, timeout=600)
    bad = [r for r in results if r["counted"] != r["formula"]]
    if bad:
        raise RuntimeError(f"comm/ep_bytes differs from its formula: {bad}")
    r = results[0]
    name = f"moe all-to-all: {case.name} over expert={world}, rank 0"
    timing = untimed(("llmlab ExpertParallel (gloo)", "the formula"))
    return [
        Row(
            f"{name}: bytes counted vs the formula",
            r["counted"],
            r["formula"],
            "2(S+R)Cb + counts, from its routing",
            "bytes",
            extra=timing,
        ),
        Row(
            f"{name}: bytes vs a balanced router's",
            r["counted"],
            r["balanced"],
            "balanced: 2·2·k·N·(ep-1)/ep·C·b + counts",
            "bytes",
            higher_is_better=False,
            extra=untimed(("llmlab ExpertParallel (gloo)", "a balanced router")),
        ),
    ]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argparse.ArgumentParser(description=__doc__.splitlines()[0]), argv)
    cases, repeats = (SMOKE, 1) if args.smoke else (CASES, 9)
    torch.set_num_threads(1)  # shared CPUs (module docstring)
    rows = [r for case in cases for r in measure(case, repeats)]
    notes = (
        f"fp32 CPU, 1 thread, best process CPU time of {repeats} interleaved rounds of forward + "
        "backward; outputs and every gradient checked against HF eager's first (rtol 1e-4, "
        "atol 1e-5 × the largest entry). "
        "HF blocks: the MoE layer of a one-layer *ForCausalLM, default experts implementation "
        "(grouped_mm) or experts_implementation='eager'. On CPU grouped_mm runs at the loop's "
        "matmul speed: the difference is dispatch (sorting, gathering, combining and their "
        "backward)."
    )
    report("moe", rows, notes=notes)
    ep_case = cases[0]
    report("moe_ep", ep_rows(ep_case), notes=(
        "Untimed. Rank 0 of 2 gloo ranks, each holding half the experts and routing "
        f"{ep_case.tokens} tokens of its own (random router and inputs): payload bytes of one "
        "forward and backward (dispatch, combine, their gradients, the counts). Every rank's "
        "count equals the formula (checked). Against a balanced router a ratio above 1 means this "
        "rank moved fewer rows than an even split would (its tokens' experts were local more "
        "often), below 1 more."
    ))  # fmt: skip
    if not torch.cuda.is_available():
        report("moe_gpu", [], skipped="no CUDA device on this machine (GPU rows run when one is)")
        return
    device = torch.cuda.get_device_name()
    gpu_rows = [r for case in cases for r in measure(case, repeats, "cuda", torch.bfloat16)]
    report("moe_gpu", gpu_rows, notes=f"{device}, bf16, best wall time of {repeats} rounds "
                                      "after 3 warm-up steps, synchronized")  # fmt: skip


if __name__ == "__main__":
    main()
