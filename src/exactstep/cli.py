"""The ``exactstep`` command (X2). Thin: parse, build, call; errors become one line (X4).

Parsing imports nothing heavy (torch loads inside ``dispatch``), so a usage error,
``--help`` and ``bench list`` answer at once; every user error ends in one
``error: ...`` line and a non-zero exit, and anything else keeps its traceback.
Design and derivations: docs/design/run.md#clipy (X2, X4).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import signal
import sys
from pathlib import Path
from typing import NoReturn

from exactstep.errors import ConfigError, DistributedError, ExactstepError, Interrupted

BENCH_PACKAGE = "exactstep.bench"  # each module in it but the helpers is one benchmark
BENCH_HELPERS = frozenset({"common"})
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

    inspect = sub.add_parser("inspect", help="print rows: input -> target, segment, position, masks")
    add_config_args(inspect)
    inspect.add_argument("--rows", default="0:1", help="row range A:B of the first microbatch")
    inspect.add_argument("--split", choices=("train", "val"), default="train")

    checkpoint = sub.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_sub = checkpoint.add_subparsers(dest="checkpoint_command", required=True)
    verify = checkpoint_sub.add_parser("verify", help="recompute digests of a checkpoint")
    verify.add_argument("path", help="a checkpoint directory, or a run directory (uses LATEST)")

    audit = sub.add_parser("audit", help="conformance probes against a training step (A1)")
    audit.add_argument("--target", required=True, metavar="T",
                       help="exactstep (this engine), python:MODULE:FUNCTION (FUNCTION() "
                            "returns an exactstep.audit.TrainingStep), hf-trainer"
                            "[:padding|flattening|lora] (Hugging Face Trainer and its "
                            "collator; lora: Trainer + peft), "
                            "or trl-sft[:completion_only_loss|assistant_only_loss|"
                            "padding_free|packing] (trl's SFTTrainer)")
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


def check_nodes(args: argparse.Namespace) -> None:
    """``--nnodes N`` needs N >= 1, ``0 <= --node-rank < N`` and, for N > 1,
    ``--rdzv-endpoint HOST:PORT`` (D1); refused in one line before anything runs."""
    nnodes = getattr(args, "nnodes", 1)
    if nnodes < 1:
        raise DistributedError(f"--nnodes expects a positive number of nodes; got {nnodes}")
    if not 0 <= args.node_rank < nnodes:
        raise DistributedError(f"--node-rank expects 0..{nnodes - 1} for --nnodes {nnodes}; "
                               f"got {args.node_rank}")
    endpoint = args.rdzv_endpoint
    if nnodes > 1 and not endpoint:
        raise DistributedError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (node 0's "
                               "address and a free port), the same on every node")
    host, _, port = (endpoint or "h:1").rpartition(":")
    if not host or not port.isdigit():
        raise DistributedError(f"--rdzv-endpoint expects HOST:PORT; got {endpoint!r}")


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
        nproc = getattr(args, "nproc", None)
        if nproc is not None:
            check_nproc(nproc)
        if getattr(args, "nnodes", 1) != 1 or getattr(args, "rdzv_endpoint", None):
            check_nodes(args)
            nproc = nproc or 1  # torchrun's default: one process per node
    except ExactstepError as exc:  # a usage error: nothing ran, nothing heavy is loaded
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    try:
        if nproc is not None and "WORLD_SIZE" not in os.environ:
            stop_on_early_sigterm()
            from exactstep.parallel.launch import Nodes, relaunch, strip_launch_flags

            nodes = None
            if getattr(args, "nnodes", 1) > 1:
                nodes = Nodes(args.nnodes, args.node_rank, args.rdzv_endpoint, args.rdzv_id,
                              args.rdzv_backend)
            return relaunch(strip_launch_flags(argv), nproc, nodes=nodes)
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


def check_nproc(nproc: int) -> None:
    """``--nproc R`` needs R >= 1 (D1); 0 or less is refused, never read as "one"."""
    if nproc < 1:
        raise DistributedError(f"--nproc expects a positive number of processes; got {nproc}")


def stop_on_early_sigterm() -> None:
    """A SIGTERM to the ``--nproc`` launcher before torchrun's agent installs its own
    handlers (which forward it to the workers) ends in one line and 130, not a silent
    death: importing PyTorch alone takes seconds.

    The handler writes the line and leaves at once (``os._exit``) instead of raising:
    an exception raised in the middle of an import would leave PyTorch half-imported.
    No worker exists yet, so nothing is left behind.
    """
    def stop(signum: int, frame: object) -> None:
        os.write(2, f"error: stopped by {signal.Signals(signum).name} before the workers "
                    "started; nothing ran, run the command again\n".encode())
        os._exit(Interrupted.exit_code)

    signal.signal(signal.SIGTERM, stop)


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
    if args.command == "train":
        from exactstep.config import load_config
        from exactstep.runner import train

        cfg = load_config(args.config, args.overrides)
        if args.resume == "auto":
            from exactstep.continuation import train_or_continue

            train_or_continue(cfg, Path(args.out), progress=not args.no_progress)
            return 0
        train(cfg, Path(args.out), progress=not args.no_progress)
        return 0
    if args.command == "resume":
        from exactstep.continuation import resume

        resume(
            Path(args.run_dir),
            from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
            overrides=args.overrides,
            warm_start_dir=Path(args.warm_start) if args.warm_start else None,
            reshard=args.reshard,
            progress=not args.no_progress,
        )
        return 0
    if args.command == "prepare":
        return prepare_command(args)
    if args.command == "eval":
        from exactstep.finished_run import evaluate_run

        report = evaluate_run(
            Path(args.run_dir),
            from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
        )
        print(report.format())
        return 0
    if args.command == "export":
        from exactstep.export import export_run

        if export_verify_requested(args):
            return export_verify_command(Path(args.export_dir))
        report = export_run(
            Path(args.run_dir), Path(args.out),
            from_checkpoint=Path(args.from_checkpoint) if args.from_checkpoint else None,
            adapter=args.adapter,
        )
        print(report.format())
        return 0
    if args.command == "inspect":
        from exactstep.config import load_config
        from exactstep.families.inspect import inspect_rows

        cfg = load_config(args.config, args.overrides)
        print(inspect_rows(cfg, parse_range(args.rows), split=args.split))
        return 0
    if args.command == "checkpoint":
        return verify_command(Path(args.path))
    if args.command == "audit":
        return audit_command(args.target, as_json=args.json, report=args.report,
                             probes=args.probes, probe_timeout=args.probe_timeout)
    if args.command == "bench":
        return bench_command(args.name, quick=args.quick, as_json=args.json,
                             dry_run=args.dry_run)
    if args.command == "smoke":
        return smoke_command(args.name, as_json=args.json, dry_run=args.dry_run)
    if args.command == "tokenizer":
        return tokenizer_train_command(args)
    if args.command == "config":
        from exactstep.config import config_keys

        for key, default, kind in config_keys():
            print(f"{key} = {default!r}  # {kind}")
        return 0
    raise AssertionError(args.command)


def tokenizer_train_command(args: argparse.Namespace) -> int:
    """``exactstep tokenizer train``: a BPE on the training split, published at ``--out``."""
    from exactstep.data.bpe import train_bpe_tokenizer

    record = train_bpe_tokenizer(args.source, args.vocab_size, Path(args.out),
                                 val_fraction=args.val_fraction, text_field=args.text_field)
    print(f"tokenizer {args.out}: byte-level BPE, {record['vocab_size']} tokens, trained on "
          f"{record['train_documents']} training documents of {record['source']} "
          f"(corpus {record['corpus_fingerprint'][:12]}); use it with --set "
          f"data.tokenizer=hf data.tokenizer_path={args.out}")
    return 0


def prepare_command(args: argparse.Namespace) -> int:
    """``exactstep prepare``: the run's tokenizer settings come from --config/--set (P1)."""
    from exactstep.config import load_config
    from exactstep.prepare import prepare

    cfg = load_config(args.config, args.overrides)
    meta = prepare(cfg, args.source, Path(args.out), workers=args.workers,
                   shard_tokens=args.shard_tokens, block_documents=args.block_documents,
                   progress=not args.no_progress)
    counts = ", ".join(f"{split} {info['documents']} documents / {info['tokens']} tokens in "
                       f"{len(info['shards'])} shards" for split, info in meta["splits"].items())
    print(f"prepared {args.out}: {counts}; {meta['dtype']}; fingerprint "
          f"{meta['fingerprint'][:12]}; train with --set data.source={args.out}")
    return 0


