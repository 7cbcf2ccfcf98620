"""hf_export / hf_layout: Hugging Face directories from checkpoints and back.

- The LLaMA baseline written by ``write_hf`` loads in transformers' ``LlamaForCausalLM`` with the
  same logits (float64, MHA and GQA, tied and untied).  transformers computes RMSNorm and eager
  softmax in float32 whatever the input dtype; the float64 comparison uses SDPA attention and
  runs transformers' RMSNorm at its input precision (its formula otherwise unchanged).
- LIMe written in the official layout: its tensor names and shapes are those the official
  ``LIMeForCausalLM`` (github.com/corl-team/lime, src/lm/lime.py) creates, written down here
  from reading that code; a reader written here from the official forward's semantics feeds the
  plain reference of the paper's equations (``reference_lime``), whose logits equal ours.
- Hyper-Connections likewise in the official ``LlamaHCForCausalLM`` layout (src/lm/hc.py), read
  into the float64 reference of the official HC code (``reference_hc``): dynamic and static,
  n = 2 and 4, MHA and GQA.
- Dynamic LIMe (no official layout) in ``DynamicLIMeForCausalLM``: the names and shapes
  ``hf_layout`` specifies, read by a reader written here from that specification into the
  reference's ``dynamic_route``, MHA, GQA and with pruned routes (the masks written too).
- checkpoint -> HF -> checkpoint is bit-exact (LLaMA, LIMe static and dynamic, pruning runs with
  their masks, HC) and keeps epsilon, RoPE base, tying, padding and the model family's options;
  a bare LlamaConfig as the official trainer saves it imports as LIMe (static or dynamic) or HC
  by its tensors; bad directories fail with one message naming the tensor or field.
"""

import json
import os

import pytest
import torch

pytest.importorskip("safetensors")  # the hf extra: pip install torch==2.13.0 -e .[hf]
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from lime_megatron.interop.checkpoint_model import load_model, new_model, save_model
from lime_megatron.interop.hf_export import ConversionError, Description, export_checkpoint, import_checkpoint, write_hf
from lime_megatron.interop.hf_layout import ModelShape
from lime_megatron.parallel.process_groups import initialize_parallel
from lime_megatron.training import arguments, checkpointing, data
from tests import reference_hc, reference_lime
from tests.lime_fixtures import SEQ, VOCAB, batch, relative_error, tiny_model

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


TOLERANCE = 1e-10
EPS, ROPE_BASE = 1e-6, 5000


@pytest.fixture(autouse=True)
def parallel():
    """A one-process world (the trainer test tears its own down)."""
    initialize_parallel()


def _write(model, directory, **description) -> str:
    """``model`` as a Hugging Face directory (float64 tensors as they are)."""
    settings = dict(rope_base=ROPE_BASE, norm_epsilon=EPS, max_positions=SEQ, unpadded_vocab_size=VOCAB)
    settings.update(description)
    write_hf(model, Description(ModelShape.of_model(model), **settings), str(directory), progress=False)
    return str(directory)


def _model(**overrides):
    """A float64 tiny model (RoPE base ``ROPE_BASE`` and epsilon ``EPS``) in eval mode."""
    from lime_megatron.models.gpt_model import build_model

    template = tiny_model(layernorm_epsilon=EPS, **overrides)
    model = build_model(
        template.config,
        VOCAB,
        SEQ,
        rotary_base=ROPE_BASE,
        share_embeddings_and_output_weights=template.share_embeddings_and_output_weights,
    )
    model.load_state_dict(template.state_dict())
    return model.eval()


# --------------------------------------------------------------------------- LLaMA in transformers


@pytest.mark.parametrize("groups, tied", [(4, True), (2, True), (2, False)], ids=["mha", "gqa", "gqa-untied"])
def test_llama_logits_equal_transformers(tmp_path, monkeypatch, groups, tied):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama import modeling_llama

    def rms_norm_at_input_precision(self, hidden):
        return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", rms_norm_at_input_precision)
    model = _model(lime=False, num_query_groups=groups)
    if not tied:
        model = _untied(model)
    hf = transformers.LlamaForCausalLM.from_pretrained(
        _write(model, tmp_path / "hf"), dtype=torch.float64, attn_implementation="sdpa"
    ).eval()
    assert hf.config.rms_norm_eps == EPS and hf.config.tie_word_embeddings == tied
    tokens, positions, mask = batch()
    with torch.no_grad():
        ours, theirs = model(tokens, positions, mask), hf(tokens).logits
    assert theirs.shape == ours.shape
    assert relative_error(theirs, ours) <= TOLERANCE


