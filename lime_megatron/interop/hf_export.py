"""Hugging Face directories from distributed checkpoints, and back.

``export_checkpoint`` reads a checkpoint of any layout into one process
(``checkpoint_model.load_model``) and writes a Hugging Face directory::

    config.json                 LlamaConfig fields (+ "lime_config" and "lime_megatron", below)
    generation_config.json      begin/end of text and padding = the end-of-document token (EOD);
                                the padded vocabulary's ids suppressed
    model.safetensors           or model-0000k-of-0000n.safetensors + model.safetensors.index.json
    tokenizer.json              the run's tokenizer putting EOD before every text, as training did
    tokenizer_config.json       (``lime_megatron.interop.hf_tokenizer``); beside them the files the
    tokenizer files             import reads: vocab.json + merges.txt (GPT-2 BPE), run_tokenizer/
                                (Hugging Face) or tokenizer.model (SentencePiece); none for mock data

Training packs documents each followed by EOD, so the model always sees EOD before a document,
and our decoding prompts with ``[EOD, *tokenize(prompt)]`` (``inference.scoring``,
``tools/generate.py``).  The export does the same in transformers:
``AutoTokenizer.from_pretrained(dir)(text)`` gives ``[EOD, *our tokenize(text)]``, EOD is the BOS
token of the tokenizer and config.json, and ``generate`` stops at EOD (``eos_token_id``).

The LLaMA baseline loads as transformers' ``LlamaForCausalLM``; LIMe and Hyper-Connections are
written in the layouts of the paper's official ``LIMeForCausalLM`` and ``LlamaHCForCausalLM``
(``architectures``; tensor names and layouts in ``lime_megatron.interop.hf_layout``; the official
``HCConfig`` as ``hc_config``: ``rate`` n and ``dynamic``).  ``import_checkpoint`` reads such a
directory (ours, or one written by transformers / the official code) into a weights-only checkpoint that
``pretrain_lime.py --load DIR --no-load-optim`` starts from at any layout.

Vocabulary padding: the padded rows are exported (``vocab_size`` = megatron's padded vocabulary;
the padded logits exist in both, so logits agree row for row and round trips are bit-exact); the
tokenizer's own size and the padding multiple go to ``config.json["lime_megatron"]`` with the
router variant, so an import restores the same run description.  The norm epsilon, RoPE base and
tied embeddings are the standard ``rms_norm_eps``, ``rope_theta`` (also as transformers 5's
``rope_parameters``) and ``tie_word_embeddings``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm import tqdm

from lime_megatron.extras import requires_extra
from lime_megatron.interop.checkpoint_model import load_model, new_model, save_model
from lime_megatron.interop.hf_layout import (
    DYNAMIC_LIME_ARCHITECTURE,
    HC_ARCHITECTURE,
    HYPER_CONNECTION_TENSORS,
    LIME_ARCHITECTURE,
    LLAMA_ARCHITECTURE,
    LayoutError,
    ModelShape,
    from_hf_tensors,
    to_hf_tensors,
)
from lime_megatron.interop.hf_tokenizer import RUN_TOKENIZER, exported_tokenizer, write_tokenizer
from lime_megatron.models.lime.dynamic_router import OWN_WEIGHT_AT_INIT
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.training import arguments, checkpointing, data

EXTRA = "lime_megatron"
"""config.json key of what Hugging Face's fields cannot say (vocabulary padding, router variant)."""
FORMAT_VERSION = 1
SHARD_BYTES = 4 * 2**30
"""Default largest safetensors file; bigger models are split with an index (transformers' format)."""
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
GENERATION_CONFIG = "generation_config.json"
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float64: "float64"}


class ConversionError(checkpointing.CheckpointError):
    """A Hugging Face directory or config that cannot be converted (the message says why)."""


