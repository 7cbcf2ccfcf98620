"""lime_megatron.analysis.measures: entropy against closed forms, router numbers against the model's
routers, the probe on separable and on random data, hooked values against the model's own value
projections, Hyper-Connections' hidden states as their streams' sums, dynamic LIMe's prior and
circuits against its routers' weights, and the plots of a LIMe/LLaMA/HC/dynamic-LIMe comparison."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lime_megatron.analysis import measures
from lime_megatron.parallel.process_groups import initialize_parallel
from tests.lime_fixtures import SEQ, VOCAB, tiny_model

pytest.importorskip("sklearn")
pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

WORDS = {"is": 7, "are": 8, "was": 9, "were": 10}


class WordTokenizer:
    """Each of ``WORDS`` (with or without a leading space) is one token; anything else two."""

    def tokenize(self, text: str) -> list[int]:
        word = text.strip()
        return [WORDS[word]] if word in WORDS else [0, 1]


def _tokens(n: int = 24) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(11, VOCAB, (n, SEQ), generator=generator)
    tokens[:, 6] = torch.tensor(list(WORDS.values())).repeat(n // 4)
    return tokens


@pytest.fixture(scope="module")
def models():
    initialize_parallel()
    return {
        "LIMe": tiny_model(torch.float32, num_query_groups=2).eval(),
        "LLaMA": tiny_model(torch.float32, num_query_groups=2, lime=False).eval(),
        "HC": tiny_model(torch.float32, num_query_groups=2, lime=False, hyper_connections=2).eval(),
        "Dynamic": tiny_model(torch.float32, num_query_groups=2, lime_router="dynamic").eval(),
    }


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_entropy_closed_forms(alpha):
    t = 8
    row = torch.randn(1, 16, dtype=torch.float64)
    assert measures.renyi_entropy(row.repeat(t, 1), alpha) == pytest.approx(0.0, abs=1e-9)
    orthonormal, _ = torch.linalg.qr(torch.randn(16, t, dtype=torch.float64))
    assert measures.renyi_entropy(orthonormal.T, alpha) == pytest.approx(math.log(t), rel=1e-9)
    # Two orthogonal directions with weights 3:1 -> p = (0.9, 0.1).
    two = torch.tensor([[3.0, 0.0], [0.0, 1.0]], dtype=torch.float64)
    p = np.array([0.9, 0.1])
    expected = -(p * np.log(p)).sum() if alpha == 1 else np.log((p**alpha).sum()) / (1 - alpha)
    assert measures.renyi_entropy(two, alpha) == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        measures.renyi_entropy(row, 0.0)


def test_probe_separates_separable_data_and_not_random_labels():
    generator = np.random.default_rng(0)
    centres = generator.normal(size=(4, 16)) * 4
    labels = np.repeat(np.arange(4), 50)
    features = centres[labels] + generator.normal(size=(200, 16))
    mean, std = measures.probe_accuracy(features, labels)
    assert mean >= 0.98 and std < 0.05
    chance, _ = measures.probe_accuracy(generator.normal(size=(200, 16)), labels)
    assert chance < 0.5
    with pytest.raises(ValueError, match="needs >= 5 examples"):
        measures.probe_accuracy(features[48:56], labels[48:56])
    with pytest.raises(ValueError, match="at least 2 classes"):
        measures.probe_accuracy(features[:8], labels[:8])


def test_hooked_values_are_the_models_value_projections(models):
    model = models["LIMe"]
    tokens = _tokens(4)
    reps = measures.collect_representations(model, tokens, batch_size=3, progress=False)
    assert len(reps.values) == len(reps.hidden) == model.config.num_layers
    with torch.no_grad():
        for index in range(1, model.config.num_layers):
            layer = model.decoder.layers[index]
            layer_input = reps.hidden[index - 1].transpose(0, 1)  # [s, b, h]
            _, _, value = layer.self_attention.get_query_key_value_tensors(layer.input_layernorm(layer_input))
            expected = value.reshape(SEQ, len(tokens), -1).transpose(0, 1)
            torch.testing.assert_close(reps.values[index], expected, rtol=1e-5, atol=1e-6)


def test_hyper_connection_hidden_states_are_each_sequences_stream_sums(models):
    """HC layers before the last return n streams folded into the batch: the hidden state kept is
    each sequence's sum of its streams (batched as one sequence at a time; a wrong unfold mixes
    sequences), and after the last layer it is what the final norm and output layer read."""
    model, tokens = models["HC"], _tokens(4)
    batched = measures.collect_representations(model, tokens, batch_size=4, progress=False)
    alone = measures.collect_representations(model, tokens, batch_size=1, progress=False)
    for together, single in zip(batched.hidden, alone.hidden):
        assert together.shape == (len(tokens), SEQ, model.config.hidden_size)
        torch.testing.assert_close(together, single, rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        logits = model(tokens, torch.arange(SEQ).expand(len(tokens), -1), None)
        read_out = model.output_layer(
            model.decoder.final_layernorm(batched.hidden[-1].transpose(0, 1)),
            weight=model.shared_embedding_or_output_weight(),
        )[0]
    torch.testing.assert_close(read_out.transpose(0, 1), logits, rtol=1e-5, atol=1e-5)


def test_retrieval_shares_of_a_known_router():
    weight = torch.tensor([[[1.0, -3.0], [2.0, 0.0]], [[-1.0, 1.0], [0.0, 2.0]]])  # [kv=2, sources=2, kv=2]
    shares = measures.retrieval_shares({1: ([0, 1], weight)}, 2)
    np.testing.assert_allclose(shares[1], [0.6, 0.4])  # mean |w|: source 0 -> 1.5, source 1 -> 1.0
    np.testing.assert_allclose(measures.self_retrieval(shares), [0.0, 0.4])
    np.testing.assert_allclose(measures.expected_depth(shares), [0.0, 0.4])


def test_analysis_of_lime_llama_and_hc_writes_numbers_and_plots(models, tmp_path):
    options = measures.AnalysisOptions(tsne_layers=(4,), tsne_iterations=250)
    results = measures.analyze(models, _tokens(), WordTokenizer(), str(tmp_path), options)
    saved = json.loads((tmp_path / "analysis.json").read_text())
    lime = saved["models"]["LIMe"]
    for router in models["LIMe"].routers():
        stored = lime["router"]["weights"][str(router.layer)]
        assert stored["sources"] == router.sources
        assert torch.equal(torch.tensor(stored["weight"]).reshape(router.weight.shape), router.weight.detach())
    np.testing.assert_allclose(np.array(lime["router"]["shares"]).sum(1), 1.0)
    assert "router" not in saved["models"]["LLaMA"] and "router" not in saved["models"]["HC"]
    dynamic = saved["models"]["Dynamic"]  # its prior stands for the router weights
    np.testing.assert_allclose(np.array(dynamic["router"]["shares"]).sum(1), 1.0, rtol=1e-6)
    assert len(dynamic["circuits"]) == 20 and all(c["source"] <= c["layer"] - 2 for c in dynamic["circuits"])
    for name in models:
        for key in ("entropy_values", "entropy_hidden", "probe_values", "probe_hidden"):
            assert len(results["models"][name][key]["mean"]) == 5
    for plot in (
        "entropy_values",
        "entropy_hidden",
        "probe_values",
        "probe_hidden",
        "tsne_values",
        "tsne_hidden",
        "retrieval_LIMe",
        "routers_LIMe",
        "retrieval_Dynamic",
        "routers_Dynamic",
    ):
        data = (tmp_path / f"{plot}.png").read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, plot


def test_a_word_without_a_single_token_is_named():
    assert measures.word_token_ids(WordTokenizer(), ["is", "were"]) == {"is": [7], "were": [10]}
    with pytest.raises(ValueError, match="no single token for 'been'"):
        measures.word_token_ids(WordTokenizer(), ["is", "been"])


def test_dynamic_prior_and_circuits_are_the_routers_own_weights():
    """v1 Fig. 13 and Table 2: the prior is the mean over tokens of each router's p_l (computed
    here again from the attention inputs), as a matrix diagonal in the heads; every circuit is one
    weight p_l(t)[h, j] of a source j <= l - 2, largest first."""
    initialize_parallel()
    model = tiny_model(torch.float32, num_query_groups=2, lime_router="dynamic").eval()
    tokens = _tokens(8)
    inputs = {}
    handles = [
        layer.self_attention.register_forward_pre_hook(
            lambda _m, args, i=index: inputs.setdefault(i, []).append(args[0].detach())
        )
        for index, layer in enumerate(model.decoder.layers)
    ]
    with torch.no_grad():
        prior, circuits = measures.dynamic_routing(model, tokens, batch_size=3, examples=6, progress=False)
    for handle in handles:
        handle.remove()
    assert sorted(prior) == [0, 1, 2, 3, 4]
    weights = {}
    for index, layer in enumerate(model.decoder.layers[1:], start=1):
        with torch.no_grad():
            # [s, n, kv, l + 1]
            weights[index] = torch.cat([layer.self_attention.router(x) for x in inputs[index]], dim=1)
        sources, matrix = prior[index]
        assert sources == list(range(index + 1))
        mean = weights[index].double().mean(dim=(0, 1))  # [kv, l + 1]
        torch.testing.assert_close(matrix, torch.diag_embed(mean.t()).permute(1, 0, 2).float())
    found = [c["weight"] for c in circuits]
    assert len(circuits) == 6 and found == sorted(found, reverse=True)
    for circuit in circuits:
        assert circuit["source"] <= circuit["layer"] - 2
        p = weights[circuit["layer"]][circuit["position"], circuit["sequence"], circuit["head"], circuit["source"]]
        assert abs(p.item() - circuit["weight"]) <= 1e-6
        assert circuit["token"] == tokens[circuit["sequence"], circuit["position"]]
    shares = measures.retrieval_shares(prior, 5)
    np.testing.assert_allclose(shares[1:].sum(1), 1.0, rtol=1e-6)
    np.testing.assert_allclose(shares[4], weights[4].double().mean(dim=(0, 1, 2)).numpy(), rtol=1e-5)
