"""Weight loading: HF safetensors directories (single, sharded, bf16), GGUF files, sharding callback,
and the errors for missing / mis-shaped tensors. References are the PyTorch transformers models."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.numpy
import torch
from flax import nnx

from ragen_jax.models import ModelConfig
from ragen_jax.models.loading import (WEIGHT_TABLE, ModelFileError, from_hf_state_dict, load_gguf, load_hf, load_model,
                                      unpermute_qk)
from tests.models import torch_reference as ref

ATOL = 1e-4


def _logits(model, tokens):
    graphdef, state = nnx.split(model)
    positions = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    fn = jax.jit(lambda s, t, p: nnx.merge(graphdef, s)(t, p)[0])
    return np.asarray(fn(state, jnp.asarray(tokens), jnp.asarray(positions)))


TOKENS = np.random.default_rng(0).integers(0, ref.TINY["vocab_size"], size=(2, 9)).astype(np.int32)


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    model = ref.tiny_qwen2(seed=3)
    path = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(path)
    return model, path


def test_load_hf_directory(qwen2_dir):
    torch_model, path = qwen2_dir
    assert os.path.isfile(path / "model.safetensors")
    cfg, model = load_model(path)
    assert cfg.model_type == "qwen2" and cfg.qkv_bias
    np.testing.assert_allclose(_logits(model, TOKENS), ref.torch_logits(torch_model, TOKENS), atol=ATOL, rtol=0)


def test_load_sharded_bf16_directory_scan_layers(tmp_path):
    """A sharded bf16 checkpoint (index.json) into stacked layers: every weight equals the bf16 value."""
    torch_model = ref.tiny_llama(seed=4, tie_word_embeddings=False).to(torch.bfloat16)
    torch_model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    cfg, model = load_hf(tmp_path, scan_layers=True)
    assert model.embed_tokens.embedding[...].dtype == jnp.float32  # param_dtype default
    sd = torch_model.state_dict()
    np.testing.assert_array_equal(np.asarray(model.layers.self_attn.q_proj.kernel[...][1]),
                                  sd["model.layers.1.self_attn.q_proj.weight"].float().numpy().T)
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), sd["lm_head.weight"].float().numpy().T)
    expected = ref.torch_logits(torch_model.float(), TOKENS)
    np.testing.assert_allclose(_logits(model, TOKENS), expected, atol=ATOL, rtol=0)
    _, model16 = load_hf(tmp_path, param_dtype="bfloat16", dtype="bfloat16")
    assert model16.layers[0].mlp.up_proj.kernel[...].dtype == jnp.bfloat16


def test_missing_tensor_names_the_key(qwen2_dir, tmp_path):
    torch_model, src = qwen2_dir
    tensors = ref.state_dict_numpy(torch_model)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(KeyError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*layers\.1\.mlp\.up_proj\.kernel"):
        load_hf(tmp_path)


def test_misshaped_tensor_names_expected_and_got(qwen2_dir):
    torch_model, _ = qwen2_dir
    config = ref.hf_config_dict(torch_model)
    cfg = ModelConfig.from_hf_config({**config, "intermediate_size": 128})
    with pytest.raises(ValueError, match=r"down_proj\.weight.*expected shape \(64, 128\), got \(64, 96\)"):
        from_hf_state_dict(cfg, ref.state_dict_numpy(torch_model))


def test_unused_tensors_and_unsupported_architecture(qwen2_dir, tmp_path):
    torch_model, src = qwen2_dir
    tensors = {**ref.state_dict_numpy(torch_model), "model.extra.weight": np.zeros(3, np.float32)}
    cfg = ModelConfig.from_hf_config(ref.hf_config_dict(torch_model))
    with pytest.raises(ValueError, match="model.extra.weight"):
        from_hf_state_dict(cfg, tensors)
    from_hf_state_dict(cfg, tensors, strict=False)
    config = json.loads((src / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "mistral"}))
    with pytest.raises(ValueError, match="model_type.*mistral"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match=r"\.gguf"):
        load_model(tmp_path / "config.json")


def test_weight_table_covers_every_parameter():
    """Every parameter of a model with all optional tensors has exactly one table row."""
    cfg = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2,
                      num_kv_heads=1, head_dim=4, qkv_bias=True, o_bias=True, mlp_bias=True)
    from ragen_jax.models.decoder import Decoder
    from ragen_jax.models.loading import _table_entry
    state = nnx.state(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(state)]
    rows = {_table_entry(p)[0].ours for p in paths}
    assert rows == {r.ours for r in WEIGHT_TABLE}


def test_shard_fn_places_every_parameter(qwen2_dir):
    """The sharding callback sees every parameter path with its shape; arrays carry its sharding."""
    torch_model, path = qwen2_dir
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("fsdp",))
    seen = {}

    def shard_fn(name, shape):
        seen[name] = shape
        spec = jax.sharding.PartitionSpec("fsdp") if name.endswith("kernel") else jax.sharding.PartitionSpec()
        return jax.sharding.NamedSharding(mesh, spec)

    for scan in (False, True):
        seen.clear()
        cfg, model = load_hf(path, shard_fn=shard_fn, scan_layers=scan)
        flat = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(nnx.state(model))}
        assert set(seen) == set(flat)
        for name, var in flat.items():
            assert tuple(var.value.shape) == seen[name]
            P = jax.sharding.PartitionSpec
            assert var.value.sharding.spec == (P("fsdp") if name.endswith("kernel") else P())
    assert seen["layers.self_attn.q_proj.kernel"] == (cfg.num_layers, 64, 64)


def test_unpermute_inverts_llama_cpp_permutation():
    rng = np.random.default_rng(1)
    for heads, head_dim in [(4, 8), (3, 64)]:
        w = rng.standard_normal((heads * head_dim, 5)).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(ref.llama_cpp_permute(w, heads), heads), w)
        b = rng.standard_normal(heads * head_dim).astype(np.float32)
        np.testing.assert_array_equal(unpermute_qk(ref.llama_cpp_permute(b, heads), heads), b)
    # A hand-worked head of dim 4: llama.cpp orders rows (0, 2, 1, 3).
    np.testing.assert_array_equal(ref.llama_cpp_permute(np.arange(4.0), 1), [0.0, 2.0, 1.0, 3.0])


@pytest.mark.parametrize("quant", [None, "Q8_0"])
def test_load_gguf_matches_transformers(tmp_path, quant):
    """A Llama written as llama.cpp writes it (q/k permuted, optionally Q8_0): our logits equal the
    PyTorch model given the weights the file decodes to."""
    torch_model = ref.tiny_llama(seed=5, hidden_size=64, intermediate_size=96)
    decoded = ref.write_llama_gguf(torch_model, tmp_path / "tiny.gguf", quant=quant)
    cfg, model = load_model(tmp_path / "tiny.gguf")
    assert cfg.tie_word_embeddings and cfg.num_kv_heads == 2 and cfg.rope_theta == 100000.0
    expected = ref.torch_logits(ref.with_weights(torch_model, decoded), TOKENS)
    np.testing.assert_allclose(_logits(model, TOKENS), expected, atol=ATOL, rtol=0)


def test_load_qwen2_gguf_with_biases(tmp_path):
    """Qwen2 GGUFs keep HF's q/k row order and carry q/k/v biases."""
    torch_model = ref.tiny_qwen2(seed=7)
    decoded = ref.write_llama_gguf(torch_model, tmp_path / "qwen2.gguf")
    cfg, model = load_model(tmp_path / "qwen2.gguf")
    assert cfg.model_type == "qwen2" and cfg.qkv_bias and not cfg.tie_word_embeddings
    expected = ref.torch_logits(ref.with_weights(torch_model, decoded), TOKENS)
    np.testing.assert_allclose(_logits(model, TOKENS), expected, atol=ATOL, rtol=0)


