"""Looking inside trained models (paper §5.2-5.4): router weights, representation entropy, token
separability and t-SNE, for LIMe and its baselines (LLaMA, Hyper-Connections) side by side.

Everything works on in-memory single-process models (``lime_megatron.interop.checkpoint_model.load_model``
reads one from a checkpoint of any layout; ``tools/analyze_checkpoint.py`` is the command line):

- ``collect_representations``: runs token sequences ``[n, t]`` through the model with forward hooks
  and keeps, per layer l, the *value states* (the output of W_l^(V), before LIMe's routing; taken
  from megatron's fused QKV projection) and the *hidden states* (the residual stream after layer l;
  with Hyper-Connections its n streams summed (HC) or averaged (mHC), ``residual_stream``);
- ``router_weights`` / ``retrieval_shares``: each layer's R^(l) as ``[kv heads, sources, kv heads]``
  and Fig. 5's normalised mean |weight| of every buffered layer j in layer l, from which the mean
  self-retrieval weight (j = l) and the expected retrieved depth sum_j j * share(l, j) follow;
  for dynamic LIMe ``dynamic_routing``'s prior (the mean per-token weights, v1 Fig. 13) stands for
  R^(l), and it lists the tokens whose weights skip layers most (v1 Table 2's circuits); a run
  with route pruning reports its masked routes (v1 Table 5);
- ``renyi_entropy``: matrix-based Rényi entropy (§5.2) of t representations Z [t, d]:
  S_alpha = log(sum_i (lambda_i(K) / tr K)^alpha) / (1 - alpha), K = Z Z^T, Shannon at alpha = 1;
  ``layer_entropies`` averages it over sequences after standardising each feature over the corpus
  (as the released analysis code does; its default order is alpha = 0.5);
- ``probe_accuracy``: the four-way linear probe (is/are/was/were by default) with 5-fold CV;
- ``tsne_embedding``: 2-D t-SNE of those tokens' representations.

scikit-learn (probe, t-SNE) is the optional ``analysis`` extra: ``pip install -e .[analysis]``.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from lime_megatron.extras import requires_extra
from lime_megatron.models.lime.pruning import pruned_counts

DEFAULT_ALPHA = 0.5
DEFAULT_WORDS = ("is", "are", "was", "were")
KINDS = ("values", "hidden")


# --------------------------------------------------------------------------- representations


@dataclass
class Representations:
    """Per-layer representations of ``tokens`` [n, t]: ``values[l]`` [n, t, kv heads * head dim]
    (W_l^(V) outputs) and ``hidden[l]`` [n, t, hidden] (residual stream after layer l)."""

    tokens: torch.Tensor
    values: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)

    def of(self, kind: str) -> list[torch.Tensor]:
        """``values`` or ``hidden``."""
        if kind not in KINDS:
            raise ValueError(f"unknown representation {kind!r}; choose one of {KINDS}")
        return getattr(self, kind)


def value_states(mixed_qkv: torch.Tensor, config) -> torch.Tensor:
    """The value part of megatron's fused QKV output ``[s, b, kv * (heads/kv + 2) * d]`` (per
    query group: its queries, its key, its value) as ``[b, s, kv * d]``."""
    kv_heads = config.num_query_groups or config.num_attention_heads
    s, b, _ = mixed_qkv.shape
    grouped = mixed_qkv.view(s, b, kv_heads, -1, config.kv_channels)
    return grouped[:, :, :, -1].reshape(s, b, -1).transpose(0, 1)


def residual_stream(
    layer_output: torch.Tensor, folded_streams: int = 0, contract: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """The residual stream after a layer, ``[b, s, hidden]``, from the layer's output ``[s, b, hidden]``;
    with Hyper-Connections (``folded_streams`` n > 0: a layer before the last returns its n streams
    folded into the batch, ``[s, b * n, hidden]``) the streams contracted as the model reads them out
    (``contract`` of ``[.., n, hidden]``, the connection's: the official HC sums them before its final
    norm, mHC averages them; the last layer returns that contraction)."""
    if folded_streams:
        layer_output = contract(layer_output.unflatten(1, (-1, folded_streams)))
    return layer_output.transpose(0, 1)


@torch.no_grad()
def collect_representations(model, tokens: torch.Tensor, batch_size: int = 8, progress: bool = True) -> Representations:
    """Run ``tokens`` [n, t] through ``model`` (a single-process ``LimeGPTModel``) in batches and
    keep every layer's value and hidden states (float32, CPU)."""
    layers = list(model.decoder.layers)
    values: list[list[torch.Tensor]] = [[] for _ in layers]
    hidden: list[list[torch.Tensor]] = [[] for _ in layers]
    handles = []
    for index, layer in enumerate(layers):
        handles.append(
            layer.self_attention.linear_qkv.register_forward_hook(
                lambda _m, _i, out, i=index: values[i].append(value_states(out[0], model.config).float().cpu())
            )
        )
        streams = model.config.hyper_connections if index < len(layers) - 1 else 0
        contract = layer.hc_mlp.contract if streams else None
        handles.append(
            layer.register_forward_hook(
                lambda _m, _i, out, i=index, n=streams, c=contract: hidden[i].append(
                    residual_stream(out[0], n, c).float().cpu()
                )
            )
        )
    try:
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        batches = range(0, tokens.shape[0], batch_size)
        for start in tqdm(batches, desc="forward", disable=not progress):
            stop = start + batch_size
            model(tokens[start:stop], positions[start:stop], None)
    finally:
        for handle in handles:
            handle.remove()
    return Representations(tokens, [torch.cat(v) for v in values], [torch.cat(h) for h in hidden])


