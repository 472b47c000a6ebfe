"""``exactstep distill``: a teacher's answers to the student's prompts, written as
prepared training data that names its teacher (R10); the student's data, tokenizer and
chat settings come from --config/--set."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.artifacts.distill import distill
from exactstep.config import load_config
from exactstep.generation.config import GenerationConfig


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    policy = GenerationConfig(temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, max_new_tokens=args.max_new_tokens, samples=1)
    meta = distill(cfg, Path(args.teacher), Path(args.out), policy=policy,
                   from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint
                   else None, workers=args.workers, progress=not args.no_progress)
    train = meta["splits"]["train"]
    print(f"distilled {args.out}: {train['documents']} training conversations answered by "
          f"{meta['teacher']['kind']} {args.teacher}, validation gold; fingerprint "
          f"{meta['fingerprint'][:12]}; train with --set data.source={args.out}")
    return 0
