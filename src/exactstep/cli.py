"""The ``exactstep`` command (X2). Thin: parse, dispatch; errors become one line (X4).

``exactstep NAME`` runs ``exactstep.commands.NAME``, imported (torch with it) only in
``dispatch``, so a usage error, ``--help`` and ``bench list`` answer at once; every
user error ends in one ``error: ...`` line and a non-zero exit, and anything else
keeps its traceback.
Design and derivations: docs/design/run.md#clipy (X2, X4).
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from typing import NoReturn

from exactstep.commands import launch
from exactstep.errors import ConfigError, ExactstepError

SMOKE_TESTS = ("gpu",)  # the modules of exactstep.smoke


class Parser(argparse.ArgumentParser):
    """argparse, but a bad argument is a ``ConfigError`` (one line, exit 2) instead of
    a usage block and ``SystemExit``; sub-command parsers inherit this class."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{self.prog}: {message}; see '{self.prog} --help'")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="exactstep",
        description="Train language models so every update is exactly the declared objective.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model from a configuration")
    add_config_args(train)
    train.add_argument("--out", default="runs/default", help="run directory (default runs/default)")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.add_argument("--nproc", type=int, metavar="R",
                       help="run R local processes under torchrun (DDP over gloo/nccl)")
    add_node_args(train)
    train.add_argument("--resume", choices=("auto",),
                       help="auto: when --out already holds this same run (a restart or "
                            "requeue of this command), continue it exactly from its newest "
                            "verifying checkpoint; a different run there is refused (S10)")

    resume = sub.add_parser("resume", help="continue a run exactly from its last checkpoint")
    resume.add_argument("run_dir", help="the run directory to continue")
    resume.add_argument("--from", dest="from_checkpoint", help="a specific committed checkpoint")
    add_set_arg(resume)
    resume.add_argument("--warm-start", metavar="NEW_DIR",
                        help="start a new run in NEW_DIR from the weights only (config may differ)")
    resume.add_argument("--no-progress", action="store_true")
    resume.add_argument("--reshard", action="store_true",
                        help="allow a different world size: re-partition the data cursor (S7)")
    resume.add_argument("--nproc", type=int, metavar="R", help="run R local processes")
    add_node_args(resume)

    prepare = sub.add_parser("prepare", help="tokenize a source once into memory-mapped shards")
    prepare.add_argument("source", help="'stdlib', a JSONL file, Parquet/Arrow files or a "
                         "directory of them (chat JSONL with --set data.kind=chat)")
    prepare.add_argument("--out", required=True, help="the new prepared directory")
    prepare.add_argument("--workers", type=int, default=1, metavar="N",
                         help="tokenizer processes (the shards are identical for any N)")
    prepare.add_argument("--shard-tokens", type=int, default=1 << 27, metavar="T",
                         help="close a shard at the first document boundary past T tokens")
    prepare.add_argument("--block-documents", type=int, default=4096, metavar="B",
                         help="documents per block of the declared epoch order")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(prepare)

    distill = sub.add_parser("distill", help="a teacher's answers as prepared training data "
                                             "(sequence-level distillation, R10)")
    distill.add_argument("teacher", help="an exactstep run, an export or a Hugging Face model "
                                         "directory")
    distill.add_argument("--out", required=True, help="the new prepared directory")
    distill.add_argument("--from", dest="from_checkpoint",
                         help="the teacher run's checkpoint (default: its latest)")
    distill.add_argument("--temperature", type=float, default=0.0,
                         help="0 (default): greedy; else sampled from the addressed stream")
    distill.add_argument("--top-k", type=int, default=0)
    distill.add_argument("--top-p", type=float, default=1.0)
    distill.add_argument("--max-new-tokens", type=int, default=64,
                         help="the longest answer the teacher writes (default 64)")
    distill.add_argument("--workers", type=int, default=1, metavar="N",
                         help="tokenizer processes (the shards are identical for any N)")
    distill.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_config_args(distill)

    evaluate = sub.add_parser("eval", help="held-out loss, perplexity and bits per byte")
    evaluate.add_argument("run_dir", help="a run directory (uses its LATEST checkpoint)")
    evaluate.add_argument("--from", dest="from_checkpoint", help="a specific committed checkpoint")

    export = sub.add_parser(
        "export", help="write a Hugging Face model directory, checked (H3); "
                       "'export verify DIR' checks one against its passport",
        usage="exactstep export RUN_DIR [--from CHECKPOINT] --out DIR [--adapter]\n"
              "       exactstep export verify DIR")
    export.add_argument("run_dir", metavar="RUN_DIR",
                        help="a run directory (uses the checkpoint a resume would), or "
                             "'verify' followed by an export directory")
    export.add_argument("export_dir", nargs="?", metavar="DIR",
                        help="with 'verify': the export directory whose passport digests "
                             "are recomputed")
    export.add_argument("--from", dest="from_checkpoint", help="a specific committed checkpoint")
    export.add_argument("--out", help="the new export directory (required to export)")
    export.add_argument("--adapter", action="store_true",
                        help="a LoRA run: write the PEFT adapter directory, not the merged model")

    generate = sub.add_parser(
        "generate", help="sample continuations from a run or an export (streaming)",
        usage="exactstep generate RUN_OR_EXPORT --prompt TEXT [--prompt TEXT ...] "
              "[--samples K] [--max-new-tokens N] [--temperature T] [--top-k K] [--top-p P] "
              "[--seed S] [--chat | --text] [--from CHECKPOINT]")
    generate.add_argument("source", metavar="RUN_OR_EXPORT",
                          help="a run directory (its LATEST checkpoint) or an export directory")
    generate.add_argument("--prompt", action="append", required=True, metavar="TEXT",
                          help="a prompt (repeat for several)")
    generate.add_argument("--samples", type=int, metavar="K",
                          help="continuations per prompt (default: the run's generation.samples "
                               "for a run, 1 for an export)")
    generate.add_argument("--max-new-tokens", type=int, metavar="N")
    generate.add_argument("--temperature", type=float, metavar="T", help="0: greedy")
    generate.add_argument("--top-k", type=int, metavar="K", help="0: all tokens")
    generate.add_argument("--top-p", type=float, metavar="P", help="1: all tokens")
    generate.add_argument("--seed", type=int, default=0,
                          help="the draws' seed: continuation k of prompt i uses the stream "
                               "(seed, 0, i, k) (default 0)")
    form = generate.add_mutually_exclusive_group()
    form.add_argument("--chat", action="store_true",
                      help="render each prompt as a user turn and the assistant's header "
                           "(default for a chat run)")
    form.add_argument("--text", action="store_true",
                      help="continue each prompt as plain text (default for a text run)")
    generate.add_argument("--from", dest="from_checkpoint", help="a specific committed checkpoint")

    inspect = sub.add_parser("inspect", help="print rows: input -> target, segment, position, masks")
    add_config_args(inspect)
    inspect.add_argument("--rows", default="0:1", help="row range A:B of the first microbatch")
    inspect.add_argument("--split", choices=("train", "val"), default="train")
    inspect.add_argument("--world", type=int, default=1, metavar="W",
                         help="show the parallel layout of a run of W processes, all nodes "
                              "together (nothing is launched; default 1)")

    checkpoint = sub.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_sub = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    verify = checkpoint_sub.add_parser("verify", help="recompute digests of a checkpoint")
    verify.add_argument("path", help="a checkpoint directory, or a run directory (uses LATEST)")

    audit = sub.add_parser("audit", help="conformance probes against a training step (A1)")
    audit.add_argument("--target", required=True, metavar="T",
                       help="exactstep (this engine), python:MODULE:FUNCTION (FUNCTION() "
                            "returns an exactstep.audit.TrainingStep, or a PolicyStep "
                            "for a policy loop), hf-trainer"
                            "[:padding|flattening|lora] (Hugging Face Trainer and its "
                            "collator; lora: Trainer + peft), "
                            "trl-sft[:completion_only_loss|assistant_only_loss|"
                            "padding_free|packing] (trl's SFTTrainer), or "
                            "trl-grpo[:dapo|bnpo|grpo|dr_grpo[:group|batch|none]] "
                            "(trl's GRPOTrainer: loss_type, scale_rewards)")
    audit.add_argument("--json", action="store_true", help="print one JSON object")
    audit.add_argument("--report", metavar="FILE.html",
                       help="also write a self-contained HTML report")
    audit.add_argument("--probe", dest="probes", action="append", metavar="NAME",
                       help="run only this probe (repeatable)")
    audit.add_argument("--probe-timeout", type=float, default=None, metavar="S",
                       help="a probe running longer than S seconds is that probe's ERROR "
                            "(default 300; 0: no limit)")

    bench = sub.add_parser("bench", help="benchmarks measured side by side against a baseline")
    bench.add_argument("name",
                       help="benchmark name (a module of exactstep.bench); 'list' lists them")
    bench.add_argument("--quick", action="store_true", help="a smaller, faster measurement")
    bench.add_argument("--json", action="store_true", help="print one JSON object")
    bench.add_argument("--dry-run", action="store_true",
                       help="benchmarks that need a GPU: the same checks, tiny, on the CPU")

    smoke = sub.add_parser("smoke", help="smoke tests: every path of a device run once")
    smoke.add_argument("name", choices=SMOKE_TESTS, help="which smoke test")
    smoke.add_argument("--json", action="store_true", help="print one JSON object")
    smoke.add_argument("--dry-run", action="store_true",
                       help="the same checks, tiny, on the CPU")

    tokenizer = sub.add_parser("tokenizer", help="tokenizer tools")
    tokenizer_sub = tokenizer.add_subparsers(dest="tokenizer_command", required=True)
    bpe = tokenizer_sub.add_parser(
        "train", help="train a byte-level BPE on a corpus' training split (H2)")
    bpe.add_argument("--source", default="stdlib",
                     help="stdlib (default) or a text data file (.jsonl, .parquet, .arrow, "
                          "or a directory of shards), read as data.source is")
    bpe.add_argument("--vocab-size", type=int, required=True, metavar="N",
                     help="vocabulary size, the 3 special tokens and 256 bytes included")
    bpe.add_argument("--out", required=True, help="the new tokenizer directory")
    bpe.add_argument("--val-fraction", type=float, default=0.05, metavar="F",
                     help="the data.val_fraction of the runs that will use it (default 0.05): "
                          "its validation documents are never seen")
    bpe.add_argument("--text-field", default="text", help="the field holding the text")

    sub.add_parser("config", help="print every configuration key with its default")
    return parser


