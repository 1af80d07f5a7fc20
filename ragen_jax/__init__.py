"""ragen_jax: multi-turn RL for LLM agents (StarPO, SNR-adaptive filtering, collapse diagnostics) in JAX."""
__version__ = "0.1.0"
