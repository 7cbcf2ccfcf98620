"""ProsQA-style data (Hao et al. 2024, the Coconut paper; LIMe paper §5.3.1): questions over a
random DAG of fictional concepts, in the published ``data/prosqa_*.json`` format.

A record (one element of the JSON list)::

    {"question": "Every lempus is a zumpus. Tom is a lempus. ... Is Tom a zumpus or a rorpus?",
     "steps": ["Tom is a lempus.", "Every lempus is a zumpus."],
     "answer": "Tom is a zumpus.",
     "idx_to_symbol": ["Tom", "lempus", ...], "edges": [[0, 1], [1, 2], ...],
     "root": 0, "target": 2, "neg_target": 5}

``edges`` are ``[parent, child]`` node indices, each one fact ("Every <parent> is a <child>.", or
"<root> is a <child>." from the root entity); ``target`` is reachable from ``root`` and
``neg_target`` is not; ``steps`` are the facts of one shortest path from the root to the target.

Construction (after the Coconut paper's description; the code is this project's): node 0 is the
entity, nodes 1..n fictional concepts, each with up to ``max_parents`` parents among earlier nodes
(so the graph is a DAG), on the root's side or on a side the root cannot reach
(:func:`random_dag`); the target is drawn among the concepts reachable from the root at a
distance of at least ``min_hops``, the negative among the unreachable concepts named in a fact.
The facts are shuffled into the question; the two candidates come in random order.

The training text of a record is Coconut's: ``question + "\\n" + "\\n".join(steps) + "\\n### " +
answer`` (:func:`text_of`); its prompt is ``question + "\\n"`` and the answer is what follows the
last ``#`` of a generation (:func:`final_answer`), as Coconut scores it.
"""

from __future__ import annotations

import json
import random
from collections import deque
from dataclasses import dataclass

FIELDS = ("question", "steps", "answer")
"""What Coconut's reader needs; the graph fields (``GRAPH_FIELDS``) come with the published data."""
GRAPH_FIELDS = ("idx_to_symbol", "edges", "root", "target", "neg_target")
ENTITIES = ("Tom", "Alex", "Sally", "Max", "Jack", "Polly", "Rex", "Wren", "Fae", "Stella", "Sam", "Bob")
ONSETS = "bdfglmnprstvwyz"
VOWELS = "aeiou"
CODAS = ("m", "r", "l", "n", "rp", "mp", "s")


@dataclass(frozen=True)
class ProsQASpec:
    """Graph size and question depth."""

    num_concepts: int = 16
    max_parents: int = 2
    min_hops: int = 3

    def __post_init__(self):
        if self.num_concepts < self.min_hops + 2:
            raise ValueError(
                f"num_concepts ({self.num_concepts}) must be at least min_hops + 2 "
                f"({self.min_hops + 2}): a path of min_hops concepts and a negative"
            )
        if self.max_parents < 1 or self.min_hops < 1:
            raise ValueError("max_parents and min_hops must be at least 1")


