"""``python -m llmlab.serving MODEL [--host 127.0.0.1] [--port 8000] [engine options]``.

MODEL is a training checkpoint, a sharded checkpoint folder or an HF-format folder (see
``llmlab.serving.loading``). ``--lora NAME=PATH`` (repeatable) serves a peft adapter folder
beside the base in the same batches; a request whose ``model`` is NAME decodes with it.
Every option is checked before the model is loaded, and the model and engine before the port
is opened; a bad value exits with status 2 and a message naming it.
``make serve CKPT=path ARGS="--port 8001"`` runs this.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from llmlab.serving.config import (
    ATTENTION_BACKENDS,
    KV_CACHE_DTYPES,
    SPECULATIVE_METHODS,
    EngineConfig,
)

log = logging.getLogger("llmlab.serving")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m llmlab.serving", description=__doc__.split("\n")[0])
    p.add_argument("model", help="training checkpoint file, sharded folder or HF-format folder")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", help="the name clients send (default: from MODEL)")
    p.add_argument("--tokenizer", help="a tokenizer file (llmlab JSON, HF tokenizer.json, ...)")
    p.add_argument("--chat-template", help="a Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--num-blocks", type=int, help="KV blocks in the pool")
    p.add_argument("--kv-cache-tokens", type=int, help="or: token slots in the pool")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-model-len", type=int, help="prompt + output limit (default: context)")
    p.add_argument("--no-prefix-caching", action="store_true")
    p.add_argument("--no-chunked-prefill", action="store_true")
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default="auto")
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default="auto",
        help="the KV pool's dtype (auto: the model's)",
    )
    p.add_argument(
        "--quantize",
        help="weights as bf16, int8, int4, int4:g64 or int4:g128 "
        "(llmlab.models.quantize; default: as loaded)",
    )
    p.add_argument(
        "--compile",
        action="store_true",
        help="decode steps through torch.compile (batch sizes 1-16; compiled on first use)",
    )
    p.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        help="speculative decoding: 'ngram' (prompt lookup) or 'draft' (needs --draft)",
    )
    p.add_argument("--draft", help="the draft model (checkpoint or HF folder): --speculative draft")
    p.add_argument(
        "--draft-quantize", help="the draft's weights: bf16, int8, int4, ... (as --quantize)"
    )
    p.add_argument("--num-speculative-tokens", type=int, default=4, help="drafts verified per step")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 * 2**20,
        help="larger request bodies get a 413 (default: 8 MiB)",
    )
    p.add_argument(
        "--lora",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="serve the peft adapter folder PATH as model NAME (repeatable)",
    )
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    args = p.parse_args(argv)
    if not 0 <= args.port <= 65535:
        p.error(f"--port {args.port} is not a TCP port (0..65535)")
    if args.max_body_bytes < 1:
        p.error(f"--max-body-bytes must be >= 1, got {args.max_body_bytes}")
    if args.threads is not None and args.threads < 1:
        p.error(f"--threads must be >= 1, got {args.threads}")
    if args.draft is not None:
        if args.speculative not in (None, "draft"):
            p.error(f"--draft with --speculative {args.speculative}: a draft model drafts")
        args.speculative = "draft"
    elif args.speculative == "draft":
        p.error("--speculative draft needs --draft MODEL (the model that proposes tokens)")
    if args.chat_template and not Path(args.chat_template).is_file():
        p.error(f"--chat-template {args.chat_template!r} is not a file")
    args.adapters = {}
    for spec in args.lora:
        name, _, path = spec.partition("=")
        if not name or not path:
            p.error(f"--lora {spec!r}: give NAME=PATH (a peft adapter folder)")
        if name in args.adapters or name == args.served_model_name:
            p.error(f"--lora {spec!r}: the name {name!r} is taken")
        if not Path(path).is_dir():
            p.error(f"--lora {spec!r}: {path!r} is not a folder")
        args.adapters[name] = path
    return args


def engine_config(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        enable_chunked_prefill=not args.no_chunked_prefill,
        attention_backend=args.attention_backend,
        quantize=args.quantize,
        kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile,
        speculative=args.speculative,
        num_speculative_tokens=args.num_speculative_tokens,
        draft_quantize=args.draft_quantize,
    )
    config.validate()
    return config


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        config = engine_config(args)
        import torch
        import uvicorn

        from llmlab.models.quantize import weight_bytes
        from llmlab.serving.chat_template import PLAIN_TEMPLATE, ChatTemplate
        from llmlab.serving.engine import LLMEngine
        from llmlab.serving.loading import load
        from llmlab.serving.server import ServerState, create_app

        if args.threads:
            torch.set_num_threads(args.threads)
        loaded = load(args.model, tokenizer=args.tokenizer)
        name = args.served_model_name or loaded.name
        if name in args.adapters:
            raise ValueError(f"--lora {name}=...: the name is the base model's")
        draft = load(args.draft, tokenizer=loaded.tokenizer).model if args.draft else None
        engine = LLMEngine(
            loaded.model, loaded.tokenizer, config, adapters=args.adapters, draft_model=draft
        )
        if args.chat_template:
            template, source = Path(args.chat_template).read_text(), args.chat_template
        elif loaded.chat_template:
            template, source = loaded.chat_template, "the tokenizer's"
        else:
            template, source = PLAIN_TEMPLATE, "plain 'role: content' lines (none shipped)"
        chat = ChatTemplate(template, **loaded.template_tokens)
    except (ValueError, TypeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    c = engine.config
    log.info(
        "model %r: %s, weights %.1f MiB (%s), context %d; KV pool %d blocks x %d tokens "
        "(%.1f MiB); chat template: %s",
        name,
        type(loaded.model).__name__,
        weight_bytes(loaded.model) / 2**20,
        c.quantize or "as loaded",
        c.max_model_len,
        c.num_blocks,
        c.block_size,
        engine.runner.pool.nbytes / 2**20,
        source,
    )
    for lora, path in args.adapters.items():
        log.info("LoRA adapter %r (rank %d) from %s", lora, engine.adapters.ranks[lora], path)
    if c.speculative == "ngram":
        log.info("speculative decoding: n-gram drafts, %d per step", c.num_speculative_tokens)
    elif c.speculative == "draft":
        log.info(
            "speculative decoding: %d drafts per step from %s (%s, weights %.1f MiB, its own KV "
            "pool %.1f MiB)",
            c.num_speculative_tokens,
            args.draft,
            c.draft_quantize or "as loaded",
            weight_bytes(draft) / 2**20,
            engine.speculator.draft.runner.pool.nbytes / 2**20,
        )
    state = ServerState(
        engine, name, chat, loaded.eos_token_ids, max_body_bytes=args.max_body_bytes
    )
    uvicorn.run(create_app(state), host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
