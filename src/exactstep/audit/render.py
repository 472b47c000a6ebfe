"""The audit's outputs: a text table, one JSON object, a self-contained HTML page (A1).

The HTML page needs nothing but itself: inline CSS and, for each numeric probe, an
inline SVG plot of expected against observed values (points on the diagonal agree).
"""

from __future__ import annotations

import html
import json

from exactstep.audit.run import AuditReport

COLUMNS = ("probe", "contract", "expected", "observed", "status")


def format_table(report: AuditReport) -> str:
    """One line per probe, a fix line per FAIL, and a summary line."""
    rows = [COLUMNS] + [(r.probe, r.contract, r.expected, r.observed, r.status)
                        for r in report.results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
             for row in rows]
    lines.insert(1, "-" * min(120, max(len(line) for line in lines)))
    fixes = [f"fix {r.probe} ({r.contract}): {r.fix}" for r in report.results if r.fix]
    counts = report.counts
    summary = (f"target {report.target}: {len(report.results)} probes, "
               + ", ".join(f"{n} {s}" for s, n in counts.items())
               + f" in {report.seconds:.1f} s -> " + ("OK" if report.ok else "NOT CONFORMANT"))
    return "\n".join(lines + ([""] + fixes if fixes else []) + ["", summary])


def format_json(report: AuditReport) -> str:
    return json.dumps(report.to_dict(), sort_keys=True)


def svg_plot(expected: list[float], observed: list[float], size: int = 140) -> str:
    """Expected (x) vs observed (y) as points, with the diagonal y = x."""
    values = [abs(v) for v in expected + observed] or [1.0]
    top = max(values) * 1.05 or 1.0
    pad = 12

    def at(v: float) -> float:
        return pad + (size - 2 * pad) * min(max(v, 0.0), top) / top

    points = "".join(
        f'<circle cx="{at(abs(e)):.1f}" cy="{size - at(abs(o)):.1f}" r="2.5" fill="#c0392b"/>'
        for e, o in zip(expected, observed, strict=False))
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{size}" height="{size}" '
            f'viewBox="0 0 {size} {size}"><rect width="{size}" height="{size}" fill="#fafafa" '
            f'stroke="#ccc"/><line x1="{pad}" y1="{size - pad}" x2="{size - pad}" y2="{pad}" '
            f'stroke="#888" stroke-dasharray="3"/>{points}<text x="{pad}" y="{size - 2}" '
            f'font-size="8">expected |x|</text><text x="2" y="{pad - 3}" font-size="8">'
            f'observed |y|</text></svg>')


def format_html(report: AuditReport) -> str:
    rows = []
    for r in report.results:
        plot = svg_plot(r.expected_values, r.observed_values) if r.expected_values else ""
        fix = f"<div class=fix>fix: {html.escape(r.fix)}</div>" if r.fix else ""
        cells = "".join(f"<td>{html.escape(str(v))}</td>" for v in
                        (r.probe, r.contract, r.expected))
        rows.append(f"<tr class={r.status.replace('/', '')}>{cells}"
                    f"<td>{html.escape(r.observed)}{fix}</td><td><b>{r.status}</b></td>"
                    f"<td>{plot}</td></tr>")
    counts = ", ".join(f"{n} {s}" for s, n in report.counts.items())
    verdict = "conformant" if report.ok else "not conformant"
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>exactstep audit: {html.escape(report.target)}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ddd;padding:4px 8px;vertical-align:top;font-size:13px}}
tr.PASS b{{color:#1e7e34}}tr.FAIL b,tr.ERROR b{{color:#c0392b}}tr.NA b{{color:#777}}
.fix{{color:#8a4b00;margin-top:4px}}</style></head><body>
<h1>exactstep audit</h1>
<p>target <code>{html.escape(report.target)}</code>: {counts} in {report.seconds:.1f} s,
<b>{verdict}</b>. Plots: expected against observed (per parameter tensor: the norm of its
change; on the dashed diagonal they agree).</p>
<table><tr><th>probe</th><th>contract</th><th>expected</th><th>observed</th><th>status</th>
<th>plot</th></tr>
{chr(10).join(rows)}
</table></body></html>
"""
