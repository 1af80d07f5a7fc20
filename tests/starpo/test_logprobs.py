"""Teacher-forced log-probs and entropies (``sequence_logprobs``) against a NumPy re-derivation from
the model's full logits, with and without the shared prompt run once per batch.

Fixed seeds (``nnx.Rngs(0)``, ``np.random.default_rng(0)``): the same model and tokens every run.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import Decoder, ModelConfig
from ragen_jax.starpo.logprobs import positions_for, score_slots, sequence_logprobs, unscored_count

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


def test_score_slots_hand_worked():
    """Each row's marked positions in order, -1 in the slots left over; position 0 predicts nothing."""
    scored = jnp.asarray([[0, 1, 1, 0, 1, 0],
                          [1, 0, 0, 0, 0, 1],
                          [0, 0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(np.asarray(score_slots(scored, 3)), [[1, 2, 4], [5, -1, -1], [-1, -1, -1]])
    np.testing.assert_array_equal(np.asarray(score_slots(scored, 2)), [[1, 2], [5, -1], [-1, -1]])
    assert int(unscored_count(scored, 3)) == 0
    assert int(unscored_count(scored, 2)) == 1  # row 0's position 4 does not fit
    assert score_slots(scored, 99).shape == (3, 6)  # never wider than the rows


@pytest.mark.parametrize("prefix_len", [0, 7])
def test_loss_token_logprobs_match_numpy_there_and_are_zero_elsewhere(prefix_len):
    """``slots``: the LM head runs on the marked positions only (``starpo.logprobs_at='loss_tokens'``);
    there log-probs and entropies equal the NumPy re-derivation from the full logits, elsewhere 0."""
    model = Decoder(CFG, rngs=nnx.Rngs(2))
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, CFG.vocab_size, (3, 21)).astype(np.int32)
    tokens[:, :7] = tokens[0, :7]
    tokens = jnp.asarray(tokens)
    scored = np.zeros((3, 21), bool)
    scored[0, 9:14] = scored[1, [8, 15, 20]] = True  # row 2 scores nothing
    slots = score_slots(jnp.asarray(scored), 6)
    logp, ent, _ = sequence_logprobs(model, tokens, chunk_size=4, shared_prefix_len=prefix_len, temperature=0.7,
                                     slots=slots)
    ref_logp, ref_ent = _numpy_reference(model, tokens, temperature=0.7)
    np.testing.assert_allclose(np.asarray(logp), np.where(scored, ref_logp, 0.0), atol=2e-5, rtol=0)
    np.testing.assert_allclose(np.asarray(ent), np.where(scored, ref_ent, 0.0), atol=2e-5, rtol=0)


def test_loss_token_gradients_equal_the_every_position_gradients():
    """The backward pass through the gathered head is the plain path's: the gradient of a masked loss
    (log-probs and entropies, as the StarPO loss reads them) with respect to every weight."""
    model = Decoder(CFG, rngs=nnx.Rngs(3))
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, CFG.vocab_size, (2, 16)).astype(np.int32))
    scored = np.zeros((2, 16), bool)
    scored[0, 5:12] = scored[1, 3:6] = True
    mask = jnp.asarray(scored)
    weights = jnp.asarray(rng.normal(size=(2, 16)).astype(np.float32))
    graphdef, state = nnx.split(model)

    def loss(state, slots):
        logp, ent, _ = sequence_logprobs(nnx.merge(graphdef, state), tokens, chunk_size=4, slots=slots)
        return jnp.sum(jnp.where(mask, weights * logp - 0.1 * ent, 0.0))

    plain = jax.grad(loss)(state, None)
    gathered = jax.grad(loss)(state, score_slots(mask, 8))
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(gathered)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-6, rtol=1e-5)