def _untied(model):
    """``model`` with a separate output layer (a different random matrix)."""
    from lime_megatron.models.gpt_model import build_model

    untied = build_model(model.config, VOCAB, SEQ, rotary_base=ROPE_BASE, share_embeddings_and_output_weights=False)
    state = model.state_dict()
    state["output_layer.weight"] = torch.randn(VOCAB, model.config.hidden_size, dtype=torch.float64) * 0.1
    untied.load_state_dict(state)
    return untied.eval()


# --------------------------------------------------------------------------- LIMe, official layout


def official_shapes(config: dict) -> dict[str, list[int]]:
    """Parameter names and shapes of the official ``LIMeForCausalLM(LlamaConfig, LIMeConfig)``,
    written from src/lm/lime.py: ``LlamaForCausalLM`` whose attention deletes ``k_proj``/``v_proj``
    and adds ``kv_proj_weight`` [2 head_dim kv_heads, hidden]; layers >= 1 add
    ``lime_router.static_weights`` [kv_heads, (layer + 1) kv_heads] (layer 0's router has none)."""
    h, layers, kv = config["hidden_size"], config["num_hidden_layers"], config["num_key_value_heads"]
    d, heads, ffn = config["head_dim"], config["num_attention_heads"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": [h],
                p + "post_attention_layernorm.weight": [h],
                p + "self_attn.q_proj.weight": [heads * d, h],
                p + "self_attn.o_proj.weight": [h, heads * d],
                p + "self_attn.kv_proj_weight": [2 * d * kv, h],
                p + "mlp.gate_proj.weight": [ffn, h],
                p + "mlp.up_proj.weight": [ffn, h],
                p + "mlp.down_proj.weight": [h, ffn],
            }
        )
        if i > 0:
            shapes[p + "self_attn.lime_router.static_weights"] = [kv, (i + 1) * kv]
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [config["vocab_size"], h]
    return shapes


def read_official(directory: str) -> tuple[dict, dict]:
    """A reader of the official layout written from the official forward's semantics: the K/V
    projection's output feature ``c * kv_heads + g`` is channel c (keys c < head_dim, then
    values) of head g; the router mixes layers 0..l with the full static matrix (layer 0: its
    own heads).  Returns (``reference_lime`` params, spec)."""
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    kv, d = config["num_key_value_heads"], config["head_dim"]
    key_rows = [c * kv + g for g in range(kv) for c in range(d)]
    value_rows = [(d + c) * kv + g for g in range(kv) for c in range(d)]
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        kv_proj = tensors[p + "self_attn.kv_proj_weight"]
        layer = dict(
            attn_norm=tensors[p + "input_layernorm.weight"],
            wq=tensors[p + "self_attn.q_proj.weight"],
            wk=kv_proj[key_rows],
            wv=kv_proj[value_rows],
            wo=tensors[p + "self_attn.o_proj.weight"],
            mlp_norm=tensors[p + "post_attention_layernorm.weight"],
            w_gate=tensors[p + "mlp.gate_proj.weight"],
            w_up=tensors[p + "mlp.up_proj.weight"],
            w_down=tensors[p + "mlp.down_proj.weight"],
        )
        if p + "self_attn.lime_router.static_weights" in tensors:  # absent at layer 0 and in dynamic runs
            layer["router"] = tensors[p + "self_attn.lime_router.static_weights"]
        layers.append(layer)
    params = dict(
        embedding=tensors["model.embed_tokens.weight"], final_norm=tensors["model.norm.weight"], layers=layers
    )
    spec = dict(
        heads=config["num_attention_heads"],
        kv_heads=kv,
        eps=config["rms_norm_eps"],
        rope_base=config["rope_theta"],
        lime=True,
        variant="full",
        window=None,
    )
    return params, spec


