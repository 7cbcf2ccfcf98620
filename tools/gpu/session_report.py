"""The GPU session's report: ``report.md`` (for people) and ``results.json`` (for scripts), both
rewritten whole after every step, so that a session cut short still leaves every finished step.

A step declares its rows up front (``session_steps``); whatever happens to the step, each of them
appears in the report: with its value, or with the status that says why there is none
(``skipped``, ``timeout``, ``missing``).  Statuses:

| status | meaning |
|---|---|
| ``ok`` / ``FAILED`` | an enforced limit (a tolerance) held / was missed |
| ``target met`` / ``target missed`` | a reported target (a timing) held / was missed |
| (empty) | a measured figure without a limit |
| ``skipped`` | not measurable here (the note says why: no CUDA, one GPU, no TransformerEngine...) |
| ``timeout`` / ``missing`` | the step ran out of time / ended without producing this row |

Standard library only, like the session.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

PROBLEMS = ("FAILED", "timeout", "missing")
"""Row statuses that make the session's exit status 1."""


@dataclass
class ReportRow:
    """One row: a name stable across runs and machines, its value and what it is held to."""

    name: str
    value: float | str | None = None
    limit: str = ""
    """The limit as read (``<= 0.01``, ``target <= 1.05``), empty when the row is only reported."""
    status: str = ""
    note: str = ""


def limit_status(value: float, limit: float, lower_bound: bool = False, enforced: bool = False) -> tuple[str, str]:
    """(the limit as text, the status) of ``value`` held to ``limit`` (``>=`` with ``lower_bound``;
    ``enforced``: a tolerance, else a reported target)."""
    sign = ">=" if lower_bound else "<="
    text = f"{sign} {limit:g}" if enforced else f"target {sign} {limit:g}"
    held = math.isfinite(value) and (value >= limit if lower_bound else value <= limit)
    if enforced:
        return text, "ok" if held else "FAILED"
    return text, "target met" if held else "target missed"


@dataclass
class StepResult:
    """What one step did."""

    name: str
    title: str
    status: str = "not run"
    """``ok``, ``failed`` (a command failed or a tolerance was missed), ``timeout``, ``skipped``."""
    seconds: float = 0.0
    budget_s: float = 0.0
    commands: list[str] = field(default_factory=list)
    reason: str = ""
    rows: list[ReportRow] = field(default_factory=list)


@dataclass
class SessionReport:
    """The whole session: where it ran, and its steps in order."""

    header: dict[str, str]
    steps: list[StepResult] = field(default_factory=list)

    @property
    def problems(self) -> list[str]:
        """``step: row (status)`` of every row whose status is one of ``PROBLEMS``."""
        return [
            f"{step.name}: {row.name} ({row.status})"
            for step in self.steps
            for row in step.rows
            if row.status in PROBLEMS
        ]

    def write(self, out: Path) -> None:
        """``out/results.json`` and ``out/report.md``, each replaced whole."""
        _replace(
            out / "results.json", json.dumps(dict(session=self.header, steps=[asdict(s) for s in self.steps]), indent=1)
        )
        _replace(out / "report.md", self.markdown())

    def markdown(self) -> str:
        lines = ["# GPU session report", ""]
        lines += [f"- **{key}**: {value}" for key, value in self.header.items()]
        counts: dict[str, int] = {}
        for step in self.steps:
            counts[step.status] = counts.get(step.status, 0) + 1
        lines += ["- **steps**: " + ", ".join(f"{count} {status}" for status, count in counts.items()), ""]
        for number, step in enumerate(self.steps, 1):
            lines += step_markdown(number, step)
        return "\n".join(lines) + "\n"


def step_markdown(number: int, step: StepResult) -> list[str]:
    """A step's section: heading with status and time, its commands, its rows as a table."""
    lines = [f"## {number}. {step.title} (`{step.name}`): {step.status}", ""]
    lines.append(
        f"{step.seconds:.0f} s of a {step.budget_s:.0f} s budget." + (f" {step.reason}" if step.reason else "")
    )
    lines.append("")
    if step.commands:
        lines += ["```bash", *step.commands, "```", ""]
    lines += ["| row | value | limit | status | note |", "|---|---|---|---|---|"]
    cells = ((r.name, format_value(r.value), r.limit, r.status, r.note) for r in step.rows)
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in cells]
    return lines + [""]


def format_value(value: float | str | None) -> str:
    """Four significant digits (thousands separated), or the text as it is; empty for None."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if not math.isfinite(value) or value == 0:
        return str(value)
    if 1e-3 <= abs(value) < 1e4:
        return f"{value:.4g}"
    if 1e4 <= abs(value) < 1e9:
        return f"{value:,.0f}"
    return f"{value:.3e}"


def _replace(path: Path, text: str) -> None:
    partial = path.with_name(path.name + ".part")
    partial.write_text(text)
    os.replace(partial, path)