def add_node_args(p: argparse.ArgumentParser) -> None:
    """torchrun's multi-node flags, named as torchrun names them (D1): one launcher per
    node, each with ``--nproc R`` processes (default 1), meeting at HOST:PORT."""
    p.add_argument("--nnodes", type=int, default=1, metavar="N",
                   help="the job spans N nodes; run the same command on each")
    p.add_argument("--node-rank", type=int, default=0, metavar="K",
                   help="this node's rank, 0..N-1 (node 0 hosts the rendezvous)")
    p.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                   help="where the nodes meet: node 0's address and a free port")
    p.add_argument("--rdzv-id", default="exactstep", metavar="ID",
                   help="the job's rendezvous id, the same on every node")
    p.add_argument("--rdzv-backend", choices=("c10d", "static"), default="c10d",
                   help="torchrun's rendezvous backend (default c10d)")


def add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="a TOML configuration file")
    add_set_arg(p)


def add_set_arg(p: argparse.ArgumentParser) -> None:
    """``--set K=V [K=V ...]``, repeatable; ``args.overrides`` is every pair in order (X2).

    Later pairs win over earlier ones (the config applies them in order). A value without
    ``=`` is a usage error naming it, before anything is built.
    """
    p.add_argument("--set", dest="overrides", action="extend", nargs="+", default=[],
                   type=key_value, metavar="KEY=VALUE",
                   help="override keys, e.g. --set update.lr=1e-3 train.steps=100 (repeatable)")