LIME_CASES = {
    "full-mha": dict(num_query_groups=4),
    "full-gqa": dict(num_query_groups=2),
    "last2-gqa": dict(num_query_groups=2, lime_router="last", lime_router_window=2),
    "first2": dict(lime_router="first", lime_router_window=2),
    "average-gqa": dict(num_query_groups=2, lime_router="average"),
}


def _write_in_official_shapes(model, directory, official_shapes_of) -> tuple[str, dict]:
    """Export ``model``; check every written tensor has the official name and shape; (directory, config)."""
    directory = _write(model, directory)
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        written = {name: list(handle.get_slice(name).get_shape()) for name in handle.keys()}
    assert written == official_shapes_of(config)
    return directory, config


@pytest.mark.parametrize("case", LIME_CASES)
def test_lime_official_layout_reproduces_our_logits(tmp_path, case):
    model = _model(lime=True, **LIME_CASES[case])
    directory, config = _write_in_official_shapes(model, tmp_path / "hf", official_shapes)
    assert config["architectures"] == ["LIMeForCausalLM"] and config["rope_theta"] == ROPE_BASE
    params, spec = read_official(directory)
    tokens, positions, mask = batch()
    with torch.no_grad():
        ours = model(tokens, positions, mask)
    assert relative_error(reference_lime.forward(params, tokens, spec), ours) <= TOLERANCE


# --------------------------------------------------------------------------- dynamic LIMe


def dynamic_shapes(config: dict) -> dict[str, list[int]]:
    """The LIMe layout with ``lime_router.dynamic_weights`` [(i + 1) kv_heads, hidden] instead of
    ``static_weights`` (and ``route_mask`` [kv_heads, i + 1] in a pruning run), as
    ``hf_layout``'s docstring specifies."""
    shapes = official_shapes(config)
    kv, hidden = config["num_key_value_heads"], config["hidden_size"]
    for i in range(1, config["num_hidden_layers"]):
        p = f"model.layers.{i}.self_attn.lime_router."
        del shapes[p + "static_weights"]
        shapes[p + "dynamic_weights"] = [(i + 1) * kv, hidden]
        if config["lime_megatron"]["lime_prune_top_p"] is not None:
            shapes[p + "route_mask"] = [kv, i + 1]
    return shapes


def read_dynamic(directory: str) -> tuple[dict, dict]:
    """``read_official`` for the dynamic layout: row j kv + g of ``dynamic_weights`` is head g's
    logit for source j (``reference_lime.dynamic_route`` takes rows head-major), the own offset
    from ``lime_dynamic_own_weight``, masks from ``route_mask``."""
    params, spec = read_official(directory)
    config = json.load(open(os.path.join(directory, "config.json")))
    assert config["lime_megatron"]["lime_dynamic_own_weight"] == 0.9  # the reference's offset ln(0.9 l / 0.1)
    kv = config["num_key_value_heads"]
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        for i, layer in enumerate(params["layers"][1:], start=1):
            p = f"model.layers.{i}.self_attn.lime_router."
            weights = handle.get_tensor(p + "dynamic_weights")
            layer["dynamic_router"] = weights.view(i + 1, kv, -1).transpose(0, 1).reshape(kv * (i + 1), -1)
            if p + "route_mask" in handle.keys():
                layer["dynamic_mask"] = handle.get_tensor(p + "route_mask")
    return params, {**spec, "variant": "dynamic"}


def _perturbed_dynamic(pruned: bool, **overrides):
    """A dynamic LIMe model with its W_l off zero (a misplaced row would show) and, ``pruned``,
    random route masks that keep the own layer."""
    model = _model(lime=True, lime_router="dynamic", lime_prune_top_p=0.9 if pruned else None, **overrides)
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for router in (module for module in model.modules() if getattr(module, "dynamic", False)):
            router.weight.add_(0.5 * torch.randn(router.weight.shape, generator=generator, dtype=router.weight.dtype))
            if pruned:
                mask = torch.rand(router.route_mask.shape, generator=generator) < 0.5
                mask[:, -1] = True
                router.set_route_mask(mask)
    return model


