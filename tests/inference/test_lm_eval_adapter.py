"""lime_megatron.inference.lm_eval_adapter: lm-eval's requests answered from the model's own forward (float64;
LIMe and Hyper-Connections),
and ``lime-evaluate --model lime_megatron`` on a checkpoint with local YAML tasks (offline)
whose answers are known from that forward.

Data parallel (2 gloo ranks, one launch): the answers to each rank's lm-eval share of the
requests, gathered on rank 0, equal one process's, and lm-eval's ``simple_evaluate`` over the 2
ranks gives the one-process command line's metrics and per-document responses.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval import utils as lm_eval_utils  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402

from lime_megatron.inference.generation import Generator, SamplingOptions  # noqa: E402
from lime_megatron.inference.lm_eval_adapter import LimeMegatronLM  # noqa: E402
from lime_megatron.interop.checkpoint_model import load_model  # noqa: E402
from lime_megatron.testing.distributed import run_distributed  # noqa: E402
from tests.decoding_fixtures import tiny_checkpoint  # noqa: E402
from tests.lime_fixtures import tiny_model  # noqa: E402

pytestmark = [
    pytest.mark.usefixtures("megatron"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

ROOT = Path(__file__).resolve().parents[2]
QUESTIONS = ["1 + 2 =", "The sky is", "", "(7 + 5) x 3 ="]
CHOICES = ["3", "blue", "12", "x"]
TOLERANCE = 1e-10


def _requests(kind: str, arguments: list[tuple]) -> list[Instance]:
    return [Instance(kind, {}, args, index) for index, args in enumerate(arguments)]


def _log_probs(model, tokenizer, ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | ids[:t]) for t >= 1 from one forward of ``ids`` alone."""
    tokens = torch.tensor([ids])
    logits = model(tokens, torch.arange(len(ids))[None], None)[0, :-1, : tokenizer.unpadded_vocab_size]
    return logits.log_softmax(dim=-1).gather(1, tokens[0, 1:, None])[:, 0]


def _expected(model, tokenizer, context: str, continuation: str) -> tuple[float, bool]:
    prefix = tokenizer.tokenize(context) if context else [tokenizer.eod]
    target = tokenizer.tokenize(continuation)
    ids = prefix + target
    with torch.no_grad():
        scores = _log_probs(model, tokenizer, ids)[len(prefix) - 1 :]
        logits = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0, len(prefix) - 1 : -1]
    greedy = bool((logits[:, : tokenizer.unpadded_vocab_size].argmax(-1) == torch.tensor(target)).all())
    return float(scores.sum()), greedy


FAMILIES = {"lime": dict(), "hyper-connections": dict(lime=False, hyper_connections=4)}


@pytest.mark.parametrize("family", FAMILIES)
def test_loglikelihood_is_the_forwards_log_probability(tokenizer, family):
    model = tiny_model(num_query_groups=2, **FAMILIES[family]).eval()
    lm = LimeMegatronLM(model=model, tokenizer=tokenizer, batch_size=3, max_length=12)
    pairs = [(question, " " + choice) for question in QUESTIONS for choice in CHOICES]
    results = lm.loglikelihood(_requests("loglikelihood", pairs), disable_tqdm=True)
    for (context, continuation), (score, greedy) in zip(pairs, results):
        # contexts longer than 12 - len(continuation) tokens are cut from the left
        ids = (tokenizer.tokenize(context) if context else [tokenizer.eod]) + tokenizer.tokenize(continuation)
        cut = tokenizer.detokenize(ids[-13 : -len(tokenizer.tokenize(continuation))]) if len(ids) > 13 else context
        expected, expected_greedy = _expected(model, tokenizer, cut, continuation)
        assert abs(score - expected) <= 1e-10 * abs(expected) and greedy == expected_greedy
    with torch.no_grad():
        last = model(torch.tensor([tokenizer.tokenize(QUESTIONS[0])]), torch.arange(7)[None], None)[0, -1, :96]
    greedy_token = tokenizer.detokenize([int(last.argmax())])
    assert lm.loglikelihood(_requests("loglikelihood", [(QUESTIONS[0], greedy_token)]), True)[0][1]


@pytest.mark.parametrize("family", FAMILIES)
def test_rolling_loglikelihood_sums_disjoint_windows(tokenizer, family):
    model = tiny_model(num_query_groups=2, **FAMILIES[family]).eval()
    lm = LimeMegatronLM(model=model, tokenizer=tokenizer, batch_size=2, max_length=8)
    texts = ["abc = 12", "(7 + 5) x 3 = 36 and more text"]
    results = lm.loglikelihood_rolling(_requests("loglikelihood_rolling", [(text,) for text in texts]), True)
    for text, result in zip(texts, results):
        ids = tokenizer.tokenize(text)
        expected = 0.0
        # window k predicts ids[8k : 8k + 8] (eod before the first); its input is the 8 tokens
        # before its last one (lm-eval gives the last, shorter window a full context)
        with torch.no_grad():
            for start in range(0, len(ids), 8):
                stop = min(start + 8, len(ids))
                context = [tokenizer.eod] if start == 0 else ids[stop - 9 : start]
                scores = _log_probs(model, tokenizer, context + ids[start:stop])[len(context) - 1 :]
                expected += float(scores.sum())
        assert abs(result - expected) <= 1e-10 * abs(expected)