# --------------------------------------------------------------------------- routers


def router_weights(model) -> dict[int, tuple[list[int], torch.Tensor]]:
    """``{layer: (source layers, weights [kv out, sources, kv in])}`` for every LIMe layer (fixed
    routers included: layer 0's identity, the ``average`` variant); empty for the baseline."""
    weights = {}
    for router in model.routers():
        kv = router.weight.shape[0]
        weights[router.layer] = (
            list(router.sources),
            router.weight.detach().float().cpu().view(kv, len(router.sources), kv),
        )
    return weights


def dynamic_routing(
    model, tokens: torch.Tensor, batch_size: int = 8, examples: int = 20, min_gap: int = 2, progress: bool = True
) -> tuple[dict[int, tuple[list[int], torch.Tensor]], list[dict]]:
    """Dynamic LIMe's routing over ``tokens`` [n, t] (v1 §5.2): ``(prior, circuits)``.

    ``prior``: v1 Fig. 13's dynamic prior, the mean over tokens of p_l(t)[h, j], written as the
    mean routing matrix ``[kv out, sources, kv in]`` (head h reads head h only: diagonal in the
    heads), so ``retrieval_shares`` and the plots read it like a static router; layer 0's identity
    included.  ``circuits``: v1 Table 2's examples, the ``examples`` largest weights a layer l puts
    on a source j <= l - ``min_gap`` (a representation skipping layers), each ``{"sequence",
    "position", "token", "layer" (L, the querying layer), "source" (R), "head" (H), "weight"}``."""
    routers = {module.layer: module for module in model.modules() if getattr(module, "dynamic", False)}
    kv = model.config.kv_heads
    sums = {layer: torch.zeros(kv, layer + 1, dtype=torch.float64) for layer in routers}
    found: list[tuple[float, int, int, int, int, int]] = []
    offset = [0]

    def record(router, _inputs, probs):
        weights = probs.detach().double().cpu()  # [s, b, kv, l + 1]
        sums[router.layer] += weights.sum(dim=(0, 1))
        reach = router.layer - min_gap + 1
        if reach > 0:
            best, source = weights[..., :reach].max(dim=-1)
            top = best.flatten().topk(min(examples, best.numel()))
            for value, flat in zip(top.values.tolist(), top.indices.tolist()):
                position, row, head = np.unravel_index(flat, best.shape)
                found.append(
                    (
                        value,
                        offset[0] + int(row),
                        int(position),
                        router.layer,
                        int(source[position, row, head]),
                        int(head),
                    )
                )

    handles = [router.register_forward_hook(record) for router in routers.values()]
    try:
        positions = torch.arange(tokens.shape[1]).expand(tokens.shape[0], -1)
        for start in tqdm(range(0, tokens.shape[0], batch_size), desc="dynamic routing", disable=not progress):
            offset[0] = start
            model(tokens[start : start + batch_size], positions[start : start + batch_size], None)
    finally:
        for handle in handles:
            handle.remove()
    count = tokens.numel()
    prior = {0: ([0], torch.eye(kv).view(kv, 1, kv))}
    for layer, total in sums.items():
        mean = (total / count).float()  # [kv, l + 1]
        prior[layer] = (list(range(layer + 1)), torch.diag_embed(mean.t()).permute(1, 0, 2))
    circuits = [
        dict(
            weight=value,
            sequence=row,
            position=position,
            token=int(tokens[row, position]),
            layer=layer,
            source=source,
            head=head,
        )
        for value, row, position, layer, source, head in sorted(found, reverse=True)[:examples]
    ]
    return dict(sorted(prior.items())), circuits


