"""Shared test settings: float32 matmuls at full precision so comparisons against references are exact."""
import jax

jax.config.update("jax_default_matmul_precision", "highest")
