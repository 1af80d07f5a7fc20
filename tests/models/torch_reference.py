"""Tiny random transformers (PyTorch, fp32) models: the independent reference for decoder parity tests."""
from __future__ import annotations

import numpy as np
import torch
import transformers

TINY = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_qwen2(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """Qwen2ForCausalLM with q/k/v bias, GQA 4:2, untied head unless overridden. Seeded: reproducible."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**{**TINY, "rope_theta": 10000.0, "tie_word_embeddings": False, **overrides})
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    _randomise_biases_and_norms(model, seed)
    return model


def tiny_llama(seed: int = 0, **overrides) -> transformers.PreTrainedModel:
    """LlamaForCausalLM, GQA 4:2, tied embeddings unless overridden (like SmolLM2). Seeded."""
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(**{**TINY, "rope_theta": 100000.0, "tie_word_embeddings": True, **overrides})
    model = transformers.LlamaForCausalLM(cfg).eval()
    _randomise_biases_and_norms(model, seed)
    return model


def _randomise_biases_and_norms(model, seed: int) -> None:
    """HF initialises biases to 0 and norm weights to 1; randomise them so a wrong mapping shows up."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))


def hf_config_dict(model) -> dict:
    return model.config.to_dict()


def state_dict_numpy(model) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def torch_logits(model, tokens: np.ndarray, positions: np.ndarray | None = None) -> np.ndarray:
    """Logits float32 [B, T, V] of the PyTorch model, no padding, given explicit positions."""
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(tokens), dtype=torch.long)
        pos = None if positions is None else torch.as_tensor(np.asarray(positions), dtype=torch.long)
        return model(input_ids=ids, position_ids=pos).logits.float().numpy()


def bf16_matmul_copy(model) -> torch.nn.Module:
    """A float32 copy of ``model`` computed as bfloat16-operand matmuls with float32 results: every
    parameter rounded to bfloat16 (kept in float32), and every ``nn.Linear`` (projections, MLP, LM head)
    rounding its input to bfloat16 first. A product of two bfloat16 numbers is exact in float32, so
    float32 matmuls of the rounded values are bfloat16 matmuls accumulated in float32; everything else
    (norms, RoPE, softmax, residual adds) stays float32."""
    import copy

    out = copy.deepcopy(model)
    with torch.no_grad():
        for p in out.parameters():
            p.copy_(p.to(torch.bfloat16).float())

    def round_input(_module, args):
        return (args[0].to(torch.bfloat16).float(),) + tuple(args[1:])

    for module in out.modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(round_input)
    return out


def torch_greedy(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy continuation ids [B, new_tokens] with transformers' own generate (its own KV cache)."""
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:].numpy()


# ---------------------------------------------------------------------------------------------------
# GGUF files written the way llama.cpp's converter writes a Llama checkpoint
# ---------------------------------------------------------------------------------------------------
def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows: within each head, rows (i, Hd/2 + i) become
    neighbours (2i, 2i + 1), for its interleaved-pair RoPE."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight", "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight", "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    "self_attn.q_proj.bias": "attn_q.bias", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
}


def write_llama_gguf(model, path, *, quant: str | None = None, tokenizer=None, chat_template=None) -> dict:
    """Write a transformers Llama or Qwen2 model as llama.cpp's converter does (Llama: q/k rows
    permuted; Qwen2: stored as is, it uses rotate_half RoPE natively), F32 or with 2-D weights
    quantised to `quant` (e.g. "Q8_0").

    tokenizer: optional (vocab dict, merges list of "a b", bos_id, eos_id) for a gpt2-style BPE.
    Returns the HF-named float32 tensors the file decodes to (quantisation round-trip included), so
    the reference PyTorch model can be given exactly the weights the file holds.
    """
    import gguf

    cfg = model.config
    arch = cfg.model_type
    permute = arch == "llama"
    w = gguf.GGUFWriter(str(path), arch=arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer is not None:
        vocab, merges, bos, eos = tokenizer
        tokens = sorted(vocab, key=vocab.get)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        w.add_token_types([3 if t.startswith("<|") else 1 for t in tokens])
        w.add_token_merges(merges)
        w.add_bos_token_id(bos)
        w.add_eos_token_id(eos)
        w.add_pad_token_id(eos)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    decoded = {}
    for name, t in model.state_dict().items():
        x = t.detach().float().numpy()
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        short = name.split(".", 3)[-1] if name.startswith("model.layers.") else name
        gname = _GGUF_NAMES[short]
        if name.startswith("model.layers."):
            gname = f"blk.{name.split('.')[2]}.{gname}"
        if permute and short == "self_attn.q_proj.weight":
            stored = llama_cpp_permute(x, cfg.num_attention_heads)
        elif permute and short == "self_attn.k_proj.weight":
            stored = llama_cpp_permute(x, cfg.num_key_value_heads)
        else:
            stored = x
        if quant is not None and x.ndim == 2:
            qtype = getattr(gguf.GGMLQuantizationType, quant)
            q = gguf.quants.quantize(stored, qtype)
            w.add_tensor(gname, q, raw_dtype=qtype)
            # Row permutation commutes with row-wise block quantisation: the un-permuted round trip.
            x = gguf.quants.dequantize(gguf.quants.quantize(x, qtype), qtype)
        else:
            w.add_tensor(gname, stored.astype(np.float32))
        decoded[name] = x
    if cfg.tie_word_embeddings:
        decoded["lm_head.weight"] = decoded["model.embed_tokens.weight"]
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return decoded


def with_weights(model, tensors: dict[str, np.ndarray]):
    """The same PyTorch model with its weights replaced (e.g. by a GGUF file's dequantised ones)."""
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict({k: torch.as_tensor(v) for k, v in tensors.items()}, strict=True)
    return clone.eval()


QWEN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_bpe(vocab_size: int = 300):
    """A byte-level BPE trained (deterministically) on a few sentences, with chat special tokens.

    Returns (tokenizers.Tokenizer, vocab dict, merges as "a b" strings, bos id, eos id).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ["What is the capital of France? Paris is the capital of France.",
              "The player pushes the box onto the target. Up, Down, Left, Right.",
              "<think>I should move left.</think><answer>Left</answer>"] * 20
    tok.train_from_iterator(corpus, trainer)
    data = __import__("json").loads(tok.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    vocab = tok.get_vocab()
    return tok, vocab, merges, vocab["<|im_start|>"], vocab["<|im_end|>"]
