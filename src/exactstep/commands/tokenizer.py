"""``exactstep tokenizer train``: a byte-level BPE trained on a corpus' training split,
published at ``--out`` (H2)."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.data.bpe import train_bpe_tokenizer


def run(args: argparse.Namespace) -> int:
    record = train_bpe_tokenizer(args.source, args.vocab_size, Path(args.out),
                                 val_fraction=args.val_fraction, text_field=args.text_field)
    print(f"tokenizer {args.out}: byte-level BPE, {record['vocab_size']} tokens, trained on "
          f"{record['train_documents']} training documents of {record['source']} "
          f"(corpus {record['corpus_fingerprint'][:12]}); use it with --set "
          f"data.tokenizer=hf data.tokenizer_path={args.out}")
    return 0