DYNAMIC_CASES = {
    "mha": (False, dict(num_query_groups=4)),
    "gqa": (False, dict(num_query_groups=2)),
    "gqa-pruned": (True, dict(num_query_groups=2)),
}


@pytest.mark.parametrize("case", DYNAMIC_CASES)
def test_dynamic_lime_layout_reproduces_our_logits(tmp_path, case):
    pruned, overrides = DYNAMIC_CASES[case]
    model = _perturbed_dynamic(pruned, **overrides)
    directory, config = _write_in_official_shapes(model, tmp_path / "hf", dynamic_shapes)
    assert config["architectures"] == ["DynamicLIMeForCausalLM"]
    params, spec = read_dynamic(directory)
    assert pruned == any("dynamic_mask" in layer for layer in params["layers"])
    tokens, positions, mask = batch()
    with torch.no_grad():
        ours = model(tokens, positions, mask)
    assert relative_error(reference_lime.forward(params, tokens, spec), ours) <= TOLERANCE


# --------------------------------------------------------------------------- Hyper-Connections, official layout


def official_hc_shapes(config: dict) -> dict[str, list[int]]:
    """Parameter names and shapes of the official ``LlamaHCForCausalLM(LlamaConfig, HCConfig)``,
    written from src/lm/hc.py: ``LlamaForCausalLM`` whose layers delete ``input_layernorm`` and
    ``post_attention_layernorm`` (``attn_norm``, ``mlp_norm`` and the hyper-connections'
    ``layer_norm`` are LayerNorms without parameters) and add ``hc_attn`` and ``hc_mlp``, each
    ``static_beta`` [rate] and ``static_alpha`` [rate, rate + 1], and when dynamic
    ``dynamic_alpha_fn`` [hidden, rate + 1], ``dynamic_alpha_scale`` [1], ``dynamic_beta_fn``
    [hidden], ``dynamic_beta_scale`` [1]."""
    h, kv, d = config["hidden_size"], config["num_key_value_heads"], config["head_dim"]
    heads, ffn, rate = config["num_attention_heads"], config["intermediate_size"], config["hc_config"]["rate"]
    shapes = {"model.embed_tokens.weight": [config["vocab_size"], h], "model.norm.weight": [h]}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": [heads * d, h],
                p + "self_attn.k_proj.weight": [kv * d, h],
                p + "self_attn.v_proj.weight": [kv * d, h],
                p + "self_attn.o_proj.weight": [h, heads * d],
                p + "mlp.gate_proj.weight": [ffn, h],
                p + "mlp.up_proj.weight": [ffn, h],
                p + "mlp.down_proj.weight": [h, ffn],
            }
        )
        for module in ("hc_attn", "hc_mlp"):
            shapes.update({p + module + ".static_beta": [rate], p + module + ".static_alpha": [rate, rate + 1]})
            if config["hc_config"]["dynamic"]:
                shapes.update(
                    {
                        p + module + ".dynamic_alpha_fn": [h, rate + 1],
                        p + module + ".dynamic_beta_fn": [h],
                        p + module + ".dynamic_alpha_scale": [1],
                        p + module + ".dynamic_beta_scale": [1],
                    }
                )
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = [config["vocab_size"], h]
    return shapes


