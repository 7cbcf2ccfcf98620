"""ProsQA-style data (Hao et al. 2024, the Coconut paper; LIMe paper §5.3.1): questions over a
random DAG of fictional concepts, in the published ``data/prosqa_*.json`` format.

A record (one element of the JSON list)::

    {"question": "Every lempus is a zumpus. Tom is a lempus. ... Is Tom a zumpus or a rorpus?",
     "steps": ["Tom is a lempus.", "Every lempus is a zumpus."],
     "answer": "Tom is a zumpus.",
     "idx_to_symbol": ["Tom", "lempus", ...], "edges": [[0, 1], [1, 2], ...],
     "root": 0, "target": 2, "neg_target": 5}

``edges`` are ``[parent, child]`` node indices, each one fact ("Every <parent> is a <child>.", or
"<entity> is a <child>." from an entity); ``target`` is reachable from ``root`` and ``neg_target``
is not; ``steps`` are the facts of one shortest path from the root to the target.

Construction (after Coconut's published graphs; the code is this project's, :func:`random_graph`):
several entities (persons), the root among them, and fictional concepts, every node below its
children in index order (a DAG). The other entities head a distractor subgraph of concepts the
root cannot reach, among them the negative; the root's concepts sit on levels 1..hops, the target
on the last. The sizes are drawn per question (``ProsQASpec``); the defaults give the statistics
of Coconut's published test and validation files (800 graphs): nodes 23 [22, 24] (median
[quartiles]), edges 36 [32, 40], steps 4 [3, 4], entities 2 [2, 3], checked by
``tests/data/test_prosqa_data.py``; as there, the target and the negative are leaves, every
concept is reachable from some entity, and a few root-side concepts also from another entity. The
facts are shuffled into the question; the two candidates come in random order.
``tools/make_prosqa_data.py --from-coconut DIR`` converts Coconut's own files instead.

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
CODAS = ("m", "r", "l", "n", "rm", "lm", "s")


@dataclass(frozen=True)
class ProsQASpec:
    """Graph sizes and question depth, each drawn per question (module docstring): nodes
    ``min_nodes + Binomial(node_spread, 1/2)``, entities ``2 + Binomial(max_entities - 2,
    extra_entity_p)``, steps ``min_hops + Binomial(max_hops - min_hops, extra_hop_p)``, a concept's
    parents ``1 + Binomial(max_parents - 1, extra_parent_p)``. The defaults are fitted to Coconut's
    published graphs (``tests/data/test_prosqa_data.py::COCONUT``)."""

    min_nodes: int = 17
    node_spread: int = 12
    max_entities: int = 6
    extra_entity_p: float = 0.15
    min_hops: int = 3
    max_hops: int = 6
    extra_hop_p: float = 0.25
    max_parents: int = 5
    extra_parent_p: float = 0.25
    root_side_p: float = 0.6
    cross_parent_p: float = 0.1

    def __post_init__(self):
        problem = self.problem()
        if problem:
            raise ValueError(problem)

    def problem(self) -> str:
        """The first thing wrong with this spec, or ''."""
        if not 1 <= self.min_hops <= self.max_hops:
            return f"need 1 <= min_hops <= max_hops (got {self.min_hops}, {self.max_hops})"
        if self.max_entities < 2 or self.max_parents < 1 or self.node_spread < 0:
            return "max_entities must be at least 2, max_parents at least 1, node_spread at least 0"
        if self.min_nodes < self.max_entities + self.max_hops + 1:
            return (
                f"min_nodes ({self.min_nodes}) must be at least max_entities + max_hops + 1 "
                f"({self.max_entities + self.max_hops + 1}): the entities, a path and a negative"
            )
        probabilities = (
            self.extra_entity_p,
            self.extra_hop_p,
            self.extra_parent_p,
            self.root_side_p,
            self.cross_parent_p,
        )
        if not all(0.0 <= p <= 1.0 for p in probabilities):
            return "extra_entity_p, extra_hop_p, extra_parent_p, root_side_p and cross_parent_p must be in [0, 1]"
        return ""


def concept_names(rng: random.Random, count: int) -> list[str]:
    """``count`` distinct fictional concept names ("lempus", "zorpus", ...)."""
    names: set[str] = set()
    while len(names) < count:
        names.add(rng.choice(ONSETS) + rng.choice(VOWELS) + rng.choice(CODAS) + "pus")
    return sorted(names, key=lambda _: rng.random())


def fact(names: list[str], parent: int, child: int, entities: int) -> str:
    """The sentence of edge ``parent -> child``; nodes below ``entities`` are entities ("Tom is a
    ..."), the others concepts ("Every lempus is a ...")."""
    subject = names[parent] if parent < entities else f"Every {names[parent]}"
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


def _binomial(rng: random.Random, trials: int, p: float) -> int:
    return sum(rng.random() < p for _ in range(trials))


@dataclass(frozen=True)
class Graph:
    """A question's graph: ``edges`` [parent, child] over nodes 0..nodes-1 (entities first, then
    the distractor side's concepts, then the root side's by level: every parent before its
    child), the root entity, the target and the negative."""

    nodes: int
    entities: int
    edges: list[list[int]]
    target: int
    negative: int
    root: int = 0


def random_graph(rng: random.Random, spec: ProsQASpec) -> Graph:
    """One graph (module docstring): entity 0 is the root; the other entities and the distractor
    concepts form a side the root cannot reach; the root side's concepts sit on levels 1..hops,
    each with a parent one level up, more parents on its level or the one above (or, with
    ``cross_parent_p``, on the distractor side), so a concept's distance from the root is its
    level. The target (level ``hops``) and the negative (a distractor concept) parent nothing."""
    nodes = spec.min_nodes + _binomial(rng, spec.node_spread, 0.5)
    entities = 2 + _binomial(rng, spec.max_entities - 2, spec.extra_entity_p)
    hops = spec.min_hops + _binomial(rng, spec.max_hops - spec.min_hops, spec.extra_hop_p)
    free = nodes - entities - hops - 1  # concepts beyond the path and the negative
    root_extra = _binomial(rng, free, spec.root_side_p)
    distractors = list(range(entities, entities + free - root_extra + 1))
    negative = distractors[-1]
    levels = sorted([*range(1, hops + 1), *(rng.randint(1, hops) for _ in range(root_extra))])
    first = distractors[-1] + 1
    level_of = {0: 0, **{first + i: level for i, level in enumerate(levels)}}
    target = max(node for node, level in level_of.items() if level == hops)
    edges: list[list[int]] = []
    other_side = list(range(1, entities))
    for child in distractors:  # the negative last, so no distractor takes it as a parent
        edges += _parents(rng, spec, child, other_side, [])
        other_side += [child] if child != negative else []
    for child in range(first, nodes):
        up = [node for node in level_of if node < child and level_of[node] == level_of[child] - 1 and node != target]
        near = [node for node in level_of if node < child and level_of[node] >= level_of[child] - 1 and node != target]
        required = rng.choice(up)
        edges += [[required, child]] + _parents(rng, spec, child, [n for n in near if n != required], other_side)
    return Graph(nodes, entities, edges, target, negative)


def _parents(rng: random.Random, spec: ProsQASpec, child: int, own: list[int], cross: list[int]) -> list[list[int]]:
    """Edges to ``child`` from its extra parents (all of a distractor concept's parents are extra,
    at least one): each from ``own``, or with ``cross_parent_p`` from ``cross``; duplicates merge.
    The negative and the target are never among the candidates."""
    count = _binomial(rng, spec.max_parents - 1, spec.extra_parent_p) + (not cross and bool(own))
    parents = set()
    for _ in range(count):
        pool = cross if cross and rng.random() < spec.cross_parent_p else own
        if pool:
            parents.add(rng.choice(pool))
    return [[parent, child] for parent in sorted(parents)]


def sample(rng: random.Random, spec: ProsQASpec) -> dict:
    """One record (see the module docstring)."""
    graph = random_graph(rng, spec)
    previous = shortest_paths(graph.edges, graph.root, graph.nodes)
    path = _path(previous, graph.target)
    names = [*rng.sample(ENTITIES, graph.entities), *concept_names(rng, graph.nodes - graph.entities)]
    facts = [fact(names, parent, child, graph.entities) for parent, child in graph.edges]
    rng.shuffle(facts)
    candidates = [names[graph.target], names[graph.negative]]
    rng.shuffle(candidates)
    root = names[graph.root]
    return {
        "question": " ".join(facts) + f" Is {root} a {candidates[0]} or {candidates[1]}?",
        "steps": [fact(names, parent, child, graph.entities) for parent, child in zip(path, path[1:])],
        "answer": f"{root} is a {names[graph.target]}.",
        "idx_to_symbol": names,
        "edges": graph.edges,
        "root": graph.root,
        "target": graph.target,
        "neg_target": graph.negative,
    }


def generate(num_samples: int, seed: int, spec: ProsQASpec = ProsQASpec()) -> list[dict]:
    """``num_samples`` records; same seed, same records."""
    rng = random.Random(seed)
    return [sample(rng, spec) for _ in range(num_samples)]


def read(path: str, graph: bool = False) -> list[dict]:
    """The records of a ProsQA JSON file (ours or the published ones); one message naming the
    first record that lacks a field Coconut's reader needs, or with ``graph`` a graph field or
    whose graph does not answer its question (``check_graph``)."""
    with open(path, encoding="utf-8") as source:
        records = json.load(source)
    needed = FIELDS + GRAPH_FIELDS if graph else FIELDS
    for index, record in enumerate(records):
        missing = [name for name in needed if name not in record]
        problem = f"lacks {missing} (a ProsQA record has {list(needed)})" if missing else ""
        if graph and not missing:
            problem = check_graph(record)
        if problem:
            raise ValueError(f"{path}: record {index} {problem}")
    return records


def check_graph(record: dict) -> str:
    """What is wrong with a record's graph, or '': the target must be reachable from the root at
    the distance of its steps, the negative not at all."""
    nodes, root = len(record["idx_to_symbol"]), record["root"]
    previous = shortest_paths(record["edges"], root, nodes)
    if previous[record["target"]] is None or len(_path(previous, record["target"])) - 1 != len(record["steps"]):
        return f"has {len(record['steps'])} steps, not the distance from its root to its target"
    if record["neg_target"] == root or previous[record["neg_target"]] is not None:
        return "has a negative its root reaches"
    return ""


STATISTICS = ("nodes", "edges", "steps", "entities")


def graph_statistics(records: list[dict]) -> dict[str, list[float]]:
    """The 25th, 50th and 75th percentiles of nodes, edges, steps and entities (capitalised names)
    per record (numpy's linear interpolation)."""
    import numpy as np

    counts = {
        "nodes": [len(record["idx_to_symbol"]) for record in records],
        "edges": [len(record["edges"]) for record in records],
        "steps": [len(record["steps"]) for record in records],
        "entities": [sum(name[0].isupper() for name in record["idx_to_symbol"]) for record in records],
    }
    return {name: np.percentile(counts[name], [25, 50, 75]).tolist() for name in STATISTICS}


def describe(statistics: dict[str, list[float]]) -> str:
    """``graph_statistics`` in one line: the median of each and its quartiles."""
    return ", ".join(f"{name} {q[1]:g} [{q[0]:g}, {q[2]:g}]" for name, q in statistics.items())


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
