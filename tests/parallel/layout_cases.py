"""Running a matrix of parallel layouts against the single stage: the shape the pipeline and the
hyper-connection layout tests share.  A case is ``(name, model settings, layouts, [stages])``;
each model's single-stage reference is trained once, and every layout of every case that uses it
is compared with it."""

from __future__ import annotations

from collections.abc import Callable


def model_key(model: dict) -> tuple:
    """Key of a single-stage reference: the model settings (pipeline options never reach it)."""
    return tuple(sorted(model.items()))


def run_cases(cases: list, train_reference: Callable, compare: Callable) -> tuple[dict, dict]:
    """(``compare(layout, model, reference, stages=...)``'s report per ``"<case> <layout>"``, the
    reference ``train_reference(model)`` per ``model_key``), each reference trained once."""
    report, references = {}, {}
    for name, model, layouts, *stages in cases:
        key = model_key(model)
        if key not in references:
            references[key] = train_reference(model)
        for layout in layouts:
            outcome = compare(layout, model, references[key], stages=stages[0] if stages else None)
            report[f"{name} {layout.name}"] = outcome
    return report, references
