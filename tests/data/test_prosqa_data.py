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


COCONUT = {
    "nodes": [22.0, 23.0, 24.0],
    "edges": [32.0, 36.0, 40.0],
    "steps": [3.0, 4.0, 4.0],
    "entities": [2.0, 2.0, 3.0],
}
"""``prosqa.graph_statistics`` of Coconut's published ``data/prosqa_test.json`` and
``prosqa_valid.json`` together (800 graphs; facebookresearch/coconut, the files stay out of this
repository): quartiles of nodes, edges, steps and entities. The issue's figures (median 23 nodes,
35 edges, 4 steps) are the test file's alone; ``make_prosqa_data.py --from-coconut`` prints them."""


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return prosqa.generate(200, seed=5)


def test_records_are_consistent_with_their_graph(records):
    for record in records:
        assert set(record) == set(prosqa.FIELDS + prosqa.GRAPH_FIELDS)
        names, edges, root = record["idx_to_symbol"], record["edges"], record["root"]
        entities = [index for index, name in enumerate(names) if name[0].isupper()]
        assert len(set(names)) == len(names) and all(parent < child for parent, child in edges)
        assert entities == list(range(len(entities))) and len(entities) >= 2 and root in entities
        distance = reachable(edges, root)
        assert record["target"] in distance and record["neg_target"] not in distance
        assert distance[record["target"]] >= 3 and len(record["steps"]) == distance[record["target"]]
        others = [reachable(edges, entity) for entity in entities if entity != root]
        assert any(record["neg_target"] in reach for reach in others)  # a distractor subgraph
        assert all(any(node in reach for reach in [distance, *others]) for node in range(len(names)))
        assert not [edge for edge in edges if edge[0] in (record["target"], record["neg_target"])]  # leaves
        facts = {prosqa.fact(names, parent, child, len(entities)) for parent, child in edges}
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
        assert prosqa.check_graph(record) == ""


def test_graph_sizes_match_coconuts_published_files():
    """800 generated graphs against ``COCONUT``: the medians equal, each quartile within 1 (nodes,
    steps, entities) or 2 (edges), as two samples of 800 from one distribution would differ."""
    ours = prosqa.graph_statistics(prosqa.generate(800, seed=0))
    for name, tolerance in (("nodes", 1), ("edges", 2), ("steps", 1), ("entities", 1)):
        assert ours[name][1] == COCONUT[name][1], (name, ours[name])
        assert all(abs(a - b) <= tolerance for a, b in zip(ours[name], COCONUT[name])), (name, ours[name])


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
    argv = ["--output-dir", str(tmp_path), "--train-samples", "120", "--test-samples", "30", "--max-hops", "4"]
    assert make_prosqa_data.main(argv) == 0
    train, test = (prosqa.read(str(tmp_path / f"prosqa_{split}.json"), graph=True) for split in ("train", "test"))
    assert len(test) == 30 and not {r["question"] for r in train} & {r["question"] for r in test}
    assert {len(r["steps"]) for r in train + test} <= {3, 4}
    lines = (tmp_path / "prosqa_train.jsonl").read_text().splitlines()
    assert [json.loads(line)["text"] for line in lines] == [prosqa.text_of(r) for r in train]
    (tmp_path / "bad.json").write_text(json.dumps([{"question": "q", "answer": "a"}]))
    with pytest.raises(ValueError, match=r"record 0 lacks \['steps'\]"):
        prosqa.read(str(tmp_path / "bad.json"))
    with pytest.raises(ValueError, match="min_hops <= max_hops"):
        prosqa.ProsQASpec(min_hops=4, max_hops=3)


def coconut_record(target: int, negative: int, steps: list[str]) -> dict:
    """A hand-written record in Coconut's format (its field names and sentence forms): Tom is a
    wumpus, every wumpus a zumpus; Ann is a lorpus; the question is about Tom."""
    return {
        "question": "Every wumpus is a zumpus. Ann is a lorpus. Tom is a wumpus. Is Tom a zumpus or lorpus?",
        "answer": "Tom is a zumpus.",
        "steps": steps,
        "idx_to_symbol": ["Tom", "Ann", "wumpus", "zumpus", "lorpus"],
        "edges": [[0, 2], [2, 3], [1, 4]],
        "root": 0,
        "target": target,
        "neg_target": negative,
    }


def test_coconuts_files_convert(tmp_path, capsys):
    """``--from-coconut DIR`` on a small file in Coconut's format writes the three files as for
    generated questions; a record whose steps do not reach its target is one clear error."""
    source = tmp_path / "coconut"
    source.mkdir()
    good = coconut_record(3, 4, ["Tom is a wumpus.", "Every wumpus is a zumpus."])
    for split in ("train", "test"):
        (source / f"prosqa_{split}.json").write_text(json.dumps([good]))
    out = tmp_path / "out"
    assert make_prosqa_data.main(["--output-dir", str(out), "--from-coconut", str(source)]) == 0
    assert json.loads((out / "prosqa_train.json").read_text()) == [good]
    assert json.loads((out / "prosqa_test.json").read_text()) == [good]
    line = json.loads((out / "prosqa_train.jsonl").read_text())
    assert line["prompt"] + line["response"] == line["text"] == prosqa.text_of(good)
    assert "nodes 5 [5, 5], edges 3 [3, 3], steps 2 [2, 2], entities 2 [2, 2]" in capsys.readouterr().out
    (source / "prosqa_test.json").write_text(json.dumps([coconut_record(3, 4, ["Tom is a wumpus."])]))
    assert make_prosqa_data.main(["--output-dir", str(out), "--from-coconut", str(source)]) == 1
    assert "record 0 has 1 steps, not the distance from its root to its target" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        make_prosqa_data.main(["--output-dir", str(out), "--from-coconut", str(source), "--train-samples", "3"])