def parse_range(text: str) -> range:
    from exactstep.errors import ConfigError

    start, sep, stop = text.partition(":")
    try:
        a = int(start) if start else 0
        b = int(stop) if sep and stop else a + 1
    except ValueError:
        raise ConfigError(f"--rows expects A:B (e.g. 0:2), got {text!r}") from None
    if a < 0 or b <= a:
        raise ConfigError(f"--rows expects 0 <= A < B, got {text!r}")
    return range(a, b)


def export_verify_requested(args: argparse.Namespace) -> bool:
    """``export verify DIR`` (True) or ``export RUN_DIR --out DIR`` (False); any other
    combination is a ``ConfigError`` naming both forms."""
    forms = "export with 'exactstep export RUN_DIR --out DIR', check one with " \
            "'exactstep export verify DIR'"
    if args.run_dir == "verify" and (args.export_dir is not None or args.out is None):
        if args.export_dir is None:
            raise ConfigError(f"exactstep export verify needs the export directory: {forms}")
        if args.out is not None or args.from_checkpoint is not None:
            raise ConfigError(f"exactstep export verify DIR takes no --out or --from; {forms}")
        return True
    if args.export_dir is not None:
        raise ConfigError(f"exactstep export: unexpected argument {args.export_dir!r}; {forms}")
    if args.out is None:
        raise ConfigError("exactstep export: the following arguments are required: --out; "
                          "see 'exactstep export --help'")
    return False