def retrieval_shares(weights: dict[int, tuple[list[int], torch.Tensor]], num_layers: int) -> np.ndarray:
    """Fig. 5: ``[L, L]``, row l = mean |R^(l)| over heads for each buffered layer j, normalised
    to sum 1 over j (0 where layer l does not read j)."""
    shares = np.zeros((num_layers, num_layers))
    for layer, (sources, weight) in weights.items():
        magnitude = weight.abs().mean(dim=(0, 2)).numpy()
        shares[layer, sources] = magnitude / magnitude.sum()
    return shares


def self_retrieval(shares: np.ndarray) -> np.ndarray:
    """Share of each layer's own keys/values (the diagonal of ``retrieval_shares``)."""
    return np.diag(shares).copy()


def expected_depth(shares: np.ndarray) -> np.ndarray:
    """Expected retrieved layer sum_j j * share(l, j) for each layer l (0-based)."""
    return shares @ np.arange(shares.shape[1])


# --------------------------------------------------------------------------- entropy


def renyi_entropy(z: torch.Tensor, alpha: float = DEFAULT_ALPHA) -> float:
    """Matrix-based Rényi entropy of order ``alpha`` of the rows of ``z`` [t, d] (module
    docstring); 0 for identical rows, log t for orthonormal rows."""
    if alpha <= 0:
        raise ValueError(f"the Rényi order alpha must be > 0, got {alpha}")
    z = z.to(torch.float64)
    gram = z @ z.T
    eigenvalues = torch.linalg.eigvalsh(gram)
    # Round-off below the numerical rank (as torch.linalg.matrix_rank) would count as mass for alpha < 1.
    cutoff = eigenvalues.max() * gram.shape[0] * torch.finfo(gram.dtype).eps
    eigenvalues = torch.where(eigenvalues > cutoff, eigenvalues, torch.zeros_like(eigenvalues))
    p = eigenvalues / eigenvalues.sum()
    if math.isclose(alpha, 1.0):
        p = p[p > 0]
        return float(-(p * p.log()).sum())
    return float(torch.log((p**alpha).sum()) / (1 - alpha))