def test_gguf_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        load_gguf(tmp_path / "absent.gguf")


# ---------------------------------------------------------------------------------------------------
# Tokenizers
# ---------------------------------------------------------------------------------------------------
TEXT = "What is the capital of France? <think>move</think><answer>Left || Up</answer> ünïcode √ 12"


@pytest.fixture(scope="module")
def bpe():
    return ref.tiny_bpe()


def _save_hf_tokenizer(bpe, path, template):
    import transformers
    tok, *_ = bpe
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                                bos_token="<|im_start|>")
    if template is not None:
        fast.chat_template = template
    fast.save_pretrained(path)


def test_tokenizer_from_hf_directory_and_chat_template_errors(bpe, tmp_path):
    from ragen_jax.models import load_tokenizer
    raw = bpe[0]
    _save_hf_tokenizer(bpe, tmp_path / "with", ref.QWEN_TEMPLATE)
    tok = load_tokenizer(tmp_path / "with")
    assert tok.encode(TEXT, add_special_tokens=False) == raw.encode(TEXT).ids
    assert tok.pad_token == "<|im_end|>"  # eos stands in for a missing pad
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"

    _save_hf_tokenizer(bpe, tmp_path / "without", None)
    with pytest.raises(ValueError, match=r"no chat template.*chat_template=.*\.jinja"):
        load_tokenizer(tmp_path / "without")
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    for template in (jinja, jinja.read_text()):
        tok = load_tokenizer(tmp_path / "without", chat_template=template)
        assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[user] hi\n"
    with pytest.raises(FileNotFoundError, match="no tokenizer"):
        load_tokenizer(tmp_path / "absent")


