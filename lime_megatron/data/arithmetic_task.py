"""Prompt, response and tier of an arithmetic-expression record (``tools/make_arithmetic_data.py``;
LIMe paper App. B): the prompt is the expression and ``" ="``, the response the solution steps
after it, so ``prompt + response`` is the record's ``text``. Fine-tuning (``--sft``) and scoring
by generation (``lime_megatron.inference.scoring``) use the same split; scoring and the main job's
tables group records by their tier."""

from __future__ import annotations


def prompt_of(record: dict) -> str:
    """``"<expression> ="``."""
    return f"{record['expression']} ="


def response_of(record: dict) -> str:
    """The text after the prompt: ``" <step> = ... = <answer>"``."""
    prompt = prompt_of(record)
    if not record["text"].startswith(prompt):
        raise ValueError(f"record text {record['text']!r} does not start with its prompt {prompt!r}")
    return record["text"][len(prompt) :]


def tier_of(record: dict) -> int:
    """The record's tier: its ``num_operators`` or ``num_operands``, as its ``tier_unit`` says; a
    record without a known ``tier_unit`` (written before tiers had a unit) is one clear error."""
    unit = record.get("tier_unit")
    if unit not in ("operators", "operands"):
        raise ValueError(
            f"arithmetic record {record.get('expression')!r} has tier_unit {unit!r}, not 'operators' or "
            "'operands': write it again with tools/make_arithmetic_data.py"
        )
    return record[f"num_{unit}"]