def read_official_hc(directory: str) -> tuple[dict, dict]:
    """A reader of the official HC layout: (``reference_hc`` params, spec)."""
    with open(os.path.join(directory, "config.json")) as handle:
        config = json.load(handle)
    with safe_open(os.path.join(directory, "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    layers = []
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = dict(
            wq=tensors[p + "self_attn.q_proj.weight"],
            wk=tensors[p + "self_attn.k_proj.weight"],
            wv=tensors[p + "self_attn.v_proj.weight"],
            wo=tensors[p + "self_attn.o_proj.weight"],
            w_gate=tensors[p + "mlp.gate_proj.weight"],
            w_up=tensors[p + "mlp.up_proj.weight"],
            w_down=tensors[p + "mlp.down_proj.weight"],
        )
        for module in ("hc_attn", "hc_mlp"):
            start = p + module + "."
            layer[module] = {name[len(start) :]: tensor for name, tensor in tensors.items() if name.startswith(start)}
        layers.append(layer)
    params = dict(
        embedding=tensors["model.embed_tokens.weight"], final_norm=tensors["model.norm.weight"], layers=layers
    )
    spec = dict(
        heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"],
        eps=config["rms_norm_eps"],
        rope_base=config["rope_theta"],
        hyper_connections=config["hc_config"]["rate"],
        dynamic=config["hc_config"]["dynamic"],
    )
    return params, spec


HC_CASES = {
    "dynamic-n4-mha": dict(hyper_connections=4, num_query_groups=4),
    "dynamic-n2-gqa": dict(hyper_connections=2, num_query_groups=2),
    "static-n4-gqa": dict(hyper_connections=4, hyper_connections_static=True, num_query_groups=2),
}


@pytest.mark.parametrize("case", HC_CASES)
def test_hyper_connections_official_layout_reproduces_our_logits(tmp_path, case):
    model = _model(lime=False, **HC_CASES[case])
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():  # off the initial values: zero dynamic weights would hide a misplaced tensor
        for name, param in model.named_parameters():
            if ".hc_" in name:
                param.add_(0.3 * torch.randn(param.shape, generator=generator, dtype=param.dtype))
    directory, config = _write_in_official_shapes(model, tmp_path / "hf", official_hc_shapes)
    assert config["architectures"] == ["LlamaHCForCausalLM"] and config["use_cache"]
    assert config["hc_config"] == dict(
        rate=model.config.hyper_connections, dynamic=not model.config.hyper_connections_static
    )
    params, spec = read_official_hc(directory)
    tokens, positions, mask = batch()
    with torch.no_grad():
        ours = model(tokens, positions, mask)
    assert relative_error(reference_hc.forward(params, tokens, spec), ours) <= TOLERANCE


# --------------------------------------------------------------------------- checkpoint round trips


def _checkpoint(root, flags: list[str]) -> str:
    """A random single-process checkpoint of the run the trainer ``flags`` describe."""
    initialize_parallel()
    options = arguments.parse_run(
        flags
        + "--seq-length 16 --micro-batch-size 1 --train-iters 1 --lr 1e-3".split()
        + ["--mock-data"] * ("--mock-data" not in flags)
    )
    tokenizer = data.tokenizer_of(options.data, options.model.vocab_size)
    run = checkpointing.run_description(options, arguments.transformer_config(options), tokenizer)
    model = new_model(run, torch.float32)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator))
        for name, mask in model.named_buffers():  # a pruning run's masks: some routes masked
            if name.endswith("route_mask"):
                mask.copy_(torch.rand(mask.shape, generator=generator) < 0.6)
    return save_model(model, run, str(root), iteration=3)


ROUND_TRIPS = {
    "llama-gpt2-tied": "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --rotary-base 5000 --norm-epsilon 1e-6",
    "lime-gqa-untied-mock": "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 --lime "
    "--untie-embeddings-and-output-weights --mock-data --vocab-size 100 --rotary-base 20000",
    "lime-last2": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --lime --lime-router last "
    "--lime-router-window 2 --mock-data --vocab-size 70 --make-vocab-size-divisible-by 32",
    "hc-dynamic-gqa": "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 "
    "--hyper-connections 4 --mock-data --vocab-size 100",
    "hc-static-untied": "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --hyper-connections 2 "
    "--hyper-connections-static --untie-embeddings-and-output-weights --mock-data --vocab-size 90",
    "lime-dynamic-gqa": "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --num-query-groups 2 --lime "
    "--lime-router dynamic --mock-data --vocab-size 100",
    "lime-dynamic-pruned": "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --lime --lime-router dynamic "
    "--lime-prune-top-p 0.9 --lime-prune-iters 1 --mock-data --vocab-size 100",
    "lime-last2-pruned": "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --lime --lime-router last "
    "--lime-router-window 2 --lime-prune-top-p 0.8 --lime-prune-iters 1 --mock-data "
    "--vocab-size 70",
}