@dataclass
class Description:
    """A model as config.json describes it: shape, RoPE, norm, vocabulary and tokenizer."""

    shape: ModelShape
    rope_base: int
    norm_epsilon: float
    max_positions: int
    unpadded_vocab_size: int
    divisible_by: int | None = None
    """Vocabulary padding multiple; None: derived on import from the sizes."""
    eos_token_id: int | None = None
    pad_token_id: int | None = None
    tokenizer_type: str | None = None
    router_lr: float | None = None
    init_std: float = 0.02

    @classmethod
    def of_run(cls, run: dict, shape: ModelShape, tokenizer) -> Description:
        """What a checkpoint's run description ``run`` says about its model."""
        args = run["args"]
        pad = getattr(tokenizer, "pad", None)
        return cls(
            shape,
            args["rotary_base"],
            args["norm_epsilon"],
            args["max_position_embeddings"] or args["seq_length"],
            run["vocab"]["size"],
            args["make_vocab_size_divisible_by"],
            tokenizer.eod,
            pad if pad is not None and 0 <= pad < shape.vocab_size else None,
            None if args["vocab_size"] is not None else args["tokenizer_type"],
            args.get("lime_router_lr") if shape.lime else None,
            args["init_method_std"],
        )

    def config_json(self, dtype: torch.dtype) -> dict:
        """config.json: transformers' LlamaConfig fields, the official ``lime_config`` and ours."""
        shape = self.shape
        config: dict[str, Any] = dict(
            architectures=[shape.architecture],
            model_type="llama",
            vocab_size=shape.vocab_size,
            hidden_size=shape.hidden_size,
            intermediate_size=shape.ffn_hidden_size,
            num_hidden_layers=shape.num_layers,
            num_attention_heads=shape.num_attention_heads,
            num_key_value_heads=shape.kv_heads,
            head_dim=shape.head_dim,
            hidden_act="silu",
            max_position_embeddings=self.max_positions,
            rms_norm_eps=self.norm_epsilon,
            rope_theta=self.rope_base,
            rope_parameters=dict(rope_type="default", rope_theta=self.rope_base),
            tie_word_embeddings=shape.tied,
            attention_bias=False,
            attention_dropout=0.0,
            mlp_bias=False,
            initializer_range=self.init_std,
            bos_token_id=self.eos_token_id,  # EOD precedes every training document
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            use_cache=not shape.lime,
            torch_dtype=DTYPE_NAMES[dtype],
        )
        if shape.lime:
            config["lime_config"] = dict(router_lr=self.router_lr)
        if shape.hyper_connections:
            config["hc_config"] = dict(rate=shape.hyper_connections, dynamic=not shape.hyper_connections_static)
        config[EXTRA] = dict(
            format_version=FORMAT_VERSION,
            unpadded_vocab_size=self.unpadded_vocab_size,
            make_vocab_size_divisible_by=self.divisible_by,
            tokenizer_type=self.tokenizer_type,
            lime_router=shape.router,
            lime_router_window=shape.router_window,
            lime_prune_top_p=shape.prune_top_p,
        )
        if shape.dynamic_router:
            config[EXTRA]["lime_dynamic_own_weight"] = OWN_WEIGHT_AT_INIT
        return config

    def generation_config_json(self) -> dict:
        """generation_config.json: a text starts after EOD and generation stops at it, padding is
        the run's pad token (else EOD), and the padded vocabulary's ids, which no tokenizer
        produces and our decoding never picks, are suppressed."""
        padding = range(self.unpadded_vocab_size, self.shape.vocab_size)
        config: dict[str, Any] = dict(
            bos_token_id=self.eos_token_id,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.eos_token_id if self.pad_token_id is None else self.pad_token_id,
        )
        if padding:
            config["suppress_tokens"] = list(padding)
        return config

    @classmethod
    def of_config(cls, config: dict, tensor_shapes: dict[str, torch.Size]) -> Description:
        """Read config.json (ours, transformers' or the official code's); the tensors' names and
        shapes (``tensor_shapes``) tell LIMe, Hyper-Connections and LLaMA apart when
        ``architectures`` is absent (the official code saves a bare LlamaConfig), and give n and
        the variant when ``hc_config`` is."""
        architecture = _architecture(config, set(tensor_shapes))
        lime = architecture in (LIME_ARCHITECTURE, DYNAMIC_LIME_ARCHITECTURE)
        streams, static = _hyper_connections(config, tensor_shapes) if architecture == HC_ARCHITECTURE else (0, False)
        extra = config.get(EXTRA) or {}
        for name, allowed in (("hidden_act", ("silu",)), ("attention_bias", (False,)), ("mlp_bias", (False,))):
            if config.get(name, allowed[0]) not in allowed:
                raise ConversionError(
                    f"config.json: {name}={config[name]!r} is not supported (LLaMA uses {allowed[0]})"
                )
        heads, hidden = _required(config, "num_attention_heads"), _required(config, "hidden_size")
        router = (
            "dynamic"
            if architecture == DYNAMIC_LIME_ARCHITECTURE
            else extra.get("lime_router") or "full"
            if lime
            else None
        )
        if router == "dynamic" and extra.get("lime_dynamic_own_weight", OWN_WEIGHT_AT_INIT) != OWN_WEIGHT_AT_INIT:
            raise ConversionError(
                f"config.json: lime_dynamic_own_weight={extra['lime_dynamic_own_weight']} is not "
                f"supported (the dynamic router's own-layer offset is fixed at {OWN_WEIGHT_AT_INIT})"
            )
        shape = ModelShape(
            _required(config, "num_hidden_layers"),
            hidden,
            _required(config, "intermediate_size"),
            heads,
            config.get("num_key_value_heads") or heads,
            config.get("head_dim") or hidden // heads,
            _required(config, "vocab_size"),
            config.get("tie_word_embeddings", True),
            lime,
            router,
            extra.get("lime_router_window") if lime else None,
            streams,
            static,
            extra.get("lime_prune_top_p") if lime else None,
        )
        return cls(
            shape,
            _rope_base(config),
            config.get("rms_norm_eps", 1e-6),
            _required(config, "max_position_embeddings"),
            extra.get("unpadded_vocab_size") or shape.vocab_size,
            extra.get("make_vocab_size_divisible_by"),
            tokenizer_type=extra.get("tokenizer_type"),
            router_lr=(config.get("lime_config") or {}).get("router_lr"),
            init_std=config.get("initializer_range", 0.02),
        )


