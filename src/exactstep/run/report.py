"""What a run tells its user (X3): the progress bar, ``metrics.jsonl``, the end-of-run
summary (``summary.json``, ``data_report.json``, printed lines) and ``loss.png``.

``Reporter`` is the metrics component the runner calls once per window and once per
evaluation. Values reach it already on the host (the window's one read, U7); it
never touches the device. ``metrics.jsonl`` is a ``Journal`` whose mark each
checkpoint records, so a resume continues it exactly (S8), and the cumulative
window counters continue from the restored engine's counters, not from 0.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from exactstep.state.durable import Journal, read_records, write_json_durably
from exactstep.tracking import Tracker
from exactstep.update.disposition import Disposition, Outcome

METRICS_FILE = "metrics.jsonl"
LEDGER_FILE = "ledger.jsonl"
ROLLOUTS_FILE = "rollouts.jsonl"  # one line per sampled response (policy family, Q2)


@dataclass
class Meter:
    """Interval sums for the metrics lines; outcome counts are cumulative for the run.

    ``loss`` is the interval's optimized objective (sum of S over sum of D);
    ``gold_nll`` its unsmoothed NLL per supervised target (L2: reported beside the
    smoothed loss, equal to it when there is no smoothing).
    """

    counts: dict[str, int]
    started: float = field(default_factory=time.perf_counter)
    interval_start: float = field(default_factory=time.perf_counter)
    objective: float = 0.0
    denom: float = 0.0
    gold_nll: float = 0.0
    tokens: int = 0
    slots: int = 0

    def add(self, disp: Disposition, slots: int) -> None:
        self.counts[disp.outcome.value] += 1
        self.slots += slots
        if disp.outcome is Outcome.COMMITTED and disp.loss is not None:
            self.objective += disp.loss * disp.denominator
            self.denom += disp.denominator
            self.gold_nll += disp.gold_nll_sum
            self.tokens += disp.tokens

    def flush(self, window: int, lr: float | None) -> dict[str, Any]:
        now = time.perf_counter()
        elapsed = max(now - self.interval_start, 1e-9)
        record = {
            "window": window,
            "loss": self.objective / self.denom if self.denom else None,
            "gold_nll": self.gold_nll / self.tokens if self.tokens else None,
            "lr": lr,
            "tokens_per_s": self.slots / elapsed,
            "supervised_tokens": self.tokens,
            "elapsed_s": now - self.started,
            **{k.lower(): v for k, v in self.counts.items()},
        }
        self.interval_start = now
        self.objective = self.denom = self.gold_nll = 0.0
        self.tokens = self.slots = 0
        return record


class Reporter:
    """Progress bar and ``metrics.jsonl`` of one process (rank 0 writes; others count).

    ``counts`` are the run's outcome counters so far (a resumed run's restored
    counters); ``metrics`` is the journal to append to, ``None`` on other ranks;
    ``trackers`` receive the same figures (``exactstep.tracking``; rank 0 only).
    """

    def __init__(self, *, total: int, start: int, log_every: int, counts: dict[str, int],
                 metrics: Journal | None, progress: bool,
                 trackers: Sequence[Tracker] = ()) -> None:
        from tqdm import tqdm

        self.total = total
        self.log_every = log_every
        self.metrics = metrics
        self.trackers = list(trackers)
        self.meter = Meter(counts=dict(counts))
        self.bar = tqdm(total=total, initial=start, disable=not progress, unit="win",
                        dynamic_ncols=True, file=sys.stderr)

    def window(self, disp: Disposition, slots: int, lr: float | None) -> None:
        """Account one finished window (index ``disp.window``)."""
        self.meter.add(disp, slots)
        for tracker in self.trackers:
            tracker.window(disp, self.meter.counts)
        done = disp.window + 1
        if done % self.log_every == 0 or done == self.total:
            record = self.meter.flush(done, lr)
            if self.metrics is not None:
                self.metrics.append(record)
            for tracker in self.trackers:
                tracker.interval(record)
            self._update_bar(record)

    def evaluation(self, window: int, record: dict[str, Any]) -> None:
        if self.metrics is not None:
            self.metrics.append({"window": window, **record})
        for tracker in self.trackers:
            tracker.evaluation(window, record)

    def close(self) -> None:
        self.bar.close()
        for tracker in self.trackers:
            tracker.close()

    def _update_bar(self, record: dict[str, Any]) -> None:
        loss = record["loss"]
        counts = self.meter.counts
        self.bar.set_postfix(
            loss=f"{loss:.3f}" if loss is not None else "n/a",
            lr=f"{record['lr']:.2e}" if record["lr"] is not None else "n/a",
            tok_s=f"{record['tokens_per_s']:.0f}",
            ok=counts[Outcome.COMMITTED.value], skip=counts[Outcome.SKIPPED_NONFINITE.value],
            noobj=counts[Outcome.NO_OBJECTIVE.value], refresh=False,
        )
        self.bar.n = record["window"]
        self.bar.refresh()


def outcome_counts(committed: int, skipped: int, no_objective: int) -> dict[str, int]:
    return {Outcome.COMMITTED.value: committed, Outcome.SKIPPED_NONFINITE.value: skipped,
            Outcome.NO_OBJECTIVE.value: no_objective}


# --------------------------------------------------------------------------- end of run


def write_outputs(run_dir: Path, summary: dict[str, Any], data_report: dict[str, Any]) -> None:
    """``data_report.json``, ``summary.json`` (durably) and ``loss.png``; prints the summary."""
    write_json_durably(run_dir / "data_report.json", data_report)
    write_json_durably(run_dir / "summary.json", summary)
    plot_loss(run_dir)
    print(format_summary(summary), flush=True)


def plot_loss(run_dir: Path) -> None:
    """``loss.png``: committed window losses, a moving average, evaluations, and a
    mark at the foot of the plot for every skipped (non-finite) and every
    no-objective window, so a gap in the curve is never silent (U4, L4).

    Reads only complete, parseable journal lines (a damaged line is skipped, never a
    traceback after the final checkpoint).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    windows, losses, evals = [], [], []
    uncommitted: dict[str, list[int]] = {"SKIPPED_NONFINITE": [], "NO_OBJECTIVE": []}
    for rec in read_records(run_dir / LEDGER_FILE):
        if rec.get("disposition") == "COMMITTED" and isinstance(rec.get("loss"), float):
            windows.append(rec["window"])
            losses.append(rec["loss"])
        elif rec.get("disposition") in uncommitted and isinstance(rec.get("window"), int):
            uncommitted[rec["disposition"]].append(rec["window"])
    for rec in read_records(run_dir / METRICS_FILE):
        if isinstance(rec.get("eval_loss"), float):
            evals.append((rec["window"], rec["eval_loss"]))
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(windows, losses, lw=0.6, alpha=0.5, label="train (window S/D)")
    if len(losses) >= 10:
        k = max(1, len(losses) // 50)
        smooth = [sum(losses[max(0, i - k):i + 1]) / len(losses[max(0, i - k):i + 1])
                  for i in range(len(losses))]
        ax.plot(windows, smooth, lw=1.5, label=f"train, mean of {k + 1}")
    if evals:
        ax.plot(*zip(*evals, strict=True), "o-", label="held-out")
    styles = {"SKIPPED_NONFINITE": ("x", "red", "skipped (non-finite)"),
              "NO_OBJECTIVE": ("|", "gray", "no objective")}
    for outcome, marked in uncommitted.items():
        marker, color, label = styles[outcome]
        if marked:  # at the foot of the axes, whatever the loss scale
            ax.plot(marked, [0.0] * len(marked), marker, color=color, ls="none",
                    transform=ax.get_xaxis_transform(), clip_on=False,
                    label=f"{label}: {len(marked)}")
    ax.set_xlabel("window")
    ax.set_ylabel("loss (nats / target)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(run_dir / "loss.png", dpi=110)
    plt.close(fig)


def bits_lines(s: dict[str, Any]) -> list[str]:
    """Bits per byte (the held-out text's UTF-8 bytes, comparable across tokenizers)
    and, when a target is not one byte (a BPE), bits per token too; each with the
    unigram baseline on the same targets."""
    def f(x: Any) -> str:
        return format(x, ".4f") if isinstance(x, float) else "N/A"

    lines = [f"  bits per byte       {f(s['heldout_bits_per_byte'])}",
             f"  unigram baseline    {f(s['unigram_bits_per_byte'])} bits per byte"]
    if s.get("heldout_bytes") != s["heldout_tokens"] and "heldout_bits_per_token" in s:
        lines.append(f"  bits per token      {f(s['heldout_bits_per_token'])} "
                     f"(unigram {f(s['unigram_bits_per_token'])})")
    return lines


def format_summary(s: dict[str, Any]) -> str:
    def f(x: Any, spec: str = ".4f") -> str:
        return format(x, spec) if isinstance(x, float) else str(x)

    w = s["windows"]
    data = s["data"]
    lines = [
        "",
        "run summary",
        f"  windows             {w['committed']} committed, {w['skipped_nonfinite']} skipped "
        f"(non-finite), {w['no_objective']} no objective",
        f"  supervised tokens   {s['supervised_tokens']}",
        f"  wall time           {s['wall_s']:.1f} s",
        f"  held-out loss       {f(s['heldout_loss'])} nats/token over {s['heldout_tokens']} targets",
        f"  held-out perplexity {f(s['heldout_perplexity'], '.3f')}",
        *bits_lines(s),
        f"  ratio to unigram    {f(s['bpb_ratio_to_unigram'], '.3f')}",
        f"  packing efficiency  {f(data.get('efficiency'), '.4f')}",
    ]
    for key in ("split_documents", "truncated_documents", "dropped_documents", "dropped_targets"):
        if key in data:
            lines.append(f"  {key.replace('_', ' '):<19} {data[key]}")
    if "exact_match" in s:
        lines.append(f"  exact match         {f(s['exact_match'], '.3f')} "
                     f"on {s['exact_match_n']} {s.get('exact_match_of', 'held-out examples')}")
    if "masked_accuracy" in s:
        lines.append(f"  masked accuracy     {f(s['masked_accuracy'], '.3f')} on "
                     f"{s['masked_targets']} held-out selected tokens ([mask] only: "
                     f"{f(s['masked_accuracy_mask'], '.3f')}; unigram "
                     f"{f(s['unigram_accuracy'], '.3f')})")
    return "\n".join(lines)
