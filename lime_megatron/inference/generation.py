"""Text generation from a LIMe or baseline model: greedy and sampled decoding with a KV cache.

    generator = Generator(model, tokenizer)
    result = generator.generate(["2+3="], SamplingOptions(max_new_tokens=8, stop_strings=("\\n",)))
    result.texts, result.tokens_per_second

A batch of prompts of different lengths is decoded as megatron's static engine does (see
``lime_megatron.inference.decoding``): the shortest prompt's length is prefilled at once, then one position
per step for the whole batch; a sequence whose prompt is longer takes its prompt token at that
position instead of the sampled one.  ``use_cache=False`` recomputes the full sequence for every
token (the reference the cache is tested and benchmarked against).

Sampling (``temperature > 0``) draws from ``softmax(logits / temperature)`` restricted to the
``top_k`` most likely tokens and to the smallest set whose probability reaches ``top_p``, with a
``torch.Generator`` seeded by ``seed``: the same prompts, options and seed give the same tokens.
A sequence stops after ``max_new_tokens`` tokens, at the end-of-document token (not included) or
once its text contains a stop string (the text is cut before it).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from lime_megatron.inference.decoding import decode_step, full_logits, kv_cache_context
from lime_megatron.models.gpt_model import LimeGPTModel

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}
"""Weight dtypes a checkpoint may be read in, by name (``tools/generate.py --dtype``, lm-eval's ``dtype``)."""


@dataclass(frozen=True)
class SamplingOptions:
    """How to pick each new token and when a sequence stops."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    """0 is greedy (argmax)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability sum reaches top_p."""
    seed: int = 0
    stop_strings: tuple[str, ...] = ()
    stop_at_eod: bool = True

    def __post_init__(self):
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass
class Generation:
    """New tokens (and texts, with a tokenizer) per prompt, why each stopped, and the time taken."""

    tokens: list[list[int]]
    stopped_by: list[str]
    """``length``, ``eod`` or ``stop string`` per prompt."""
    seconds: float
    texts: list[str] | None = None
    prompt_tokens: list[list[int]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        """Tokens generated over all prompts."""
        return sum(len(tokens) for tokens in self.tokens)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of wall time (prefill included)."""
        return self.new_tokens / self.seconds if self.seconds > 0 else float("inf")


def sample_next(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator) -> torch.Tensor:
    """Next token ids ``[b]`` from the last position's logits ``[b, vocab]`` (see module docstring)."""
    if options.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.double() / options.temperature
    if 0 < options.top_k < logits.shape[-1]:
        kth = logits.topk(options.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if options.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        before = ordered.softmax(dim=-1).cumsum(dim=-1) - ordered.softmax(dim=-1)
        drop = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, order, before >= options.top_p)
        logits = logits.masked_fill(drop, float("-inf"))
    probabilities = logits.softmax(dim=-1).cpu()
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(1).to(logits.device)


class Generator:
    """Decodes batches of prompts with ``model`` (eval mode): one process, or every rank of a
    tensor-parallel model (``checkpoint_model.load_model(..., tensor_parallel=N)``) with the same
    prompts and options, which then takes the same tokens on every rank (the logits are gathered
    over the vocabulary shards, the sampler is seeded alike).

    Args:
        tokenizer: ``lime_megatron.data.tokenizer`` tokenizer (text prompts, stop strings, texts);
            without one, prompts are token id lists and only ``eod``/lengths stop.
        vocab_size: ids a token may take (default: the tokenizer's unpadded vocabulary, else all
            the model's logits); the padded vocabulary's extra ids are never generated.
        use_cache: KV-cache decoding (default) or recomputing the full sequence per token.
    """

    def __init__(
        self,
        model: LimeGPTModel,
        tokenizer=None,
        *,
        vocab_size: int | None = None,
        eod: int | None = None,
        use_cache: bool = True,
    ):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size or getattr(tokenizer, "unpadded_vocab_size", None)
        self.eod = eod if eod is not None else getattr(tokenizer, "eod", None)
        self.use_cache = use_cache

    def encode(self, prompts: list[str] | list[list[int]]) -> list[list[int]]:
        """Token ids of each prompt (texts need the tokenizer)."""
        encoded = []
        for prompt in prompts:
            if isinstance(prompt, str):
                if self.tokenizer is None:
                    raise ValueError("text prompts need a tokenizer; pass token id lists instead")
                prompt = self.tokenizer.tokenize(prompt)
            if not prompt:
                raise ValueError("an empty prompt cannot be continued: give it at least one token")
            encoded.append([int(token) for token in prompt])
        return encoded

    @torch.no_grad()
    def generate(self, prompts: list[str] | list[list[int]], options: SamplingOptions) -> Generation:
        """Continue every prompt (see the module docstring)."""
        prompts = self.encode(prompts)
        if options.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        started = time.perf_counter()
        lengths = [len(prompt) for prompt in prompts]
        total = max(lengths) + options.max_new_tokens
        device = next(self.model.parameters()).device
        sequence = torch.zeros(len(prompts), total, dtype=torch.long, device=device)
        for row, prompt in enumerate(prompts):
            sequence[row, : len(prompt)] = torch.tensor(prompt)
        state = _Stopping(prompts, options, self.tokenizer, self.eod)
        generator = torch.Generator().manual_seed(options.seed)
        forward = self._forward(len(prompts), total)
        position = min(lengths)
        logits = forward(sequence, 0, position)
        while position < total and not state.all_done:
            chosen = sample_next(logits[:, -1, : self.vocab_size], options, generator)
            for row in range(len(prompts)):
                if position >= lengths[row]:
                    sequence[row, position] = state.take(row, int(chosen[row]))
            position += 1
            if position < total and not state.all_done:
                logits = forward(sequence, position - 1, position)
        return Generation(
            state.tokens,
            state.stopped_by,
            time.perf_counter() - started,
            state.texts() if self.tokenizer is not None else None,
            prompts,
        )

    def _forward(self, batch: int, total: int):
        """``forward(sequence, start, stop)`` -> logits ``[b, >=1, vocab]`` whose last row
        predicts position ``stop``, given that positions before ``start`` were fed already."""
        if not self.use_cache:
            return lambda sequence, start, stop: full_logits(self.model, sequence[:, :stop])
        context = kv_cache_context(self.model, batch, total)
        return lambda sequence, start, stop: decode_step(self.model, context, sequence[:, start:stop])


class _Stopping:
    """Per-sequence generated tokens and stop bookkeeping of one ``generate`` call."""

    def __init__(self, prompts, options: SamplingOptions, tokenizer, eod: int | None):
        self.options, self.tokenizer, self.eod = options, tokenizer, eod
        self.tokens: list[list[int]] = [[] for _ in prompts]
        self.stopped_by: list[str | None] = [None] * len(prompts)
        self.cuts: list[int | None] = [None] * len(prompts)

    @property
    def all_done(self) -> bool:
        return all(reason is not None for reason in self.stopped_by)

    def take(self, row: int, token: int) -> int:
        """Record ``token`` as row ``row``'s next token unless it stopped; returns the token
        fed to the model (0 after the stop, never read by an unstopped row)."""
        if self.stopped_by[row] is not None:
            return 0
        if self.options.stop_at_eod and token == self.eod:
            self.stopped_by[row] = "eod"
            return token
        self.tokens[row].append(token)
        cut = self._stop_string_cut(row)
        if cut is not None:
            self.stopped_by[row], self.cuts[row] = "stop string", cut
        elif len(self.tokens[row]) == self.options.max_new_tokens:
            self.stopped_by[row] = "length"
        return token

    def _stop_string_cut(self, row: int) -> int | None:
        """Index in row ``row``'s text where its first stop string starts, if any."""
        if not self.options.stop_strings:
            return None
        text = self.tokenizer.detokenize(self.tokens[row])
        found = [text.find(stop) for stop in self.options.stop_strings if stop in text]
        return min(found) if found else None

    def texts(self) -> list[str]:
        """The generated text of each row, cut before its stop string."""
        return [self.tokenizer.detokenize(tokens)[:cut] for tokens, cut in zip(self.tokens, self.cuts)]