def _required(config: dict, name: str):
    if config.get(name) is None:
        raise ConversionError(f"config.json has no {name}")
    return config[name]


def _architecture(config: dict, tensor_names: set[str]) -> str:
    """config.json's ``architectures``, else the architecture the tensors' names show."""
    known = (LLAMA_ARCHITECTURE, LIME_ARCHITECTURE, DYNAMIC_LIME_ARCHITECTURE, HC_ARCHITECTURE)
    architectures = config.get("architectures")
    if architectures:
        if architectures[0] not in known:
            raise ConversionError(
                f"unknown model type {architectures[0]!r} in config.json architectures: "
                f"expected one of {', '.join(known)}"
            )
        return architectures[0]
    if config.get("model_type") != "llama":
        raise ConversionError(
            f"unknown model type {config.get('model_type')!r} in config.json: expected "
            "'llama' (LLaMA, LIMe or Hyper-Connections)"
        )
    if any(name.endswith("lime_router.dynamic_weights") for name in tensor_names):
        return DYNAMIC_LIME_ARCHITECTURE
    if any(name.endswith("self_attn.kv_proj_weight") for name in tensor_names):
        return LIME_ARCHITECTURE
    if any(".hc_attn." in name for name in tensor_names):
        return HC_ARCHITECTURE
    return LLAMA_ARCHITECTURE


def _hyper_connections(config: dict, tensor_shapes: dict[str, torch.Size]) -> tuple[int, bool]:
    """(streams n, static) of a Hyper-Connections model: config.json's ``hc_config`` (``rate``,
    ``dynamic``), else n from the length of the first layer's ``hc_attn.static_beta`` and the
    variant from whether its dynamic tensors exist."""
    hc_config = config.get("hc_config") or {}
    first = "model.layers.0.hc_attn."
    if first + "static_beta" not in tensor_shapes:
        raise ConversionError(f"missing tensor {first}static_beta (a Hyper-Connections model's)")
    streams = hc_config.get("rate", tensor_shapes[first + "static_beta"][0])
    dynamic = hc_config.get("dynamic", first + HYPER_CONNECTION_TENSORS["dynamic"][0] in tensor_shapes)
    return int(streams), not dynamic


