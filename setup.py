"""distattn: exact sequence-parallel attention (DistFlashAttn) for long-context training.

The top-level folder ``kernels/`` installs as ``distattn.kernels``.
"""

from setuptools import setup

# transformers 5.25 requires Hugging Face's `kernels` distribution and imports it as soon as a model loads; run from
# a checkout (the repository root on sys.path: `python -m pytest`, the bench scripts), this repository's top-level
# `kernels/` folder (installed as `distattn.kernels`) shadows it and that import fails. Capped below 5.25 until the
# folder is renamed.
TRANSFORMERS = "transformers>=5.17,<5.25"

setup(
    name="distattn",
    version="0.1.0",
    description="Exact attention for sequences too long for one GPU: Triton FlashAttention-2 with carried "
                "softmax statistics, load-balanced sequence parallelism, remat-aware checkpointing.",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=["distattn", "distattn.integrations", "distattn.kernels", "distattn.schedule", "distattn.memory",
              "distattn.compat", "distattn.compat.ring_flash_attn", "distattn.compat.ring_flash_attn.adapters",
              "distattn.compat.flash_attn"],
    package_dir={"distattn": "distattn", "distattn.kernels": "kernels"},
    # The supported ranges; CI tests both ends (README "Install"): the lower end is what the GPU machines have.
    install_requires=["torch>=2.11", "triton>=3.6", "numpy"],
    extras_require={
        # Everything the test suite imports beyond install_requires (CI installs exactly this into a new venv).
        # matplotlib: tests/test_plots.py renders every plot (the bench scripts still write their tables without it).
        # pytest-xdist: the README's test command runs two workers (`-n 2`).
        "test": ["pytest>=7", "pytest-timeout>=2", "pytest-xdist>=3", TRANSFORMERS, "accelerate>=1.12,<2",
                 "safetensors", "numpy", "matplotlib>=3.5", "datasets>=2.19", "pyarrow>=15"],
        # accelerate: transformers' Trainer needs it (SequenceParallelTrainer); 1.12 and 1.15 tested, 1.1
        # (transformers' own floor) fails inside Trainer on 5.23. safetensors: train.py's --model weights and
        # --export-hf folders.
        "hf": [TRANSFORMERS, "accelerate>=1.12,<2", "safetensors"],
        "data": ["datasets>=2.19", "pyarrow>=15"],  # launch/train.py --data: Parquet and datasets folders
        "bench": ["matplotlib>=3.5", TRANSFORMERS],  # plots; bench/checkpoint.py builds HF models
        "flash": ["flash-attn>=2.6"],
        # distattn.integrations.torchtitan (tests/test_torchtitan.py; tested with 0.3.0, Python >= 3.11). Not in
        # "test": it pins datasets<4.8 and pulls wandb, tensorboard and grpcio; without it those tests skip.
        "torchtitan": ["torchtitan==0.3.0"],
        # bench/peers (python -m bench.peers, tests/test_peers.py): the real peers, at the versions the harness and
        # its patches were tested with. Install with DS_BUILD_OPS=0 (DeepSpeed is an sdist; no C++ ops needed).
        # megatron-core 0.19.2 is not listed: its metadata asks Python >= 3.12, so pip refuses it on 3.11 unless
        # `pip install megatron-core==0.19.2 --no-deps --ignore-requires-python` (.ci/run does; without it the
        # megatron-core rows and tests skip).
        "peers": ["deepspeed==0.19.8", "yunchang==0.6.4"],
    },
    license="Apache-2.0",
    license_files=["LICENSE"],
)