@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_round_trip_is_bit_exact(tmp_path, case):
    from lime_megatron.cli.convert_checkpoint import main

    source = _checkpoint(tmp_path / "ckpt", ROUND_TRIPS[case].split())
    assert main(["export", source, str(tmp_path / "hf")]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back"), "--iteration", "3"]) == 0
    before, after = load_model(source), load_model(str(tmp_path / "back"))
    names = [name for name, value in before.model.state_dict().items() if isinstance(value, torch.Tensor)]
    assert set(names) == {n for n, v in after.model.state_dict().items() if isinstance(v, torch.Tensor)}
    for name in names:
        assert torch.equal(before.model.state_dict()[name], after.model.state_dict()[name]), name
    assert after.run["vocab"] == before.run["vocab"] and after.run["shape"] == before.run["shape"]
    for option in (
        "norm_epsilon",
        "rotary_base",
        "make_vocab_size_divisible_by",
        "lime_router",
        "lime_router_window",
        "lime_prune_top_p",
        "hyper_connections",
        "hyper_connections_static",
    ):
        assert after.run["args"][option] == before.run["args"][option], option
    config = json.load(open(tmp_path / "hf" / "config.json"))
    assert config["vocab_size"] == before.run["vocab"]["padded"] > before.run["vocab"]["size"]


OFFICIAL_STYLE = {  # run -> what the import must recognise from the tensors alone
    "lime-gqa-untied-mock": dict(lime=True, lime_router="full", hyper_connections=0),
    "hc-dynamic-gqa": dict(lime=False, hyper_connections=4, hyper_connections_static=False),
    "hc-static-untied": dict(lime=False, hyper_connections=2, hyper_connections_static=True),
    "lime-dynamic-gqa": dict(lime=True, lime_router="dynamic", hyper_connections=0),
}


@pytest.mark.parametrize("case", OFFICIAL_STYLE)
def test_official_style_directory_imports(tmp_path, case):
    """A bare LlamaConfig as the official trainer saves it (no architectures, no lime_megatron,
    lime_config or hc_config block): LIMe is recognised by its kv_proj_weight tensors,
    Hyper-Connections by their hc_attn tensors (n from static_beta, the variant from the dynamic
    tensors); the weights come back bit-exact."""
    from lime_megatron.cli.convert_checkpoint import main

    source = _checkpoint(tmp_path / "ckpt", ROUND_TRIPS[case].split())
    assert main(["export", source, str(tmp_path / "hf")]) == 0
    config_path = tmp_path / "hf" / "config.json"
    config = json.load(open(config_path))
    for key in ("architectures", "lime_megatron", "lime_config", "hc_config", "rope_parameters"):
        config.pop(key, None)
    json.dump(config, open(config_path, "w"))
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    before, after = load_model(source), load_model(str(tmp_path / "back"))
    for option, value in OFFICIAL_STYLE[case].items():
        assert getattr(after.config, option) == value, option
    assert after.run["vocab"]["padded"] == before.run["vocab"]["padded"]
    for name, tensor in before.model.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, after.model.state_dict()[name]), name


def test_gpt2_tokenizer_files_load_in_transformers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from lime_megatron.cli.convert_checkpoint import main

    source = _checkpoint(tmp_path / "ckpt", ROUND_TRIPS["llama-gpt2-tied"].split())
    assert main(["export", source, str(tmp_path / "hf")]) == 0
    ours = load_model(source).tokenizer()
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    text = "Layer-integrated memory, exported to  Hugging Face!"
    assert theirs.encode(text) == [ours.eod, *ours.tokenize(text)]  # EOD first, as training put it
    assert theirs.eos_token_id == theirs.bos_token_id == ours.eod


