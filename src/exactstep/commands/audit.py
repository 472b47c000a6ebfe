"""``exactstep audit``: conformance probes against a training step (A1); exit 0 only
when every applicable probe passed."""

from __future__ import annotations

import argparse
from pathlib import Path

from exactstep.audit.render import format_html, format_json, format_table
from exactstep.audit.run import PROBE_TIMEOUT_S, audit, target_stdout_to_stderr
from exactstep.errors import ConfigError


def run(args: argparse.Namespace) -> int:
    return audit_command(args.target, as_json=args.json, report=args.report,
                         probes=args.probes, probe_timeout=args.probe_timeout)


def audit_command(target: str, *, as_json: bool, report: str | None,
                  probes: list[str] | None, probe_timeout: float | None = None) -> int:
    """Run the audit (A1); exit 0 only when every applicable probe passed, else 1.

    The exit status is the audit's, never the target's: a target's ``sys.exit`` is a
    probe's ERROR, and whatever the target writes to stdout goes to stderr, so stdout
    holds the table or exactly one JSON object."""
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