def layer_entropies(
    layers: list[torch.Tensor], alpha: float = DEFAULT_ALPHA, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray]:
    """(mean, std) over sequences of ``renyi_entropy`` per layer; ``layers[l]`` is [n, t, d],
    each feature standardised over all n * t tokens of the layer first."""
    means, stds = [], []
    for states in layers:
        flat = states.to(torch.float64).reshape(-1, states.shape[-1])
        standard = (states.to(torch.float64) - flat.mean(0)) / (flat.std(0) + eps)
        entropies = [renyi_entropy(sequence, alpha) for sequence in standard]
        means.append(np.mean(entropies))
        stds.append(np.std(entropies))
    return np.array(means), np.array(stds)


# --------------------------------------------------------------------------- separability


def word_token_ids(tokenizer, words) -> dict[str, list[int]]:
    """For each word, the ids of its single-token spellings (``word`` and `` word``).  Raises
    ``ValueError`` naming a word the tokenizer has no single token for."""
    ids = {}
    for word in words:
        found = sorted({tuple(tokenizer.tokenize(text)) for text in (word, f" {word}")})
        singles = [pieces[0] for pieces in found if len(pieces) == 1]
        if not singles:
            raise ValueError(f"the tokenizer has no single token for {word!r} (pieces: {found})")
        ids[word] = sorted(set(singles))
    return ids


