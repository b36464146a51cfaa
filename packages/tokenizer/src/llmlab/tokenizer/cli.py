"""``python -m llmlab.tokenizer train|encode|decode``.

train  --input FILES... --vocab-size N --model MODEL --out PATH [--format FORMAT]
       [--pattern gpt4] [--special-tokens ...] [--workers N]
       MODEL: bpe (byte-level), word_bpe (end-of-word), sentencepiece_bpe, wordpiece, unigram;
       FORMAT: llmlab, hf, and the model's own (bpe: tiktoken; word_bpe: vocab_merges, a
       folder; sentencepiece_bpe: sentencepiece, a .model)
encode --tokenizer PATH [--text TEXT | --input FILE] [--allow-special]   -> ids on stdout
decode --tokenizer PATH [--ids "1 2 3" | --input FILE]                   -> text on stdout
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmlab.tokenizer.formats import MODELS, SAVE_FORMATS, load


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m llmlab.tokenizer",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a tokenizer on text files")
    train.add_argument("--input", nargs="+", required=True, help="UTF-8 text files")
    train.add_argument("--vocab-size", type=int, required=True)
    train.add_argument("--model", choices=sorted(MODELS), default="bpe")
    train.add_argument("--out", required=True, help="output file")
    train.add_argument("--format", choices=SAVE_FORMATS, default="llmlab")
    train.add_argument("--pattern", default="gpt4", help="BPE: gpt2, gpt4, o200k or a regex")
    train.add_argument("--special-tokens", nargs="*", default=None)
    train.add_argument("--min-frequency", type=int, default=0)
    train.add_argument("--workers", type=int, default=1, help="processes counting words")

    encode = sub.add_parser("encode", help="print the ids of a text")
    encode.add_argument("--tokenizer", required=True)
    src = encode.add_mutually_exclusive_group(required=True)
    src.add_argument("--text")
    src.add_argument("--input", help="a UTF-8 file ('-' for stdin)")
    encode.add_argument("--allow-special", action="store_true", help="encode special tokens")
    encode.add_argument("--pattern", help="for .tiktoken files")

    decode = sub.add_parser("decode", help="print the text of ids")
    decode.add_argument("--tokenizer", required=True)
    src = decode.add_mutually_exclusive_group(required=True)
    src.add_argument("--ids", help='space-separated ids, e.g. "15 3 42"')
    src.add_argument("--input", help="a file of whitespace-separated ids ('-' for stdin)")
    decode.add_argument("--pattern", help="for .tiktoken files")
    return parser


def _read(path: str) -> str:
    return sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")


def _train(args: argparse.Namespace) -> None:
    for f in args.input:
        if not Path(f).is_file():
            raise SystemExit(f"error: --input file {f!r} does not exist")
    cls = MODELS[args.model]
    if args.format not in cls.save_formats:
        raise SystemExit(
            f"error: --format {args.format} is not available for {args.model}; valid: "
            f"{', '.join(cls.save_formats)}"
        )
    kwargs: dict = {}
    if args.special_tokens is not None:
        name = "control_tokens" if args.model == "sentencepiece_bpe" else "special_tokens"
        kwargs[name] = args.special_tokens
    if args.model != "unigram":
        kwargs.update(min_frequency=args.min_frequency, workers=args.workers)
    if args.model == "bpe":
        kwargs.update(pattern=args.pattern)
    start = time.perf_counter()
    tok = cls.train_from_files(args.input, args.vocab_size, **kwargs)
    path = tok.save(args.out, format=args.format)
    print(
        f"trained {args.model} with {tok.vocab_size} ids in {time.perf_counter() - start:.1f}s "
        f"-> {path}",
        file=sys.stderr,
    )


def _load(args: argparse.Namespace):
    options = {"pattern": args.pattern} if args.pattern else {}
    return load(args.tokenizer, **options)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "train":
            _train(args)
        elif args.command == "encode":
            tok = _load(args)
            text = args.text if args.text is not None else _read(args.input)
            ids = tok.encode(text, allowed_special="all" if args.allow_special else frozenset())
            print(" ".join(map(str, ids)))
        else:
            tok = _load(args)
            raw = args.ids if args.ids is not None else _read(args.input)
            try:
                ids = [int(x) for x in raw.split()]
            except ValueError as exc:
                raise SystemExit(f"error: ids must be integers: {exc}") from exc
            sys.stdout.write(tok.decode(ids))
            sys.stdout.write("\n")
    except ValueError as exc:  # bad settings or a damaged file: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0
