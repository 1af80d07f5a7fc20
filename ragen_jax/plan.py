"""Memory planner: what one device holds during a run's rollout and StarPO update, without weights.

    python -m ragen_jax.plan --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-7b \
        --config.mesh.fsdp=8 --config.model.scan_layers=True --config.starpo.micro_batch_size=8

The model is built abstractly (``jax.eval_shape``: shapes and dtypes, no memory), the train state
is laid out by the run's own partition rules on ``config.mesh``, and the run's two compiled
programs — the rollout (sampler, KV cache and vmapped envs in one program) and the update (log-probs,
SNR filter, advantages, MI proxy, PPO/GRPO epochs) — are lowered and compiled ahead of time for
simulated CPU devices of the mesh's shape. Their memory analysis gives the per-device bytes XLA
assigned; parameters, optimizer states and the KV cache are added up from their shards. A device's
peak is the larger of the two phases (the train state lives through both):

    rollout  train state + the rollout program's temporaries (KV cache, activations) + trajectory
    update   the update program's arguments + temporaries + outputs - donated (aliased) buffers

Figures are estimates: they come from XLA's CPU compiler, whose fusion and buffer reuse differ from a
GPU's or TPU's, and exclude the framework's reserve (JAX pre-allocates 75% of a GPU by default:
``XLA_PYTHON_CLIENT_MEM_FRACTION=.95`` raises it). "fits" below means peak <= 90% of the device.
With ``model.dtype=bfloat16`` they are pessimistic: the CPU backend runs some bfloat16 operations in
float32 and keeps float32 copies of their operands (seen for Qwen2.5-3B: a float32 copy of the whole
19 GB KV cache in the rollout's temporaries), which a GPU or TPU program does not need.

Presets plan without their files: the Qwen2.5 architectures are written out below (their
``config.json`` values; ``model.path`` with a config.json overrides), SmolLM2's is read from the
GGUF's header. Prompts are tokenised by the tiny preset's tokenizer (the layout only depends on
``rollout.max_seq_len`` and the batch shape, not on the token ids).
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import Any

import gguf
import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags

from ragen_jax.config import ConfigError, resolve
from ragen_jax.models import Critic, Decoder, ModelConfig, ValueHead, smollm2_gguf_path
from ragen_jax.models.kv_cache import init_cache
from ragen_jax.models.loading import gguf_config_dict
from ragen_jax.models.presets import load_tiny_tokenizer, tiny_model_config
from ragen_jax.models.sharding import cache_shardings, replicated_axes
from ragen_jax.rollout.loop import Rollout
from ragen_jax.starpo.update import init_train_state, make_update_step
from ragen_jax.training.build import build_env
from ragen_jax.training.run import make_placement

# Architectures of the pretrained presets (their HF config.json), so a plan needs no download.
ARCHITECTURES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-3b": dict(hidden_size=2048, intermediate_size=11008, num_hidden_layers=36, num_attention_heads=16,
                       num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
}
_QWEN2 = dict(model_type="qwen2", vocab_size=151936, rope_theta=1000000.0, rms_norm_eps=1e-6,
              max_position_embeddings=32768, hidden_act="silu")

ACCELERATORS = (("TPU v5e", 16e9), ("A100/H100 80GB", 80e9), ("H200", 141e9))
USABLE = 0.9  # of a device's memory: what XLA may plan to use


def model_config(spec):
    """The preset's ``ModelConfig`` from its architecture alone (no weights read)."""
    m = spec.model
    knobs = m.knobs
    preset = m.preset
    if preset == "tiny":
        return tiny_model_config(load_tiny_tokenizer(), m.tiny_dims, **knobs)
    if m.path and os.path.isfile(os.path.join(m.path, "config.json")):
        return ModelConfig.from_hf_config(m.path, **knobs)
    if preset == "smollm2_135m":
        return ModelConfig.from_hf_config(gguf_config_dict(gguf.GGUFReader(m.path or smollm2_gguf_path())), **knobs)
    return ModelConfig.from_hf_config({**_QWEN2, **ARCHITECTURES[preset]}, **knobs)