def key_value(text: str) -> str:
    """``text`` unchanged when it reads ``key=value`` with a non-empty key (argparse type)."""
    key, sep, _ = text.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(
            f"expected KEY=VALUE (e.g. update.lr=3e-4), got {text!r}; "
            "a positional argument such as RUN_DIR goes before --set"
        )
    return text


def main(argv: list[str] | None = None) -> int:
    """Run ``exactstep argv``; returns the exit code (X4).

    0 on success. A bad argument, any ``ExactstepError`` and a setting too large for
    this machine's memory print one ``error: ...`` line and return the error's code
    (2 for a user error); an interrupt returns 130. Anything else is a bug and raises.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        nproc = launch.processes(args)  # --nproc/--nnodes checked; None: run it here
    except ExactstepError as exc:  # a usage error: nothing ran, nothing heavy is loaded
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    try:
        if nproc is not None and "WORLD_SIZE" not in os.environ:
            return launch.run_as_job(args, argv, nproc)
        return dispatch(args)
    except ExactstepError as exc:
        from exactstep.parallel.launch import report_failure

        report_failure(exc, None)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (MemoryError, RuntimeError) as exc:
        message = out_of_memory(exc)
        if message is None:
            raise
        from exactstep.parallel.launch import report_failure

        # reported like any user error: rank 0 prints, every rank records it (D1)
        report_failure(ConfigError(message), None)
        return ConfigError.exit_code


# What PyTorch's CPU allocator says when a request cannot be met (it raises RuntimeError).
CPU_ALLOCATOR_FAILURE = "can't allocate memory"


def out_of_memory(exc: BaseException) -> str | None:
    """One line for an allocation the settings made too large, else ``None`` (a bug).

    NumPy raises ``MemoryError``, PyTorch ``torch.OutOfMemoryError`` on a GPU and a
    ``RuntimeError`` naming the allocator on the CPU.
    """
    import torch

    text = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
    if not (isinstance(exc, MemoryError | torch.OutOfMemoryError)
            or CPU_ALLOCATOR_FAILURE in str(exc)):
        return None
    return (f"out of memory ({text}); lower batch.rows, batch.seq_len, update.accum or "
            "the model size (model.d_model, model.d_ff, model.n_layers)")


def dispatch(args: argparse.Namespace) -> int:
    """Run the parsed command: ``exactstep NAME`` is ``exactstep.commands.NAME.run``,
    its module imported only now (torch and the training stack with it)."""
    return importlib.import_module(f"exactstep.commands.{args.command}").run(args)
