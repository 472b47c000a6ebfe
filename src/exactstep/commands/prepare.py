"""``exactstep prepare``: tokenize a source once into memory-mapped shards; the run's
tokenizer settings come from --config/--set (P1)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.artifacts.prepare import prepare
from exactstep.config import load_config


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    meta = prepare(cfg, args.source, Path(args.out), workers=args.workers,
                   shard_tokens=args.shard_tokens, block_documents=args.block_documents,
                   progress=not args.no_progress)
    counts = ", ".join(f"{split} {info['documents']} documents / {info['tokens']} tokens in "
                       f"{len(info['shards'])} shards" for split, info in meta["splits"].items())
    print(f"prepared {args.out}: {counts}; {meta['dtype']}; fingerprint "
          f"{meta['fingerprint'][:12]}; train with --set data.source={args.out}")
    return 0
