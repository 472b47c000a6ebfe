"""``exactstep prepare`` throughput against the tokenizer's own batch encoder (P1).

``prepare`` with 1 and 2 workers, end to end, against ``Tokenizer.encode_batch`` on
the same texts in memory, alternating; ``exactstep bench prepare`` reports tokens per
second of each and the ratios.
Design and derivations: docs/design/bench.md#benchpreparepy (P1).
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
import time
from pathlib import Path

from exactstep.bench.common import median

VOCAB = 2048
DOC_BYTES = 4096


def write_texts(path: Path, documents: int) -> list[str]:
    from exactstep.data.config import DataConfig
    from exactstep.data.corpus import load_corpus

    corpus = load_corpus(DataConfig(source="stdlib"))
    pieces = (doc.text[i:i + DOC_BYTES] for doc in corpus.train + corpus.val
              for i in range(0, len(doc.text), DOC_BYTES))
    texts = list(itertools.islice(pieces, documents))
    with path.open("w", encoding="utf-8") as fh:
        for text in texts:
            fh.write(json.dumps({"text": text}) + "\n")
    return texts


def run(quick: bool) -> dict:
    from exactstep.artifacts.prepare import prepare
    from exactstep.config import load_config
    from exactstep.data.bpe import train_bpe_tokenizer
    from exactstep.data.hf_tokenizer import load_hf_tokenizer

    documents = 300 if quick else 12000
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="exactstep-bench-prepare-") as tmp:
        root = Path(tmp)
        texts = write_texts(root / "texts.jsonl", documents)
        train_bpe_tokenizer("stdlib", VOCAB, root / "bpe")
        cfg = load_config(None, ["data.tokenizer=hf", f"data.tokenizer_path={root / 'bpe'}",
                                 "data.val_fraction=0.05"])
        hf = load_hf_tokenizer(root / "bpe", path_key="data.tokenizer_path").hf.backend_tokenizer
        seconds: dict[str, list[float]] = {"prepare_1": [], "prepare_2": [], "encode_batch": []}
        tokens: dict[str, int] = {}
        for repeat in range(repeats + 1):  # repeat 0 warms up (page cache, imports)
            for name in (list(seconds) if repeat % 2 == 0 else list(seconds)[::-1]):
                out = root / f"out-{name}"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.perf_counter()
                if name == "encode_batch":
                    count = sum(len(e.ids) for e in hf.encode_batch(texts,
                                                                      add_special_tokens=False))
                else:
                    meta = prepare(cfg, str(root / "texts.jsonl"), out,
                                   workers=int(name[-1]), progress=False)
                    count = sum(s["tokens"] for s in meta["splits"].values())
                dt = time.perf_counter() - t0
                if repeat:
                    seconds[name].append(dt)
                    tokens[name] = count
    rates = {name: tokens[name] / median(seconds[name]) for name in seconds}
    return {
        "documents": documents, "vocab_size": VOCAB,
        "tokens": tokens["encode_batch"],
        "prepare_1_tokens_per_s": rates["prepare_1"],
        "prepare_2_tokens_per_s": rates["prepare_2"],
        "encode_batch_tokens_per_s": rates["encode_batch"],
        "prepare_1_ratio": rates["prepare_1"] / rates["encode_batch"],
        "prepare_2_ratio": rates["prepare_2"] / rates["encode_batch"],
    }


if __name__ == "__main__":
    from exactstep.bench.common import format_figures

    print(format_figures("prepare", run(quick=True)))