def _shard_bytes(abstract) -> int:
    """Bytes one device holds of a pytree of sharded ``ShapeDtypeStruct``s (the largest shard)."""
    total = 0
    for x in jax.tree.leaves(abstract):
        shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
        total += math.prod(shape) * x.dtype.itemsize
    return total


class _Programs:
    """The run's two programs and the abstract state they take, laid out on ``placement``."""

    def __init__(self, spec, placement):
        self.cfg = cfg = model_config(spec)
        mode = spec.starpo.critic_mode
        graphdefs = {}

        def build(key):
            """The train state with random weights from ``key``. The key is an argument, never a
            constant: XLA's GPU compiler would fold constant-keyed initialisers at compile time."""
            policy = Decoder(cfg, rngs=nnx.Rngs(key))
            critic = {"shared": lambda: ValueHead(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1))),
                      "separate": lambda: Critic(cfg, rngs=nnx.Rngs(jax.random.fold_in(key, 1)))
                      }.get(mode, lambda: None)()
            graphdefs["g"], state = init_train_state(policy, spec.starpo, key=jax.random.fold_in(key, 2),
                                                     critic=critic)
            return state

        self.build = build
        self.shapes = jax.eval_shape(build, jax.random.key(0))
        self.shardings = placement.state_shardings(self.shapes)
        self.state = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), self.shapes,
                                  self.shardings)
        gd = graphdefs["g"]
        tokenizer = load_tiny_tokenizer()
        env, env_params = build_env(spec, tokenizer)
        self.rollout = Rollout(gd.policy, env, env_params, tokenizer, spec.rollout, placement=placement)
        self.key = jax.ShapeDtypeStruct((), jax.eval_shape(lambda: jax.random.key(0)).dtype,
                                        sharding=placement.replicated)
        traj = jax.eval_shape(self.rollout._rollout_from_key, self.state.params, self.key, None)
        self.traj = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), traj,
                                 placement.batch_shardings(traj))
        self.update = make_update_step(gd, spec.starpo, spec.filter, spec.collapse, group_size=spec.rollout.group_size,
                                       shared_prefix_len=len(self.rollout.codec.preamble_ids),
                                       per_turn_rows=self.rollout.per_turn_rows, placement=placement,
                                       state_shardings=self.shardings, reply_tokens=spec.rollout.max_new_tokens)


def plan(spec, placement=None, *, keep_programs: bool = False):
    """Per-device bytes of ``spec``'s run on ``placement`` (default: its ``config.mesh``; the
    devices must already exist). ``keep_programs``: return ``(figures, compiled)`` so that
    ``measure`` runs the very executables planned, without compiling them again."""
    placement = placement or make_placement(spec)
    programs = _Programs(spec, placement)
    cfg, state, traj = programs.cfg, programs.state, programs.traj
    rollout_exe = programs.rollout._run_from_key.lower(state.params, programs.key, None).compile()
    update_exe = programs.update.lower(state, traj).compile()

    cache = jax.eval_shape(lambda: init_cache(cfg, spec.rollout.batch_size, programs.rollout.cache_len))
    cache = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), cache,
                         cache_shardings(cache, placement.mesh))
    r, u = rollout_exe.memory_analysis(), update_exe.memory_analysis()
    out = {
        "policy_params": _shard_bytes(state.params),
        "critic_params": _shard_bytes(state.critic_params),
        "reference_params": _shard_bytes(state.ref_params),
        "optimizer_states": _shard_bytes((state.opt_state, state.critic_opt_state)),
        "kv_cache": _shard_bytes(cache),
        "trajectory": _shard_bytes(traj),
        "rollout_temporaries": r.temp_size_in_bytes,
        "update_temporaries": u.temp_size_in_bytes,
    }
    out["train_state"] = _shard_bytes(state)
    out["rollout_peak"] = out["train_state"] + r.temp_size_in_bytes + r.output_size_in_bytes
    out["update_peak"] = (u.argument_size_in_bytes + u.temp_size_in_bytes + u.output_size_in_bytes
                          - u.alias_size_in_bytes)
    out["peak"] = max(out["rollout_peak"], out["update_peak"])
    out["devices"] = placement.mesh.size
    out["mesh"] = dict(placement.mesh.shape)
    out["num_parameters"] = sum(math.prod(x.shape) for x in jax.tree.leaves(state.params))
    out["warnings"] = mesh_warnings(cfg, programs.shapes.params, placement.mesh)
    return (out, (programs, placement, rollout_exe, update_exe)) if keep_programs else out


