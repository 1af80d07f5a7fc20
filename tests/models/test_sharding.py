"""Sharding: partition rules (in-process) and sharded forward / decode on 8 simulated CPU devices.

The multi-device checks live in ``sharding_check.py`` and run in a subprocess, because the CPU device
count is fixed when jax is first imported.
"""
import os
import subprocess
import sys

import jax
import pytest
from jax.sharding import PartitionSpec as P

from ragen_jax.models.sharding import DEFAULT_RULES, make_mesh, partition_spec, path_to_name

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _run_check(*flags):
    env = dict(os.environ)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    proc = subprocess.run([sys.executable, os.path.join(HERE, "sharding_check.py"), *flags], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc.stdout


def test_sharded_forward_and_decode_match_unsharded_on_8_devices():
    out = _run_check()
    assert "ok activation constraint" in out and "ok scan_layers=False" in out, out


@pytest.mark.slow
def test_sharded_scan_layers_tied_model_on_8_devices():
    out = _run_check("--scan")
    assert "ok scan_layers=True tie=True" in out, out


class _FakeMesh:
    """Just the axis sizes; partition_spec only reads mesh.shape."""

    def __init__(self, **shape):
        self.shape = shape


def test_rules_by_name_right_aligned_and_divisibility():
    mesh = _FakeMesh(data=2, fsdp=4, tensor=2)
    assert partition_spec("layers.3.self_attn.q_proj.kernel", (64, 128), mesh) == P("fsdp", "tensor")
    assert partition_spec("layers/3/mlp/down_proj/kernel", (256, 64), mesh) == P("tensor", "fsdp")
    # Stacked layers (scan_layers): the leading [L] axis stays unsharded.
    assert partition_spec("layers/self_attn/o_proj/kernel", (6, 128, 64), mesh) == P(None, "tensor", "fsdp")
    # A dim the axis does not divide is replicated instead of failing.
    assert partition_spec("layers/0/self_attn/k_proj/kernel", (64, 15), mesh) == P("fsdp", None)
    assert partition_spec("embed_tokens.embedding", (49152, 576), mesh) == P("tensor", "fsdp")
    assert partition_spec("norm/scale", (64,), mesh) == P(None)
    assert partition_spec("value_head/score/kernel", (64, 1), mesh) == P("fsdp", None)
    # Multi-axis entries shrink to the prefix that divides.
    assert partition_spec("x", (6, 4), mesh, [(r"x", P(("data", "fsdp"), None))]) == P("data", None)


def test_unmatched_parameter_names_the_path():
    mesh = _FakeMesh(data=1, fsdp=1, tensor=1)
    with pytest.raises(ValueError, match="mystery/weight"):
        partition_spec("mystery/weight", (4, 4), mesh)
    assert partition_spec("mystery/weight", (4, 4), mesh, strict=False) == P(None, None)
    rules = tuple(DEFAULT_RULES) + ((r".*", P()),)
    assert partition_spec("mystery/weight", (4, 4), mesh, rules) == P(None, None)


def test_path_forms():
    key_path = (jax.tree_util.DictKey("layers"), jax.tree_util.SequenceKey(0), jax.tree_util.GetAttrKey("value"))
    assert path_to_name(key_path) == "layers/0"
    assert path_to_name("a.b/c") == "a/b/c"


def test_make_mesh_errors_are_explicit():
    n = jax.device_count()
    with pytest.raises(ValueError, match="xla_force_host_platform_device_count"):
        make_mesh(data=n + 1)
    with pytest.raises(ValueError, match="at most one -1"):
        make_mesh(data=-1, fsdp=-1)
    mesh = make_mesh(fsdp=-1)
    assert mesh.axis_names == ("data", "fsdp", "tensor") and mesh.shape["fsdp"] == n
