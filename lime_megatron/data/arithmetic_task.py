"""Prompt and response of an arithmetic-expression record (``tools/make_arithmetic_data.py``; LIMe
paper App. B): the prompt is the expression and ``" ="``, the response the solution steps after
it, so ``prompt + response`` is the record's ``text``. Fine-tuning (``--sft``) and scoring by
generation (``lime_megatron.inference.scoring``) use the same split."""

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