def export_verify_command(path: Path) -> int:
    """``exactstep export verify DIR``: the passport's digests, OK (0) or FAILED (1)."""
    from exactstep.export import verify_export

    report = verify_export(path)
    print(report.format())
    return 0 if report.ok else 1


def verify_command(path: Path) -> int:
    """Verify one checkpoint, or a run directory's ``LATEST`` checkpoint (S6); an export
    directory is verified as one, against its passport (H3)."""
    from exactstep.export import PASSPORT, is_export, verify_export
    from exactstep.state.store import latest_checkpoint, verify_checkpoint

    if is_export(path):
        report = verify_export(path)
        print(report.format(f"export {path}: a Hugging Face export, not a checkpoint; its "
                            f"{PASSPORT} digests (as exactstep export verify checks them)"))
        return 0 if report.ok else 1
    target = path
    if (path / "checkpoints").is_dir():
        target = latest_checkpoint(path / "checkpoints") or path / "checkpoints"
    report = verify_checkpoint(target)
    print(report.format())
    if report.ok:  # what a bitwise continuation from it depends on (S9)
        from exactstep.parallel.dcp_format import DcpFormat
        from exactstep.state.checkpointer import checkpoint_progress
        from exactstep.state.environment import describe

        recorded = checkpoint_progress(target, DcpFormat).get("environment")
        print(f"  numerics  {describe(recorded)}")
    return 0 if report.ok else 1


def audit_command(target: str, *, as_json: bool, report: str | None,
                  probes: list[str] | None, probe_timeout: float | None = None) -> int:
    """Run the audit (A1); exit 0 only when every applicable probe passed, else 1.

    The exit status is the audit's, never the target's: a target's ``sys.exit`` is a
    probe's ERROR, and whatever the target writes to stdout goes to stderr, so stdout
    holds the table or exactly one JSON object."""
    from exactstep.audit.render import format_html, format_json, format_table
    from exactstep.audit.run import PROBE_TIMEOUT_S, audit, target_stdout_to_stderr

    if probe_timeout is None:
        probe_timeout = PROBE_TIMEOUT_S
    if probe_timeout < 0 or probe_timeout != probe_timeout:
        raise ConfigError(f"--probe-timeout expects seconds >= 0 (0: no limit); got "
                          f"{probe_timeout:g}")
    with target_stdout_to_stderr():
        result = audit(target, probes, probe_timeout=probe_timeout or None)
    print(format_json(result) if as_json else format_table(result))
    if report:
        try:
            Path(report).write_text(format_html(result), encoding="utf-8")
        except OSError as exc:
            raise ConfigError(f"cannot write --report {report}: {exc.strerror}") from None
    return 0 if result.ok else 1


def bench_names() -> list[str]:
    """The benchmarks shipped in ``exactstep.bench``, sorted: its modules minus helpers.

    Found with ``pkgutil`` in the installed package (not a source-checkout path), so
    ``exactstep bench`` works the same from a wheel; no benchmark is imported to list them.
    """
    package = importlib.import_module(BENCH_PACKAGE)
    return sorted(
        info.name
        for info in pkgutil.iter_modules(package.__path__)
        if not info.ispkg and info.name not in BENCH_HELPERS and not info.name.startswith("_")
    )


def smoke_command(name: str, *, as_json: bool, dry_run: bool) -> int:
    """Run one smoke test (``exactstep.smoke``); exit 1 when a check failed."""
    module = importlib.import_module(f"exactstep.smoke.{name}")
    figures = module.run(quick=False, dry_run=dry_run)
    if as_json:
        print(json.dumps({"smoke": name, "dry_run": dry_run, **figures}, sort_keys=True,
                         default=str))
    else:
        from exactstep.bench.common import format_figures

        print(format_figures(name, figures))
    return 0 if figures.get("ok", True) else 1


def bench_command(name: str, *, quick: bool, as_json: bool, dry_run: bool = False) -> int:
    """Run one benchmark and print its figures; exit 1 when it reports ``ok: false``
    (a smoke test whose check failed). ``--dry-run`` goes only to a benchmark whose
    ``run`` accepts it."""
    import inspect

    from exactstep.errors import ConfigError

    names = bench_names()
    if name == "list":
        for n in names:
            print(n)
        return 0
    if name not in names:
        raise ConfigError(f"unknown benchmark {name!r}; available: {', '.join(names)}")
    module = importlib.import_module(f"{BENCH_PACKAGE}.{name}")
    options = {"quick": quick}
    if dry_run:
        if "dry_run" not in inspect.signature(module.run).parameters:
            raise ConfigError(f"benchmark {name!r} has no --dry-run; run it without")
        options["dry_run"] = True
    figures = module.run(**options)
    if as_json:
        print(json.dumps({"bench": name, **options, **figures}, sort_keys=True, default=str))
    else:
        from exactstep.bench.common import format_figures

        print(format_figures(name, figures))
    return 0 if figures.get("ok", True) else 1
