"""lm-evaluation-harness on a megatron checkpoint, without conversion: ``--model lime_megatron``.

    python tools/evaluate.py --model lime_megatron --model_args checkpoint=ckpt/lime-1b \\
        --tasks arc_easy --num_fewshot 3 --batch_size 16
    torchrun --nproc-per-node 8 tools/evaluate.py --model lime_megatron ...   # data parallel

(``tools/evaluate.py`` is lm-eval's own command line with this adapter registered.)
``LimeMegatronLM`` loads the checkpoint at any layout into one process
(``lime_megatron.interop.checkpoint_model``) with the tokenizer it was trained with and answers lm-eval's
three request types on the megatron model:

- ``loglikelihood(context, continuation)``: sum of the continuation tokens' log-probabilities
  (over the unpadded vocabulary) in one causal forward of context + continuation (the context
  cut from the left to the model's length), and whether greedy decoding would produce them;
- ``loglikelihood_rolling(text)``: the text's log-likelihood from lm-eval's disjoint rolling
  windows of the model's length (first token conditioned on the end-of-document token);
- ``generate_until(context, gen_kwargs)``: ``lime_megatron.inference.generation`` with the KV cache
  (``until`` stop strings, ``max_gen_toks``, ``do_sample``/``temperature``/``top_k``/``top_p``).

Requests are scored in batches of ``batch_size`` sequences, longest first (right padding never
reaches a scored position in a causal forward).

Data parallel under ``torchrun``: every rank loads the whole model (TP=1, on the GPU
``LOCAL_RANK``) and reports ``rank``/``world_size`` from torch.distributed; lm-eval's evaluator
gives rank r every N-th document from r, pads the ranks' request lists to equal length with
:meth:`LimeMegatronLM.all_gather` (its ``[N]`` tensor of counts) and collects the per-document
metrics on rank 0 with :meth:`LimeMegatronLM.gather_object`; only rank 0 returns results.
"""

from __future__ import annotations

import torch
from tqdm import tqdm

from lime_megatron.extras import requires_extra
from lime_megatron.inference.decoding import full_logits
from lime_megatron.inference.generation import DTYPES, Generator, SamplingOptions
from lime_megatron.interop.checkpoint_model import load_model
from lime_megatron.models.gpt_model import LimeGPTModel

with requires_extra("eval"):  # this module is the adapter: importing it is what needs lm-eval
    from lm_eval import utils as lm_eval_utils
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model