@pytest.mark.slow
def test_trainer_starts_from_an_import(tmp_path):
    from lime_megatron.training import trainer

    source = _checkpoint(tmp_path / "ckpt", ROUND_TRIPS["lime-gqa-untied-mock"].split())
    from lime_megatron.cli.convert_checkpoint import main

    assert main(["export", source, str(tmp_path / "hf")]) == 0
    assert main(["import", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0
    flags = (
        ROUND_TRIPS["lime-gqa-untied-mock"] + " --seq-length 16 --micro-batch-size 2 --global-batch-size 2 "
        "--lr 1e-3 --train-iters 1 --log-interval 100 --eval-interval 100 --eval-iters 1 --no-load-optim "
        f"--load {tmp_path / 'back'}"
    ).split()
    result = trainer.train(flags)
    assert result.resumed_from.endswith("iter_0000000") and result.iteration == 1


# --------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad")
    source = _checkpoint(root / "ckpt", ROUND_TRIPS["lime-last2"].split())
    from lime_megatron.cli.convert_checkpoint import main

    assert main(["export", source, str(root / "hf")]) == 0
    return root / "hf"


def _edited(exported, tmp_path, edit_config=None, edit_tensors=None) -> str:
    """A copy of the exported directory with config.json and/or the tensors edited."""
    config = json.load(open(exported / "config.json"))
    with safe_open(str(exported / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    (edit_config or (lambda c: None))(config)
    (edit_tensors or (lambda t: None))(tensors)
    os.makedirs(tmp_path / "edited")
    json.dump(config, open(tmp_path / "edited" / "config.json", "w"))
    save_file(tensors, str(tmp_path / "edited" / "model.safetensors"))
    return str(tmp_path / "edited")


ROUTER = "model.layers.3.self_attn.lime_router.static_weights"
BAD = {
    "unknown model type": (
        lambda c: c.update(architectures=["MistralForCausalLM"]),
        None,
        "unknown model type 'MistralForCausalLM'",
    ),
    "shape": (
        lambda c: c.update(intermediate_size=64),
        None,
        r"tensor model.layers.0.mlp.gate_proj.weight has shape \[\d+, 32\], the config implies \[64, 32\]",
    ),
    "missing": (
        None,
        lambda t: t.pop("model.layers.1.self_attn.o_proj.weight"),
        "missing tensor model.layers.1.self_attn.o_proj.weight",
    ),
    "unexpected": (None, lambda t: t.update(extra=torch.zeros(1)), "unexpected tensor extra"),
    "router zeros": (
        None,
        lambda t: t[ROUTER][:, :2].fill_(1.0),
        rf"{ROUTER}: non-zero weights on layers \[0, 1\], which the 'last' router",
    ),
    "no config field": (lambda c: c.pop("hidden_size"), None, "config.json has no hidden_size"),
    "dynamic own weight": (
        lambda c: (
            c.update(architectures=["DynamicLIMeForCausalLM"]) or c["lime_megatron"].update(lime_dynamic_own_weight=0.8)
        ),
        None,
        "lime_dynamic_own_weight=0.8 is not supported",
    ),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_directories_fail_with_one_message(exported, tmp_path, case):
    edit_config, edit_tensors, message = BAD[case]
    directory = _edited(exported, tmp_path, edit_config, edit_tensors)
    with pytest.raises(ConversionError, match=message):
        import_checkpoint(directory, str(tmp_path / "out"), progress=False)


def test_an_mhc_checkpoint_is_not_exported(tmp_path):
    source = _checkpoint(
        tmp_path / "ckpt",
        "--no-lime --hyper-connections 2 --hyper-connections-manifold "
        "--num-layers 2 --hidden-size 32 --num-attention-heads 4".split(),
    )
    with pytest.raises(ConversionError, match="mHC .* has no Hugging Face layout"):
        export_checkpoint(source, str(tmp_path / "hf"), progress=False)
    assert not os.path.exists(tmp_path / "hf")


def test_exported_files_share_one_mode(tmp_path):
    """Every file of an export, the safetensors ones (which the library creates 0600) included,
    gets the mode a new file gets under the process's umask."""
    directory = _write(_model(), tmp_path / "hf")
    umask = os.umask(0)
    os.umask(umask)
    modes = {name: os.stat(os.path.join(directory, name)).st_mode & 0o777 for name in os.listdir(directory)}
    assert "model.safetensors" in modes
    assert set(modes.values()) == {0o666 & ~umask}, modes
