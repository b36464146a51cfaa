"""``python -m llmlab.parallel.checkpoint consolidate <dir> <out.pt>``: one file from many shards.

Runs on one process with no process group: it reads every rank's chunks through the checkpoint's
index and writes a plain ``state_dict`` (``torch.save``) that ``GPT.load_state_dict`` accepts.
"""

from __future__ import annotations

import argparse
import sys

from llmlab.parallel.checkpoint.files import metadata
from llmlab.parallel.checkpoint.layout_state import consolidate


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m llmlab.parallel.checkpoint")
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write one state_dict file from a sharded checkpoint")
    c.add_argument("checkpoint", help="the sharded checkpoint folder (holds .metadata)")
    c.add_argument("out", help="the .pt file to write")
    s = sub.add_parser("show", help="list the keys, global shapes and chunk counts")
    s.add_argument("checkpoint")
    args = parser.parse_args(argv)
    try:
        if args.command == "consolidate":
            state = consolidate(args.checkpoint, args.out)
            n = sum(t.numel() for k, t in state.items())
            print(f"wrote {args.out}: {len(state)} tensors, {n:,} elements")
        else:
            for key, meta in sorted(metadata(args.checkpoint).state_dict_metadata.items()):
                chunks = getattr(meta, "chunks", None)
                shape = tuple(meta.size) if hasattr(meta, "size") else "object"
                print(f"{key}  {shape}  {len(chunks) if chunks else ''}")
    except (FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