def measure(compiled) -> dict[str, float | None]:
    """Run the planned programs (``plan(..., keep_programs=True)``'s ``compiled``) once on the local
    devices with random weights (initialised in place, sharded) and read what the device allocator
    saw: ``peak_bytes_in_use`` after the rollout and after the update, per device (the largest over
    local devices). ``None`` where the backend keeps no statistics (XLA's CPU client)."""
    programs, placement, rollout_exe, update_exe = compiled

    def peak():
        stats = [d.memory_stats() or {} for d in jax.local_devices()]
        values = [s["peak_bytes_in_use"] for s in stats if "peak_bytes_in_use" in s]
        return max(values) if values else None

    key = jax.device_put(jax.random.key(0), placement.replicated)
    state = jax.jit(programs.build, out_shardings=programs.shardings)(key)
    traj = jax.block_until_ready(rollout_exe(state.params, key, None))
    after_rollout = peak()
    state, _ = update_exe(state, traj)
    jax.block_until_ready(state)
    return {"rollout_peak": after_rollout, "peak": peak(), "devices": placement.mesh.size,
            "device_kind": jax.local_devices()[0].device_kind}


def mesh_warnings(cfg, params, mesh) -> list[str]:
    """What the mesh asks for that the model cannot use: an axis that divides none (or only some) of
    the dimensions the partition rules shard along it replicates those weights instead, so the plan's
    per-device figures hold copies the user may have meant to split."""
    warnings = []
    total = sum(math.prod(x.shape) for x in jax.tree.leaves(params))  # the weights share one dtype
    for axis, arrays in replicated_axes(params, mesh).items():
        size = mesh.shape[axis]
        nbytes = sum(math.prod(shape) for _, shape in arrays)
        example = ", ".join(f"{name} {list(shape)}" for name, shape in arrays[:2])
        warnings.append(f"mesh.{axis}={size} does not divide the dimension it would split in {len(arrays)} parameter "
                        f"arrays ({nbytes / max(total, 1):.0%} of the weights, e.g. {example}): they are replicated "
                        f"over '{axis}' instead, on every one of its {size} devices. Use a size that divides them")
    tensor = mesh.shape.get("tensor", 1)
    if tensor > 1 and (cfg.num_heads % tensor or cfg.num_kv_heads % tensor):
        warnings.append(f"mesh.tensor={tensor} does not divide the {cfg.num_heads} attention heads "
                        f"({cfg.num_kv_heads} key/value heads): a head's projections straddle devices or stay "
                        f"replicated; use a mesh.tensor that divides {math.gcd(cfg.num_heads, cfg.num_kv_heads)}")
    return warnings