def concept_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct fictional concept names ("lempus", "zorpus", ...)."""
    names: set[str] = set()
    while len(names) < count:
        names.add(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) + "pus")
    return sorted(names, key=lambda _: rng.random())


def fact(names: list[str], parent: int, child: int, root: int) -> str:
    """The sentence of edge ``parent -> child``."""
    subject = names[parent] if parent == root else f"Every {names[parent]}"
    return f"{subject} is a {names[child]}."


def shortest_paths(edges: list[list[int]], root: int, nodes: int) -> list[int | None]:
    """Breadth-first predecessor of every node on one shortest path from ``root`` (None: unreachable
    or the root itself)."""
    children: list[list[int]] = [[] for _ in range(nodes)]
    for parent, child in edges:
        children[parent].append(child)
    previous: list[int | None] = [None] * nodes
    seen, queue = {root}, deque([root])
    while queue:
        node = queue.popleft()
        for child in children[node]:
            if child not in seen:
                seen.add(child)
                previous[child] = node
                queue.append(child)
    return previous


def _path(previous: list[int | None], target: int) -> list[int]:
    path = [target]
    while previous[path[-1]] is not None:
        path.append(previous[path[-1]])
    return path[::-1]


def random_dag(rng: random.Random, spec: ProsQASpec) -> list[list[int]]:
    """Edges ``[parent, child]`` over the root 0 and concepts 1..num_concepts: each concept is put
    on the root's side or the other side at random; a root-side concept takes its parents among
    the root and the earlier concepts (at least one on the root's side), an other-side concept
    among the earlier other-side ones only, so no other-side concept is reachable from the root."""
    rooted: list[int] = [0]
    other: list[int] = []
    edges: list[list[int]] = []
    for child in range(1, spec.num_concepts + 1):
        count = rng.randint(1, spec.max_parents)
        if child == 1 or rng.random() < 0.5:
            parents = {rng.choice(rooted), *rng.sample(rooted + other, min(count, len(rooted + other)) - 1)}
            rooted.append(child)
        else:
            parents = set(rng.sample(other, min(count, len(other))))
            other.append(child)
        edges += [[parent, child] for parent in sorted(parents)]
    return edges


def sample(rng: random.Random, spec: ProsQASpec) -> dict:
    """One record (see the module docstring); graphs without a deep enough target or a negative
    are redrawn."""
    nodes = spec.num_concepts + 1
    while True:
        edges = random_dag(rng, spec)
        previous = shortest_paths(edges, 0, nodes)
        paths = {node: _path(previous, node) for node in range(1, nodes) if previous[node] is not None}
        targets = [node for node, path in paths.items() if len(path) - 1 >= spec.min_hops]
        in_facts = {node for edge in edges for node in edge}
        negatives = [node for node in range(1, nodes) if node not in paths and node in in_facts]
        if targets and negatives:
            break
    target, negative = rng.choice(targets), rng.choice(negatives)
    names = [rng.choice(ENTITIES), *concept_names(rng, spec.num_concepts)]
    facts = [fact(names, parent, child, 0) for parent, child in edges]
    rng.shuffle(facts)
    candidates = [names[target], names[negative]]
    rng.shuffle(candidates)
    path = paths[target]
    return {
        "question": " ".join(facts) + f" Is {names[0]} a {candidates[0]} or {candidates[1]}?",
        "steps": [fact(names, parent, child, 0) for parent, child in zip(path, path[1:])],
        "answer": f"{names[0]} is a {names[target]}.",
        "idx_to_symbol": names,
        "edges": edges,
        "root": 0,
        "target": target,
        "neg_target": negative,
    }


def generate(num_samples: int, seed: int, spec: ProsQASpec = ProsQASpec()) -> list[dict]:
    """``num_samples`` records; same seed, same records."""
    rng = random.Random(seed)
    return [sample(rng, spec) for _ in range(num_samples)]


def read(path: str) -> list[dict]:
    """The records of a ProsQA JSON file (ours or the published ones); one message naming the
    first record that lacks a field Coconut's reader needs."""
    with open(path, encoding="utf-8") as source:
        records = json.load(source)
    for index, record in enumerate(records):
        missing = [name for name in FIELDS if name not in record]
        if missing:
            raise ValueError(f"{path}: record {index} lacks {missing} (a ProsQA record has {list(FIELDS)})")
    return records


def prompt_of(record: dict) -> str:
    return record["question"] + "\n"


def response_of(record: dict) -> str:
    """The steps and the answer after the prompt: ``"\\n".join(steps) + "\\n### " + answer``."""
    return "\n".join(record["steps"]) + "\n### " + record["answer"]


def text_of(record: dict) -> str:
    """Coconut's training text of a record."""
    return prompt_of(record) + response_of(record)


def final_answer(generated: str) -> str:
    """What follows the last ``#`` of a generation, stripped (Coconut's answer extraction)."""
    return generated.rsplit("#", 1)[-1].strip()


def generated_steps(generated: str) -> list[str]:
    """The non-empty lines of a generation before its ``###`` marker."""
    return [line.strip() for line in generated.split("###", 1)[0].splitlines() if line.strip()]