def _rope_base(config: dict) -> int:
    """The RoPE base of config.json (transformers 5 ``rope_parameters`` or 4's ``rope_theta``)."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind != "default":
        raise ConversionError(f"config.json: RoPE type {kind!r} is not supported (only the default RoPE)")
    base = rope.get("rope_theta", config.get("rope_theta", 10000.0))
    if float(base) != int(base):
        raise ConversionError(f"config.json: rope_theta={base} is not an integer (--rotary-base takes one)")
    return int(base)


# --------------------------------------------------------------------------- safetensors files


def new_file_mode() -> int:
    """The mode ``open(..., "w")`` gives a new file under this process's umask (0644 under 022)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def write_safetensors(
    tensors: dict[str, torch.Tensor], directory: str, shard_bytes: int = SHARD_BYTES, progress: bool = True
) -> list[str]:
    """Write ``tensors`` as one ``model.safetensors`` or as shards of at most ``shard_bytes`` with
    transformers' index; returns the file names."""
    with requires_extra("hf"):
        from safetensors.torch import save_file

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    names = (
        [SINGLE_FILE]
        if len(shards) == 1
        else [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    )
    for name, shard in zip(tqdm(names, desc="write safetensors", unit="file", disable=not progress), shards):
        save_file(shard, os.path.join(directory, name), metadata={"format": "pt"})
        # safetensors creates its files 0600; give them the mode every other file of the export gets
        os.chmod(os.path.join(directory, name), new_file_mode())
    if len(shards) > 1:
        index = dict(
            metadata=dict(total_size=sum(t.numel() * t.element_size() for t in tensors.values())),
            weight_map={tensor: name for name, shard in zip(names, shards) for tensor in shard},
        )
        _write_json(os.path.join(directory, INDEX_FILE), index)
        names.append(INDEX_FILE)
    return names


def read_safetensors(directory: str, progress: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors file(s) in ``directory`` (single file or indexed shards)."""
    with requires_extra("hf"):
        from safetensors import safe_open

    index = os.path.join(directory, INDEX_FILE)
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as handle:
            files = sorted(set(json.load(handle)["weight_map"].values()))
    elif os.path.isfile(os.path.join(directory, SINGLE_FILE)):
        files = [SINGLE_FILE]
    else:
        raise ConversionError(f"no {SINGLE_FILE} or {INDEX_FILE} in {directory}")
    tensors: dict[str, torch.Tensor] = {}
    for name in tqdm(files, desc="read safetensors", unit="file", disable=not progress):
        path = os.path.join(directory, name)
        if not os.path.isfile(path):
            raise ConversionError(f"{INDEX_FILE} in {directory} names {name}, which is missing")
        with safe_open(path, framework="pt") as handle:
            tensors.update({key: handle.get_tensor(key) for key in handle.keys()})
    return tensors


def _write_json(path: str, value: dict) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(value, handle, indent=2)
        handle.write("\n")


def _read_json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        raise ConversionError(f"{path} is missing (not a Hugging Face model directory)") from None
    except json.JSONDecodeError as error:
        raise ConversionError(f"{path} is not valid JSON: {error}") from None


# --------------------------------------------------------------------------- tokenizer files


def _tokenizer_flags(directory: str, description: Description) -> list[str]:
    """Trainer flags for the tokenizer files in ``directory`` (``--vocab-size``, the mock-data
    vocabulary, if there are none)."""
    present = {
        name
        for name in ("tokenizer.json", "vocab.json", "merges.txt", "tokenizer.model")
        if os.path.isfile(os.path.join(directory, name))
    }
    kinds = [
        ("HuggingFaceTokenizer", {"tokenizer.json"}),
        ("GPT2BPETokenizer", {"vocab.json", "merges.txt"}),
        ("SentencePieceTokenizer", {"tokenizer.model"}),
    ]
    if description.tokenizer_type:  # ours: the type exported first
        kinds.sort(key=lambda kind: kind[0] != description.tokenizer_type)
    own = os.path.join(directory, RUN_TOKENIZER, "tokenizer.json")
    for kind, needs in kinds:
        if needs <= present:
            if kind == "HuggingFaceTokenizer" and os.path.isfile(own):  # ours: the run's, without EOD first
                return ["--tokenizer-type", kind, "--tokenizer-model", os.path.abspath(own)]
            path = {name: os.path.abspath(os.path.join(directory, name)) for name in needs}
            if kind == "GPT2BPETokenizer":
                return [
                    "--tokenizer-type",
                    kind,
                    "--vocab-file",
                    path["vocab.json"],
                    "--merge-file",
                    path["merges.txt"],
                ]
            return ["--tokenizer-type", kind, "--tokenizer-model", next(iter(path.values()))]
    return ["--vocab-size", str(description.unpadded_vocab_size)]


def _divisible_by(description: Description, unpadded: int) -> int:
    """The padding multiple: config.json's, else the largest power of two <= 128 that pads the
    tokenizer's ``unpadded`` size to exactly the embedding's rows."""
    if description.divisible_by:
        return description.divisible_by
    for multiple in (128, 64, 32, 16, 8, 4, 2, 1):
        if -(-unpadded // multiple) * multiple == description.shape.vocab_size:
            return multiple
    raise ConversionError(
        f"the tokenizer has {unpadded} tokens, more than model.embed_tokens.weight's "
        f"{description.shape.vocab_size} rows"
    )


# --------------------------------------------------------------------------- export / import


@dataclass
class Summary:
    """What a conversion did."""

    source: str
    destination: str
    architecture: str
    tensors: int
    bytes: int
    seconds: float
    files: list[str] = field(default_factory=list)
    phases: dict[str, float] = field(default_factory=dict)
    """Seconds per step (reading, mapping, writing)."""

    @property
    def gigabytes_per_second(self) -> float:
        return self.bytes / 1e9 / max(self.seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"{self.source} -> {self.destination}: {self.architecture}, {self.tensors} tensors, "
            f"{self.bytes / 1e9:.3f} GB in {self.seconds:.1f} s ({self.gigabytes_per_second:.2f} GB/s: "
            f"{', '.join(f'{step} {seconds:.1f} s' for step, seconds in self.phases.items())}); "
            f"files: {', '.join(self.files)}"
        )


class Stopwatch:
    """Seconds since the previous lap, by step name."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, step: str) -> None:
        now = time.perf_counter()
        self.laps[step] = now - self.last
        self.last = now

    @property
    def total(self) -> float:
        return self.last - self.start


def write_hf(
    model,
    description: Description,
    directory: str,
    *,
    dtype: torch.dtype | None = None,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Write the single-process ``model`` (config.json + safetensors) into ``directory`` (created;
    it must not hold a model yet), tensors in ``dtype`` (default: the model's)."""
    os.makedirs(directory, exist_ok=True)
    if os.path.exists(os.path.join(directory, "config.json")):
        raise ConversionError(f"{directory} holds a model already (config.json): refusing to overwrite it")
    state = {name: tensor for name, tensor in model.state_dict().items() if isinstance(tensor, torch.Tensor)}
    tensors = to_hf_tensors(state, description.shape)
    if dtype is not None:
        tensors = {name: tensor.to(dtype) for name, tensor in tensors.items()}
    files = write_safetensors(tensors, directory, shard_bytes, progress)
    dtype = tensors["model.embed_tokens.weight"].dtype
    _write_json(os.path.join(directory, "config.json"), description.config_json(dtype))
    _write_json(os.path.join(directory, GENERATION_CONFIG), description.generation_config_json())
    return tensors, ["config.json", GENERATION_CONFIG, *files]


def export_checkpoint(
    checkpoint: str,
    directory: str,
    *,
    dtype: torch.dtype | None = None,
    shard_bytes: int = SHARD_BYTES,
    progress: bool = True,
) -> Summary:
    """Checkpoint (any layout; a ``--save`` root or an ``iter_NNNNNNN`` directory) -> Hugging Face
    directory with the run's tokenizer."""
    watch = Stopwatch()
    loaded = load_model(checkpoint)
    tokenizer = loaded.tokenizer()
    watch.lap("read checkpoint")
    if loaded.model.config.hyper_connections_manifold:
        raise ConversionError(
            "mHC (--hyper-connections-manifold) has no Hugging Face layout to write: the paper's "
            "code (the layouts here) has only Hyper-Connections; the checkpoint is left as it is"
        )
    description = Description.of_run(loaded.run, ModelShape.of_model(loaded.model), tokenizer)
    exported = exported_tokenizer(tokenizer)  # checked before any file is written
    tensors, files = write_hf(
        loaded.model, description, directory, dtype=dtype, shard_bytes=shard_bytes, progress=progress
    )
    files += write_tokenizer(exported, directory)
    watch.lap("map and write safetensors")
    return Summary(
        loaded.directory,
        directory,
        description.shape.architecture,
        len(tensors),
        _nbytes(tensors),
        watch.total,
        files,
        watch.laps,
    )


def _nbytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())


def import_run(directory: str, description: Description, dtype: torch.dtype) -> dict:
    """The run description of a model read from the Hugging Face ``directory``: the trainer's
    options for its shape, RoPE, norm, tokenizer and padding (validated by the trainer's parser)."""
    shape = description.shape
    flags = [
        f"--{key.replace('_', '-')}={value}"
        for key, value in dict(
            num_layers=shape.num_layers,
            hidden_size=shape.hidden_size,
            ffn_hidden_size=shape.ffn_hidden_size,
            num_attention_heads=shape.num_attention_heads,
            num_query_groups=shape.kv_heads,
            kv_channels=shape.head_dim,
            seq_length=description.max_positions,
            max_position_embeddings=description.max_positions,
            rotary_base=description.rope_base,
            norm_epsilon=description.norm_epsilon,
            init_method_std=description.init_std,
            micro_batch_size=1,
            train_iters=1,
            lr=0.0,
        ).items()
    ] + ["--mock-data"]
    flags += ["--untie-embeddings-and-output-weights"] * (not shape.tied)
    flags += [f"--hyper-connections={shape.hyper_connections}"] * bool(shape.hyper_connections)
    flags += ["--hyper-connections-static"] * shape.hyper_connections_static
    if shape.lime:
        flags += ["--lime", f"--lime-router={shape.router}"]
        flags += [f"--lime-router-window={shape.router_window}"] * (shape.router_window is not None)
        flags += [f"--lime-router-lr={description.router_lr}"] * (description.router_lr is not None)
        if shape.prune_top_p is not None:  # the masks come with the weights (the parser wants both flags)
            flags += [f"--lime-prune-top-p={shape.prune_top_p}", "--lime-prune-iters=1"]
    flags += _tokenizer_flags(directory, description)
    run = arguments.parse_run(flags, world_size=1)
    divisible_by = _divisible_by(description, data.tokenizer_of(run.data, run.model.vocab_size).unpadded_vocab_size)
    run = arguments.parse_run(flags + [f"--make-vocab-size-divisible-by={divisible_by}"], world_size=1)
    tokenizer = data.tokenizer_of(run.data, run.model.vocab_size)
    if tokenizer.vocab_size != shape.vocab_size:
        raise ConversionError(
            f"the tokenizer in {directory} has {tokenizer.unpadded_vocab_size} tokens, padded to "
            f"{tokenizer.vocab_size} (multiple of {divisible_by}), but "
            f"model.embed_tokens.weight has {shape.vocab_size} rows"
        )
    precision = dataclasses.replace(run.precision, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16)
    run = dataclasses.replace(run, precision=precision)
    return checkpointing.run_description(run, arguments.transformer_config(run), tokenizer)


def import_checkpoint(
    directory: str, root: str, *, dtype: torch.dtype | None = None, iteration: int = 0, progress: bool = True
) -> Summary:
    """Hugging Face ``directory`` -> weights-only checkpoint under ``root`` (``iter_NNNNNNN`` plus
    the tracker), which ``pretrain_lime.py --load root --no-load-optim`` reads at any layout.
    Weights keep their dtype when it is a training dtype (float32, bfloat16, float16), else
    float32; ``dtype`` overrides."""
    watch = Stopwatch()
    config = _read_json(os.path.join(directory, "config.json"))
    tensors = read_safetensors(directory, progress)
    watch.lap("read safetensors")
    description = Description.of_config(config, {name: tensor.shape for name, tensor in tensors.items()})
    if "model.embed_tokens.weight" not in tensors:
        raise ConversionError(f"missing tensor model.embed_tokens.weight in {directory}")
    saved = tensors["model.embed_tokens.weight"].dtype
    dtype = dtype or (saved if saved in (torch.bfloat16, torch.float16) else torch.float32)
    initialize_parallel()
    run = import_run(directory, description, dtype)
    model = new_model(run, dtype)
    state = model.state_dict()
    try:
        converted = from_hf_tensors(tensors, state, description.shape)
    except LayoutError as error:
        raise ConversionError(f"{directory}: {error}") from None
    with torch.no_grad():
        for name, tensor in tqdm(converted.items(), desc="convert", unit="tensor", disable=not progress):
            state[name].copy_(tensor)
    watch.lap("map")
    written = save_model(model, run, root, iteration)
    watch.lap("write checkpoint")
    return Summary(
        directory,
        written,
        description.shape.architecture,
        len(tensors),
        _nbytes(tensors),
        watch.total,
        [os.path.basename(written)],
        watch.laps,
    )