def report(spec, figures: dict) -> str:
    """The plan as a table, with which accelerator the peak fits."""
    m, s = figures["mesh"], spec.starpo
    r = spec.rollout

    def gb(b):
        return f"{b / 1e9:9.2f} GB"

    head = (f"{spec.model.preset} ({figures['num_parameters'] / 1e9:.2f}B parameters, "
            f"{spec.model.param_dtype} weights, {spec.model.dtype} compute), "
            f"{s.adv_estimator} critic={s.critic_mode}, rollout {r.num_groups} groups × {r.group_size}, "
            f"{r.max_turns} turns, max_seq_len {r.max_seq_len}; mesh data {m['data']} × fsdp {m['fsdp']} × "
            f"tensor {m['tensor']} = {figures['devices']} devices. Per device:")
    rows = [("policy parameters", "policy_params"), ("critic parameters", "critic_params"),
            ("reference parameters", "reference_params"), ("optimizer states", "optimizer_states"),
            ("KV cache (in rollout temporaries)", "kv_cache"), ("trajectory", "trajectory"),
            ("rollout temporaries", "rollout_temporaries"), ("update temporaries", "update_temporaries"),
            ("peak during the rollout", "rollout_peak"), ("peak during the update", "update_peak"),
            ("peak", "peak")]
    lines = [head] + [f"  {label:<36}{gb(figures[key])}" for label, key in rows]
    for name, capacity in ACCELERATORS:
        verdict = "fits" if figures["peak"] <= USABLE * capacity else "does not fit"
        lines.append(f"  {name:<36}{verdict} ({figures['peak'] / capacity:.0%} of {capacity / 1e9:.0f} GB)")
    lines += [f"Warning: {w}." for w in figures.get("warnings", ())]
    return "\n".join(lines)


def measured_report(figures: dict, measured: dict) -> str:
    """The plan's peaks beside the allocator's, as predicted / measured."""
    if measured.get("peak") is None:
        return f"  measured on {measured['device_kind']}: n/a (this backend keeps no allocator statistics)"
    lines = [f"Measured on {measured['devices']} × {measured['device_kind']} (peak bytes in use, largest device):"]
    for label, key, predicted in (("after the rollout", "rollout_peak", figures["rollout_peak"]),
                                  ("after the update (whole run)", "peak", figures["peak"])):
        got = measured[key]
        lines.append(f"  {label:<36}{got / 1e9:9.2f} GB   predicted / measured {predicted / got:.2f}")
    return "\n".join(lines)


def _mesh_devices(config, default: int) -> int:
    sizes = [int(config.mesh[k]) for k in ("data", "fsdp", "tensor")]
    return math.prod(sizes) if -1 not in sizes else default


def main(argv: list[str] | None = None) -> None:
    config_flag = config_flags.DEFINE_config_file("config", None, "A run's config file (configs/*.py).",
                                                  lock_config=False)
    devices_flag = flags.DEFINE_integer("devices", 8, "Simulated devices when a mesh axis is -1.")
    json_flag = flags.DEFINE_string("json", None, "Also write the figures (bytes) to this JSON file.")
    measure_flag = flags.DEFINE_boolean("measure", False, "Plan for the local devices (an accelerator's own compiler) "
                                        "and then run both programs once with random weights to measure their peak.")

    def run(_):
        config = config_flag.value
        n = _mesh_devices(config, devices_flag.value)
        if not measure_flag.value:
            # Simulated CPU devices, set before jax starts its backend (the config file only imports it).
            os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}"
            jax.config.update("jax_platforms", "cpu")
        try:
            spec = resolve(config, model_files=False)  # the architecture is enough
            figures, compiled = plan(spec, keep_programs=True)
            print(report(spec, figures))
            measured = measure(compiled) if measure_flag.value else None
            if measured is not None:
                print(measured_report(figures, measured))
            if json_flag.value:
                with open(json_flag.value, "w") as f:
                    json.dump({"figures": figures, "measured": measured, "preset": spec.model.preset,
                               "mesh": spec.mesh.shape, "adv_estimator": spec.starpo.adv_estimator,
                               "critic": spec.starpo.critic_mode, "platform": jax.devices()[0].platform}, f)
        except ConfigError as e:
            print(f"Configuration error: {e}", file=sys.stderr)
            sys.exit(2)

    app.run(run, argv=argv)


if __name__ == "__main__":
    main()