def _write_tasks(directory: Path, docs: list[dict], generation_docs: list[dict]) -> None:
    """Three local tasks: multiple choice with the gold answer the best / the worst choice, and
    generation with the model's own greedy continuation as target."""
    (directory / "choice.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    (directory / "generation.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in generation_docs))
    for name, target in (("tiny_best", "best"), ("tiny_worst", "worst")):
        (directory / f"{name}.yaml").write_text(
            f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {directory / 'choice.jsonl'}\n"
            "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
            f"doc_to_choice: choices\ndoc_to_target: {target}\nmetric_list:\n  - metric: acc\n"
        )
    (directory / "tiny_generation.yaml").write_text(
        f"task: tiny_generation\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {directory / 'generation.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{question}}'\ndoc_to_target: '{{answer}}'\n"
        "generation_kwargs:\n  until: ['\\n', '!']\n  max_gen_toks: 6\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n"
    )


TASKS = ["tiny_best", "tiny_worst", "tiny_generation"]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory, megatron, tokenizer) -> tuple[str, Path]:
    """(checkpoint, task directory): a tiny LIMe checkpoint and three local tasks whose answers
    are known from its float64 forward (the dtype every evaluation here reads it in)."""
    directory = tmp_path_factory.mktemp("tasks")
    checkpoint, _ = tiny_checkpoint(directory, "--lime")
    model = load_model(checkpoint, dtype=torch.float64).model
    docs = []
    for question in QUESTIONS[:2] + QUESTIONS[3:]:
        # lm-eval scores " " + choice after the question (its default target delimiter)
        scores = [_expected(model, tokenizer, question, " " + choice)[0] for choice in CHOICES]
        order = sorted(range(len(CHOICES)), key=scores.__getitem__)
        docs.append(dict(question=question, choices=CHOICES, best=order[-1], worst=order[0]))
    greedy = Generator(model, tokenizer).generate(
        [question + " " for question in QUESTIONS if question],
        SamplingOptions(max_new_tokens=6, stop_strings=("\n", "!")),
    )
    generation_docs = [
        dict(question=question + " ", answer=text) for question, text in zip([q for q in QUESTIONS if q], greedy.texts)
    ]
    _write_tasks(directory, docs, generation_docs)
    return checkpoint, directory


def _parsed(value):
    """``value`` as lm-eval logs it (``sanitize_list``: nested lists of strings), numbers as floats."""
    if isinstance(value, (list, tuple)):
        return [_parsed(item) for item in value]
    try:
        return float(value)
    except ValueError:
        return value


def _responses(samples: dict[str, list[dict]]) -> dict[str, dict[int, list]]:
    """Each task's filtered responses by document id, as lm-eval logs them, numbers as floats."""
    return {
        task: {
            sample["doc_id"]: _parsed(lm_eval_utils.sanitize_list(sample["filtered_resps"])) for sample in task_samples
        }
        for task, task_samples in samples.items()
    }


@pytest.fixture(scope="module")
def command_line_run(local_tasks, tmp_path_factory) -> tuple[dict, dict]:
    """(results, responses by task and document) of ``lime_megatron.cli.evaluate`` on the local tasks, one process."""
    checkpoint, directory = local_tasks
    output = tmp_path_factory.mktemp("results")
    inherited = {key: value for key, value in os.environ.items() if key not in ("MASTER_ADDR", "MASTER_PORT")}
    environment = {**inherited, **OFFLINE, "PYTHONPATH": str(ROOT), "HF_DATASETS_CACHE": str(output / "hf")}
    command = [
        sys.executable,
        "-m",
        "lime_megatron.cli.evaluate",
        "--model",
        "lime_megatron",
        "--model_args",
        f"checkpoint={checkpoint},dtype=float64",
        "--batch_size",
        "2",
        "--include_path",
        str(directory),
        "--tasks",
        ",".join(TASKS),
        "--output_path",
        str(output),
        "--log_samples",
    ]
    finished = subprocess.run(command, env=environment, capture_output=True, text=True, timeout=600)
    assert finished.returncode == 0, finished.stderr[-3000:]
    [results_file] = list(output.rglob("results_*.json"))
    samples = {
        re.match(r"samples_(.+)_\d{4}-\d\d-\d\dT", path.name).group(1): [
            json.loads(line) for line in path.read_text().splitlines()
        ]
        for path in output.rglob("samples_*.jsonl")
    }
    return json.loads(results_file.read_text())["results"], _responses(samples)