@register_model("lime_megatron")
class LimeMegatronLM(LM):
    """lm-eval ``LM`` over a LIMe/baseline megatron model (see the module docstring).

    Args (``--model_args`` for the command line):
        checkpoint: a ``--save`` root or one ``iter_NNNNNNN`` directory;
        dtype: weights' dtype (default: as trained);
        max_length: context length (default: the run's ``--seq-length``);
        max_gen_toks: default new-token limit of ``generate_until``.
        batch_size: sequences per forward (lm-eval's ``--batch_size``; ``auto`` means 8).
        model, tokenizer: an already built model and tokenizer instead of a checkpoint.
    """

    def __init__(
        self,
        checkpoint: str | None = None,
        *,
        dtype: str | None = None,
        batch_size: int | str = 8,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        model: LimeGPTModel | None = None,
        tokenizer=None,
        **_ignored,
    ):
        super().__init__()
        if model is None:
            if checkpoint is None:
                raise ValueError("lime_megatron needs model_args checkpoint=PATH (a --save root or iter_ directory)")
            if dtype is not None and dtype not in DTYPES:
                raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
            loaded = load_model(checkpoint, dtype=DTYPES.get(dtype))
            model, tokenizer = loaded.model, loaded.tokenizer()
            max_length = max_length or loaded.options.model.seq_length
        if tokenizer is None or not hasattr(tokenizer, "tokenize"):
            raise ValueError("lime_megatron needs a text tokenizer (the checkpoint was trained with --vocab-size only)")
        self.model, self.tokenizer = model.eval(), tokenizer
        self.batch_size = int(batch_size) if str(batch_size).isdigit() else 8
        self.max_length = int(max_length or model.max_sequence_length)
        self.max_gen_toks = int(max_gen_toks)
        self.vocab_size = tokenizer.unpadded_vocab_size
        self._device = next(model.parameters()).device
        if torch.distributed.is_initialized():
            self._rank, self._world_size = torch.distributed.get_rank(), torch.distributed.get_world_size()

    # --------------------------------------------------------------------------- scoring
    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context (the end-of-document token when empty) and continuation."""
        context_ids = self.tokenizer.tokenize(context) if context else [self.tokenizer.eod]
        return context_ids, self.tokenizer.tokenize(continuation)

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]], progress: str | None = None) -> list[tuple[float, bool]]:
        """``(sum of log p(continuation | context), all greedy)`` per (context ids, continuation
        ids) pair, in batches of ``batch_size`` sorted longest first."""
        windows = [(context + continuation)[-(self.max_length + 1) :][:-1] for context, continuation in pairs]
        order = sorted(range(len(pairs)), key=lambda index: -len(windows[index]))
        results: list[tuple[float, bool] | None] = [None] * len(pairs)
        device = next(self.model.parameters()).device
        for start in tqdm(range(0, len(order), self.batch_size), desc=progress, disable=progress is None):
            chunk = order[start : start + self.batch_size]
            tokens = torch.zeros(len(chunk), len(windows[chunk[0]]), dtype=torch.long, device=device)
            for row, index in enumerate(chunk):
                tokens[row, : len(windows[index])] = torch.tensor(windows[index])
            log_probs = full_logits(self.model, tokens)[..., : self.vocab_size].double().log_softmax(dim=-1)
            for row, index in enumerate(chunk):
                continuation = torch.tensor(pairs[index][1], device=device)
                end = len(windows[index])
                scored = log_probs[row, end - len(continuation) : end]
                results[index] = (
                    float(scored.gather(1, continuation[:, None]).sum()),
                    bool((scored.argmax(dim=-1) == continuation).all()),
                )
        return results

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._encode_pair(*request.args) for request in requests]
        results = self._score(pairs, None if disable_tqdm else "loglikelihood")
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", request.args, result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        per_request, pairs = [], []
        for request in requests:
            windows = [
                lm_eval_utils.make_disjoint_window(window)
                for window in lm_eval_utils.get_rolling_token_windows(
                    self.tokenizer.tokenize(request.args[0]), self.tokenizer.eod, self.max_length, 1
                )
            ]
            per_request.append(len(windows))
            pairs.extend(windows)
        scores = iter(self._score(pairs, None if disable_tqdm else "loglikelihood_rolling"))
        results = [sum(next(scores)[0] for _ in range(count)) for count in per_request]
        for request, result in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, result)
        return results

    # --------------------------------------------------------------------------- generation
    def _sampling_options(self, gen_kwargs: dict) -> SamplingOptions:
        """lm-eval's generation keywords as ``SamplingOptions``."""
        until = gen_kwargs.get("until") or []
        sampled = gen_kwargs.get("do_sample", False) or gen_kwargs.get("temperature", 0) > 0
        return SamplingOptions(
            max_new_tokens=int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)),
            temperature=float(gen_kwargs.get("temperature", 1.0) or 1.0) if sampled else 0.0,
            top_k=int(gen_kwargs.get("top_k") or 0),
            top_p=float(gen_kwargs.get("top_p") or 1.0),
            seed=int(gen_kwargs.get("seed", 0)),
            stop_strings=tuple([until] if isinstance(until, str) else until),
        )

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        generator = Generator(self.model, self.tokenizer)
        results: list[str | None] = [None] * len(requests)
        groups: dict[str, list[int]] = {}
        for index, request in enumerate(requests):
            groups.setdefault(repr(sorted(request.args[1].items())), []).append(index)
        progress = tqdm(total=len(requests), desc="generate_until", disable=disable_tqdm)
        for indices in groups.values():
            options = self._sampling_options(requests[indices[0]].args[1])
            keep = max(1, self.max_length - options.max_new_tokens)
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start : start + self.batch_size]
                prompts = [self._encode_pair(requests[index].args[0], "")[0][-keep:] for index in chunk]
                for index, text in zip(chunk, generator.generate(prompts, options).texts):
                    results[index] = text
                    self.cache_hook.add_partial("generate_until", requests[index].args, text)
                progress.update(len(chunk))
        progress.close()
        return results

    # --------------------------------------------------------------------------- data parallel
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        torch.distributed.all_gather(parts, tensor)
        return torch.cat([part.reshape(-1) for part in parts])

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        gathered = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            torch.distributed.barrier()
