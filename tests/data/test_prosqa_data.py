"""lime_megatron.data.prosqa and tools/make_prosqa_data.py: every record checked against its own
graph by an independent search (reachability, shortest path, facts), the published fields, the
held-out split, the reader's error, and ProsQA scoring of generators made right and wrong."""

import json

import pytest

from lime_megatron.cli import make_prosqa_data
from lime_megatron.data import prosqa
from lime_megatron.inference import scoring


def reachable(edges: list[list[int]], start: int) -> dict[int, int]:
    """Distance of every node reachable from ``start`` (repeated relaxation, not a queue)."""
    distance = {start: 0}
    changed = True
    while changed:
        changed = False
        for parent, child in edges:
            if parent in distance and distance[parent] + 1 < distance.get(child, 10**9):
                distance[child] = distance[parent] + 1
                changed = True
    return distance


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return prosqa.generate(200, seed=5, spec=prosqa.ProsQASpec(num_concepts=14, min_hops=3))


def test_records_are_consistent_with_their_graph(records):
    for record in records:
        assert set(record) == set(prosqa.FIELDS + prosqa.GRAPH_FIELDS)
        names, edges, root = record["idx_to_symbol"], record["edges"], record["root"]
        assert len(set(names[1:])) == len(names) - 1 and all(parent < child for parent, child in edges)
        distance = reachable(edges, root)
        assert record["target"] in distance and record["neg_target"] not in distance
        assert distance[record["target"]] >= 3 and len(record["steps"]) == distance[record["target"]]
        facts = {prosqa.fact(names, parent, child, root) for parent, child in edges}
        question, candidates = record["question"].rsplit(" Is ", 1)
        assert sorted(sentence + "." for sentence in question.rstrip(".").split(". ")) == sorted(facts)
        assert set(record["steps"]) <= facts
        assert record["steps"][0].startswith(f"{names[root]} is a ")
        assert record["steps"][-1].endswith(f" is a {names[record['target']]}.")
        assert candidates in (
            f"{names[root]} a {names[record['target']]} or {names[record['neg_target']]}?",
            f"{names[root]} a {names[record['neg_target']]} or {names[record['target']]}?",
        )
        assert record["answer"] == f"{names[root]} is a {names[record['target']]}."


def test_text_is_coconuts_and_answers_extract(records):
    record = records[0]
    text = prosqa.text_of(record)
    assert text == record["question"] + "\n" + "\n".join(record["steps"]) + "\n### " + record["answer"]
    generated = text[len(prosqa.prompt_of(record)) :]
    assert prosqa.final_answer(generated) == record["answer"]
    assert prosqa.generated_steps(generated) == record["steps"]


def test_scoring_a_generator_made_right_and_one_made_wrong(records):
    def right(prompts):
        by_prompt = {prosqa.prompt_of(record): record for record in records}
        return [prosqa.text_of(by_prompt[prompt])[len(prompt) :] for prompt in prompts]

    def wrong_answer(prompts):
        return [text.replace("### ", "### Nobody ") for text in right(prompts)]

    answer, steps = scoring.score_prosqa(right, records)[0]
    assert (answer.group, answer.correct, steps.correct) == ("answer", 200, 200)
    answer, steps = scoring.score_prosqa(wrong_answer, records)[0]
    assert (answer.correct, steps.correct) == (0, 200)


def test_tool_writes_disjoint_splits_and_the_reader_names_a_missing_field(tmp_path):
    assert (
        make_prosqa_data.main(
            ["--output-dir", str(tmp_path), "--train-samples", "120", "--test-samples", "30", "--num-concepts", "10"]
        )
        == 0
    )
    train, test = (prosqa.read(str(tmp_path / f"prosqa_{split}.json")) for split in ("train", "test"))
    assert len(test) == 30 and not {r["question"] for r in train} & {r["question"] for r in test}
    lines = (tmp_path / "prosqa_train.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == [prosqa.text_of(r) for r in train]
    (tmp_path / "bad.json").write_text(json.dumps([{"question": "q", "answer": "a"}]))
    with pytest.raises(ValueError, match=r"record 0 lacks \['steps'\]"):
        prosqa.read(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="num_concepts"):
        prosqa.ProsQASpec(num_concepts=3, min_hops=3)