def test_tokenizer_from_gguf_metadata(bpe, tmp_path):
    """A GGUF with gpt2-style BPE metadata gives the same ids as the tokenizer it was written from."""
    from ragen_jax.models import load_tokenizer
    raw, vocab, merges, bos, eos = bpe
    torch_model = ref.tiny_llama(seed=6, vocab_size=len(vocab))
    ref.write_llama_gguf(torch_model, tmp_path / "tok.gguf", tokenizer=(vocab, merges, bos, eos),
                         chat_template=ref.QWEN_TEMPLATE)
    tok = load_tokenizer(tmp_path / "tok.gguf")
    assert tok.encode(TEXT, add_special_tokens=False) == raw.encode(TEXT).ids
    assert tok.decode(raw.encode(TEXT).ids) == TEXT
    assert (tok.bos_token_id, tok.eos_token_id) == (bos, eos)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert ids[0] == vocab["<|im_start|>"] and tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ref.write_llama_gguf(torch_model, tmp_path / "bare.gguf", tokenizer=(vocab, merges, bos, eos))
    with pytest.raises(ValueError, match="no chat template"):
        load_tokenizer(tmp_path / "bare.gguf")


@pytest.mark.parametrize("keep", [4, 40, "header", "half"])
def test_truncated_safetensors_names_the_file(qwen2_dir, tmp_path, keep):
    _, src = qwen2_dir
    data = (src / "model.safetensors").read_bytes()
    (n,) = np.frombuffer(data[:8], dtype="<u8")
    cut = {"header": 8 + int(n), "half": 8 + int(n) + (len(data) - 8 - int(n)) // 2}.get(keep, keep)
    (tmp_path / "model.safetensors").write_bytes(data[:cut])
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    with pytest.raises(ModelFileError) as e:
        load_hf(tmp_path)
    assert str(tmp_path / "model.safetensors") in str(e.value) and "truncated" in str(e.value)


def test_truncated_gguf_and_broken_config_json_name_the_file(qwen2_dir, tmp_path):
    ref.write_llama_gguf(ref.tiny_qwen2(seed=7), tmp_path / "full.gguf")
    data = (tmp_path / "full.gguf").read_bytes()
    for cut in (10, len(data) // 2):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelFileError) as e:
            load_gguf(tmp_path / "cut.gguf")
        assert str(tmp_path / "cut.gguf") in str(e.value) and "truncated" in str(e.value)
    _, src = qwen2_dir
    broken = tmp_path / "dir"
    broken.mkdir()
    (broken / "config.json").write_text((src / "config.json").read_text()[:40])
    with pytest.raises(ModelFileError, match=r"config\.json is not valid JSON"):  # launch's one-line model error
        load_hf(broken)