def word_occurrences(
    tokens: torch.Tensor, ids: dict[str, list[int]], limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    """Positions (sequence index, token index) of every occurrence of each word in ``tokens``
    [n, t], with the word's class label; at most ``limit`` per word (the paper balances them)."""
    rows, cols, labels = [], [], []
    for label, word_ids in enumerate(ids.values()):
        mask = torch.isin(tokens, torch.tensor(word_ids))
        seq, pos = mask.nonzero(as_tuple=True)
        seq, pos = seq[:limit], pos[:limit]
        rows.append(seq)
        cols.append(pos)
        labels.append(np.full(len(seq), label))
    return torch.cat(rows), torch.cat(cols), np.concatenate(labels)


def probe_accuracy(features: np.ndarray, labels: np.ndarray, folds: int = 5, seed: int = 0) -> tuple[float, float]:
    """(mean, std) test accuracy of a linear classifier (standardised features, multinomial
    logistic regression) over ``folds``-fold stratified cross-validation."""
    with requires_extra("analysis"):
        from sklearn.linear_model import LogisticRegression
        from sklearn.model_selection import StratifiedKFold, cross_val_score
        from sklearn.pipeline import make_pipeline
        from sklearn.preprocessing import StandardScaler

    counts = np.bincount(labels)
    if np.count_nonzero(counts) < 2:
        raise ValueError(f"the probe needs examples of at least 2 classes, got counts {counts.tolist()}")
    if np.min(counts[counts > 0]) < folds:
        raise ValueError(f"every class needs >= {folds} examples for {folds}-fold CV, got {counts.tolist()}")
    classifier = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    splits = StratifiedKFold(n_splits=folds, shuffle=True, random_state=seed)
    scores = cross_val_score(classifier, features, labels, cv=splits)
    return float(scores.mean()), float(scores.std())


def tsne_embedding(features: np.ndarray, seed: int = 0, iterations: int = 1000) -> np.ndarray:
    """2-D t-SNE of ``features`` [n, d] (perplexity capped for small n)."""
    with requires_extra("analysis"):
        from sklearn.manifold import TSNE

    perplexity = min(30.0, max(2.0, (len(features) - 1) / 3))
    tsne = TSNE(n_components=2, perplexity=perplexity, init="pca", random_state=seed, max_iter=iterations)
    return tsne.fit_transform(features)


# --------------------------------------------------------------------------- the whole analysis


@dataclass
class AnalysisOptions:
    """What ``analyze`` computes."""

    alpha: float = DEFAULT_ALPHA
    words: tuple[str, ...] = DEFAULT_WORDS
    per_word: int | None = None
    """At most this many occurrences per word (None: all)."""
    tsne_layers: tuple[int, ...] | None = None
    """0-based layers for t-SNE (None: first, middle, last)."""
    tsne_iterations: int = 1000
    folds: int = 5
    seed: int = 0


def analyze(
    models: dict, tokens: torch.Tensor, tokenizer, out_dir: str, options: AnalysisOptions | None = None
) -> dict:
    """Run every analysis on ``models`` ({name: single-process model}, e.g. LIMe and LLaMA) over
    ``tokens`` [n, t]; write PNG plots and ``analysis.json`` to ``out_dir``; return the numbers."""
    from lime_megatron.analysis import plots

    options = options or AnalysisOptions()
    os.makedirs(out_dir, exist_ok=True)
    ids = word_token_ids(tokenizer, options.words) if tokenizer is not None else None
    occurrences = word_occurrences(tokens, ids, options.per_word) if ids else None
    results: dict = {"words": ids, "alpha": options.alpha, "models": {}}
    embeddings: dict = {}
    for name, model in models.items():
        numbers, embeddings[name] = _analyze_model(model, tokens, occurrences, options)
        results["models"][name] = numbers
    plots.write_all(results, embeddings, out_dir)
    with open(os.path.join(out_dir, "analysis.json"), "w", encoding="utf-8") as file:
        json.dump(results, file, indent=1)
    return results


def _analyze_model(model, tokens, occurrences, options: AnalysisOptions) -> tuple[dict, dict]:
    """The numbers of one model (``seconds``: time per analysis) and its t-SNE embeddings
    ``{(kind, layer): (points, labels)}``."""
    num_layers = model.config.num_layers
    seconds: dict[str, float] = {}
    numbers: dict = {"num_layers": num_layers, "seconds": seconds}
    with _timed(seconds, "router"):
        dynamic = model.config.lime and model.config.lime_router == "dynamic"
        if dynamic:  # the dynamic prior stands for the weights (v1 Fig. 13)
            weights, numbers["circuits"] = dynamic_routing(model, tokens)
        else:
            weights = router_weights(model)
        if weights:
            shares = retrieval_shares(weights, num_layers)
            numbers["router"] = {
                "weights": {
                    str(layer): {"sources": sources, "weight": w.tolist()} for layer, (sources, w) in weights.items()
                },
                "shares": shares.tolist(),
                "self_retrieval": self_retrieval(shares).tolist(),
                "expected_depth": expected_depth(shares).tolist(),
            }
        if model.config.lime and model.config.lime_prune_top_p is not None:  # v1 Table 5's columns
            counts = pruned_counts([model])
            numbers["pruning"] = {
                "top_p": model.config.lime_prune_top_p,
                **counts._asdict(),
                "share": counts.masked / counts.routes,
                "v1_share": counts.v1_masked / counts.v1_routes,
            }
    with _timed(seconds, "forward"):
        reps = collect_representations(model, tokens)
    embeddings = {}
    tsne_layers = options.tsne_layers or sorted({0, num_layers // 2, num_layers - 1})
    for kind in KINDS:
        with _timed(seconds, "entropy"):
            mean, std = layer_entropies(reps.of(kind), options.alpha)
        numbers[f"entropy_{kind}"] = {"mean": mean.tolist(), "std": std.tolist()}
        if occurrences is None:
            continue
        rows, cols, labels = occurrences
        with _timed(seconds, "probe"):
            accuracies = [
                probe_accuracy(states[rows, cols].numpy(), labels, options.folds, options.seed)
                for states in tqdm(reps.of(kind), desc=f"probe {kind}")
            ]
        numbers[f"probe_{kind}"] = {"mean": [a[0] for a in accuracies], "std": [a[1] for a in accuracies]}
        with _timed(seconds, "tsne"):
            for layer in tsne_layers:
                points = tsne_embedding(reps.of(kind)[layer][rows, cols].numpy(), options.seed, options.tsne_iterations)
                embeddings[(kind, layer)] = (points, labels)
    return numbers, embeddings


@contextlib.contextmanager
def _timed(seconds: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time to ``seconds[key]``."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - start
