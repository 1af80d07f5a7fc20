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


def torch_greedy(model, prompt: np.ndarray, new_tokens: int) -> np.ndarray:
    """Greedy continuation ids [B, new_tokens] with transformers' own generate (its own KV cache)."""
    with torch.no_grad():
        ids = torch.as_tensor(np.asarray(prompt), dtype=torch.long)
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, ids.shape[1]:].numpy()
