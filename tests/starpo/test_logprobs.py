"""Teacher-forced log-probs and entropies (``sequence_logprobs``) against a NumPy re-derivation from
the model's full logits, with and without the shared prompt run once per batch.

Fixed seeds (``nnx.Rngs(0)``, ``np.random.default_rng(0)``): the same model and tokens every run.
"""
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.starpo.logprobs import positions_for, sequence_logprobs

CFG = ModelConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=4,
                  num_kv_heads=2, head_dim=4, attention_block_size=8)


def _numpy_reference(model, tokens, temperature=1.0):
    """logp[:, t] = log_softmax(logits[:, t - 1])[tokens[:, t]], entropy of that distribution; 0 at t = 0."""
    logits = np.asarray(model(tokens, positions_for(tokens))[0], np.float64) / temperature
    z = logits - logits.max(-1, keepdims=True)
    logp_all = z - np.log(np.exp(z).sum(-1, keepdims=True))
    tok = np.asarray(tokens)
    logp = np.zeros(tok.shape)
    ent = np.zeros(tok.shape)
    logp[:, 1:] = np.take_along_axis(logp_all[:, :-1], tok[:, 1:, None], axis=-1)[..., 0]
    ent[:, 1:] = -(np.exp(logp_all[:, :-1]) * logp_all[:, :-1]).sum(-1)
    return logp, ent


@pytest.mark.parametrize("prefix_len", [0, 1, 7])
@pytest.mark.parametrize("chunk_size", [5, 64])
def test_sequence_logprobs_match_numpy(prefix_len, chunk_size):
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    tokens = np.random.default_rng(0).integers(0, CFG.vocab_size, (3, 21)).astype(np.int32)
    tokens[:, :7] = tokens[0, :7]  # every row opens with the same prompt
    tokens = jnp.asarray(tokens)
    logp, ent, hidden = sequence_logprobs(model, tokens, chunk_size=chunk_size, shared_prefix_len=prefix_len)
    ref_logp, ref_ent = _numpy_reference(model, tokens)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=0)
    full_hidden, _ = model.hidden(tokens, positions_for(tokens))
    np.testing.assert_allclose(np.asarray(hidden), np.asarray(full_hidden), atol=2e-5, rtol=0)


@pytest.mark.parametrize("prefix_len", [0, 7])
def test_sequence_logprobs_at_a_temperature_match_numpy(prefix_len):
    """``temperature=T`` scores ``softmax(logits / T)``: log-probs and entropies of that distribution."""
    model = Decoder(CFG, rngs=nnx.Rngs(1))
    tokens = np.random.default_rng(1).integers(0, CFG.vocab_size, (3, 21)).astype(np.int32)
    tokens[:, :7] = tokens[0, :7]
    tokens = jnp.asarray(tokens)
    logp, ent, _ = sequence_logprobs(model, tokens, chunk_size=8, shared_prefix_len=prefix_len, temperature=0.7)
    ref_logp, ref_ent = _numpy_reference(model, tokens, temperature=0.7)
    np.testing.assert_allclose(np.asarray(logp), ref_logp, atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), ref_ent, atol=2e-5, rtol=0)


def test_shared_prefix_length_is_checked():
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shared_prefix_len=9"):
        sequence_logprobs(model, jnp.zeros((2, 9), jnp.int32), chunk_size=4, shared_prefix_len=9)