@pytest.mark.slow  # command-line runs (one under two ranks): ~60 s
def test_lm_eval_command_line_scores_local_tasks_with_known_answers(command_line_run):
    results, responses = command_line_run
    assert results["tiny_best"]["acc,none"] == 1.0
    assert results["tiny_worst"]["acc,none"] == 0.0
    assert results["tiny_generation"]["exact_match,none"] == 1.0
    assert {task: sorted(by_doc) for task, by_doc in responses.items()} == {task: [0, 1, 2] for task in TASKS}


# --------------------------------------------------------------------------- data parallel
REQUESTS = {
    "loglikelihood": [(question, " " + choice) for question in QUESTIONS for choice in CHOICES[:3]],
    "loglikelihood_rolling": [("abc = 12",), ("(7 + 5) x 3 = 36 and more text",), ("The sky is blue",)],
    "generate_until": [(question + " ", {"until": ["\n"], "max_gen_toks": 5}) for question in QUESTIONS],
}


def _data_parallel_evaluation(checkpoint: str, task_directory: str) -> dict:
    """On each of 2 ranks: the adapter's answers to its share of ``REQUESTS`` (split as lm-eval's
    evaluator splits documents) gathered on rank 0, the gathered share sizes, and rank 0's
    ``simple_evaluate`` results and responses on the local tasks (None elsewhere)."""
    rank = torch.distributed.get_rank()
    os.environ.update(OFFLINE, HF_DATASETS_CACHE=os.path.join(task_directory, f"hf-rank{rank}"))
    from lm_eval import evaluator
    from lm_eval.tasks import TaskManager

    lm = LimeMegatronLM(checkpoint, dtype="float64", batch_size=2)
    gathered, sizes = {}, {}
    for kind, arguments in REQUESTS.items():
        share = list(lm_eval_utils.create_iterator(enumerate(arguments), rank=lm.rank, world_size=lm.world_size))
        answers = getattr(lm, kind)(_requests(kind, [args for _, args in share]), disable_tqdm=True)
        gathered[kind] = lm.gather_object([(index, answer) for (index, _), answer in zip(share, answers)], dst=0)
        sizes[kind] = lm.all_gather(torch.tensor(len(share), device=lm.device)).tolist()
    results = evaluator.simple_evaluate(
        model=lm,
        tasks=TASKS,
        batch_size=2,
        log_samples=True,
        task_manager=TaskManager(include_path=task_directory, include_defaults=False),
    )
    evaluation = (
        None
        if results is None
        else (json.loads(json.dumps(results["results"], default=str)), _responses(results["samples"]))
    )
    return dict(rank=lm.rank, world_size=lm.world_size, gathered=gathered, sizes=sizes, evaluation=evaluation)


def _close(actual, expected) -> bool:
    """Equal responses, floats within 1e-10 (relative)."""
    if isinstance(expected, float):
        return abs(actual - expected) <= TOLERANCE * max(1.0, abs(expected))
    if isinstance(expected, (list, tuple)):
        return len(actual) == len(expected) and all(map(_close, actual, expected))
    if isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(_close(actual[key], expected[key]) for key in expected)
    return actual == expected


@pytest.mark.slow  # command-line runs (one under two ranks): ~60 s
def test_data_parallel_evaluation_equals_one_process(local_tasks, command_line_run):
    checkpoint, directory = local_tasks
    ranks = run_distributed(_data_parallel_evaluation, 2, checkpoint, str(directory))
    assert [(rank["rank"], rank["world_size"]) for rank in ranks] == [(0, 2), (1, 2)]
    one_process = LimeMegatronLM(checkpoint, dtype="float64", batch_size=3)
    for kind, arguments in REQUESTS.items():
        expected = getattr(one_process, kind)(_requests(kind, arguments), disable_tqdm=True)
        per_rank = ranks[0]["gathered"][kind]
        assert ranks[1]["gathered"][kind] is None and [len(answers) for answers in per_rank] == ranks[0]["sizes"][kind]
        assert ranks[0]["sizes"][kind] == ranks[1]["sizes"][kind] == [(len(arguments) + 1) // 2, len(arguments) // 2]
        answers = dict(answer for answers in per_rank for answer in answers)
        assert sorted(answers) == list(range(len(arguments))), kind
        assert _close([answers[index] for index in range(len(arguments))], expected), kind
    results, responses = command_line_run
    assert ranks[1]["evaluation"] is None
    data_parallel_results, data_parallel_responses = ranks[0]["evaluation"]
    assert _close(data_parallel_responses, responses)
    assert _close({task: data_parallel_results[task] for task in TASKS}, {task: results[task] for task in TASKS})


def test_adapter_without_checkpoint_or_text_tokenizer_fails_with_one_message():
    with pytest.raises(ValueError, match="checkpoint=PATH"):
        LimeMegatronLM()
    with pytest.raises(ValueError, match="text tokenizer"):
        LimeMegatronLM(model=tiny_model(), tokenizer=object())
