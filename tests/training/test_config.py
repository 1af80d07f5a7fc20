"""Config validation: every bad key or value fails with one message naming the key and the fix."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from configs import bandit, base, frozen_lake
from configs import sokoban_ragen as sokoban  # RAGEN's defaults
from ragen_jax.config import ConfigError, resolve

ROOT = Path(__file__).resolve().parents[2]


def _resolve(cfg):
    return resolve(cfg)


def test_presets_and_defaults():
    s = _resolve(sokoban.get_config())
    # RAGEN's defaults: 8 groups × 16, 5 turns, 2 actions/turn, 10 per episode.
    r = s.rollout
    assert (r.num_groups, r.group_size, r.max_turns, r.max_actions_per_turn, r.max_actions_per_traj) == (8, 16, 5, 2, 10)
    assert (s.starpo.clip_ratio_low, s.starpo.clip_ratio_high, s.starpo.clip_ratio_c) == (0.2, 0.28, 3.0)
    assert s.starpo.entropy_coeff == 0.001 and s.starpo.mini_batch_size == 32
    assert s.filter.value == 1.0  # filter off by default
    assert s.env_kwargs == {"dim_room": (6, 6), "num_boxes": 1, "observation_format": "grid"}
    # Placeholders resolve to the preset's learning rate; an explicit value is kept.
    assert s.starpo.actor_lr == 1e-3  # tiny preset
    cfg = sokoban.get_config()
    cfg.starpo.actor_lr = 5e-5
    assert _resolve(cfg).starpo.actor_lr == 5e-5
    fl = _resolve(frozen_lake.get_config())
    assert fl.env_param_kwargs == {"p": 0.9, "success_rate": 1.0}
    assert fl.env_kwargs == {"size": 4, "observation_format": "grid", "expert_reasoning": "before_move"}
    b = _resolve(bandit.get_config())
    assert b.rollout.max_turns == 1
    # The model's knobs reach its ModelConfig (mixed precision: bf16 matmul operands, float32 compute).
    from ragen_jax.plan import model_config
    cfg = frozen_lake.get_config()
    cfg.model.matmul_dtype = "bfloat16"
    mc = model_config(_resolve(cfg))
    assert (mc.dtype, mc.matmul_dtype, str(mc.matmul_operand_dtype)) == ("float32", "bfloat16", "bfloat16")
    # RAGEN's payouts, listed so that --config.env.* can change them
    assert b.env_param_kwargs == {"lo_arm_score": 0.1, "hi_arm_loscore": 0.0, "hi_arm_hiscore": 1.0,
                                  "hi_arm_hiscore_prob": 0.25}


def test_pretrained_presets_use_original_learning_rates(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    cfg = sokoban.get_config()
    cfg.model.preset = "qwen2.5-0.5b"
    cfg.model.path = str(tmp_path)
    s = _resolve(cfg)
    assert (s.starpo.actor_lr, s.starpo.critic_lr) == (1e-6, 1e-5)


def test_a_plan_resolves_a_pretrained_preset_without_its_files():
    """``resolve(config, model_files=False)`` (the memory planner): a Qwen2.5 preset with no model.path
    keeps its own name and RAGEN's learning rates (actor 1e-6, critic 1e-5), and the planner reads its
    architecture from Qwen2.5-0.5B's config.json values (hidden 896, 24 layers, 14 / 2 heads)."""
    from ragen_jax.plan import model_config

    cfg = sokoban.get_config()
    cfg.model.preset = "qwen2.5-0.5b"
    with pytest.raises(ConfigError, match="model.path is required"):
        resolve(cfg)
    s = resolve(cfg, model_files=False)
    assert s.model.preset == "qwen2.5-0.5b" and s.config.model.preset == "qwen2.5-0.5b"
    assert (s.starpo.actor_lr, s.starpo.critic_lr) == (1e-6, 1e-5)
    mc = model_config(s)
    assert (mc.hidden_size, mc.num_layers, mc.num_heads, mc.num_kv_heads) == (896, 24, 14, 2)


@pytest.mark.parametrize("mutate, expected", [
    (lambda c: setattr(c.model, "preset", "qwen2.5-0.5"), ["model.preset", "tiny", "qwen2.5-0.5b"]),
    (lambda c: setattr(c.model, "preset", "qwen2.5-3b"), ["model.path is required", "--config.model.path"]),
    (lambda c: (setattr(c.model, "preset", "qwen2.5-7b"), setattr(c.model, "path", "/nonexistent/dir")),
     ["model.path='/nonexistent/dir'", "config.json"]),
    (lambda c: setattr(c.starpo, "adv_estimator", "ppo2"), ["ppo2", "gae", "grpo"]),
    (lambda c: setattr(c.filter, "strategy", "top_q"), ["top_q", "top_p", "min_p"]),
    (lambda c: setattr(c.starpo, "mini_batch_size", 48), ["mini_batch_size", "128"]),
    (lambda c: setattr(c.env, "name", "minesweeper"), ["env.name", "frozen_lake", "sokoban"]),
    (lambda c: setattr(c, "mode", "serve"), ["mode", "train", "eval"]),
    (lambda c: setattr(c.model, "dtype", "float16"), ["model.dtype", "bfloat16"]),
    (lambda c: (setattr(c.model, "dtype", "bfloat16"), setattr(c.model, "matmul_dtype", "float32")),
     ["model.matmul_dtype='float32'", "--config.model.matmul_dtype=bfloat16"]),
    (lambda c: setattr(c.eval, "temperature", -1.0), ["eval.temperature"]),
    (lambda c: setattr(c.rollout, "context_mode", "window"), ["context_mode='window'", "'limited'", "'full'"]),
    # Settings that would train on nothing while the run "succeeds": refused at start-up.
    (lambda c: (setattr(c.starpo, "adv_estimator", "grpo"), setattr(c.rollout, "group_size", 1),
                setattr(c.starpo, "mini_batch_size", 8)), ["adv_estimator='grpo'", "rollout.group_size=1"]),
    (lambda c: (setattr(c.starpo, "adv_estimator", "gae"), setattr(c.rollout, "group_size", 1),
                setattr(c.filter, "include_zero", False), setattr(c.starpo, "mini_batch_size", 8)),
     ["rollout.group_size=1", "filter.include_zero=True"]),
    (lambda c: setattr(c.filter, "value", 0.0), ["filter.value=0.0", "top_p", "keeps no group"]),
    (lambda c: (setattr(c.filter, "strategy", "min_p"), setattr(c.filter, "value", 1.5)),
     ["filter.value=1.5", "min_p", "[0, 1]"]),
    (lambda c: setattr(c.starpo, "gigpo_norm", "median"), ["gigpo_norm='median'", "mean", "std"]),
    (lambda c: setattr(c.starpo, "policy_loss", "gspo2"), ["gspo2", "gspo", "geo_mean"]),
    (lambda c: setattr(c.trainer, "gradient_analysis_buckets", "deciles"), ["deciles", "quantile", "fixed_rv"]),
])
def test_invalid_values_name_key_and_allowed(mutate, expected):
    _assert_refused(sokoban.get_config(), mutate, expected)


def _assert_refused(cfg, mutate, expected):
    """``mutate(cfg)`` makes ``resolve`` fail with a message holding every fragment of ``expected``."""
    with cfg.unlocked():
        mutate(cfg)
    with pytest.raises(ConfigError) as e:
        _resolve(cfg)
    for fragment in expected:
        assert fragment in str(e.value), (fragment, str(e.value))


def test_unknown_env_key_lists_allowed():
    cfg = sokoban.get_config()
    with cfg.unlocked():
        cfg.env.dim_rooms = (6, 6)
    with pytest.raises(ConfigError, match=r"env\.dim_rooms.*dim_room"):
        _resolve(cfg)


def test_unknown_section_key_lists_allowed():
    cfg = sokoban.get_config()
    with cfg.unlocked():
        cfg.starpo.clip_ratio = 0.2
    with pytest.raises(ConfigError, match=r"starpo\.clip_ratio.*clip_ratio_low"):
        _resolve(cfg)


def test_warmup_requires_an_expert():
    from configs import metamathqa  # a text env: no solver to imitate

    cfg = metamathqa.get_config()
    cfg.warmup.steps = 5
    with pytest.raises(ConfigError, match="warmup.steps"):
        _resolve(cfg)
    cfg = bandit.get_config()  # the Bandit has one (the high-risk arm)
    cfg.warmup.steps = 5
    assert _resolve(cfg).config.warmup.steps == 5


def _launch(*args):
    return subprocess.run([sys.executable, "-m", "ragen_jax.launch", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_unknown_override_is_explained():
    # A typo in a command-line override: the message names the key, suggests the close match and
    # lists the section's keys (absl's own message only says the flag is unknown).
    p = _launch("--config", "configs/sokoban.py", "--config.rollout.num_group=4")
    assert p.returncode == 2
    assert "unknown config key 'rollout.num_group'" in p.stderr and "num_groups" in p.stderr


def test_cli_invalid_choice_is_one_clear_error():
    p = _launch("--config", "configs/sokoban.py", "--config.model.preset=qwen2.5-3b")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines()[-1].startswith("Configuration error: model.path is required")


def test_base_config_sections():
    c = base.get_config()
    assert set(c.keys()) >= {"env", "model", "rollout", "starpo", "filter", "collapse", "trainer", "warmup",
                             "eval", "mode"}


def test_cli_requires_a_config_file():
    p = _launch()
    assert p.returncode == 2 and "--config is required" in p.stderr


@pytest.mark.parametrize("mutate, expected", [
    # Typos inside a config file (not only on the command line) are errors with the close match.
    (lambda c: setattr(c.trainer, "total_step", 3), ["trainer.total_step", "did you mean trainer.total_steps"]),
    (lambda c: setattr(c.eval, "num_episode", 4), ["eval.num_episode", "did you mean eval.num_episodes"]),
    (lambda c: setattr(c.warmup, "stpes", 4), ["warmup.stpes", "did you mean warmup.steps"]),
    (lambda c: setattr(c.model, "presets", "tiny"), ["model.presets", "did you mean model.preset"]),
    (lambda c: setattr(c.model.tiny, "hidden", 32), ["model.tiny.hidden", "hidden_size"]),
    (lambda c: setattr(c, "sed", 3), ["sed", "did you mean", "seed"]),
    # Values that used to change training silently.
    (lambda c: setattr(c.rollout, "temperature", 0.0), ["rollout.temperature=0.0", "greedy", "eval.temperature=0"]),
    (lambda c: setattr(c.rollout, "temperature", -0.5), ["rollout.temperature", "greedy"]),
    (lambda c: setattr(c.rollout, "top_p", 1.5), ["top_p=1.5", "(0, 1]"]),
    (lambda c: setattr(c.rollout, "top_p", 0.0), ["top_p=0.0", "(0, 1]"]),
    (lambda c: setattr(c.starpo, "micro_batch_size", 5), ["micro_batch_size=5", "mini-batch of 16", "[1, 2, 4, 8, 16]"]),
    (lambda c: setattr(c.starpo, "num_mini_batches", 3), ["mini_batch_size=16 and starpo.num_mini_batches=3"]),
    (lambda c: setattr(c.trainer, "save_every", 0), ["trainer.save_every=0"]),
    (lambda c: setattr(c.trainer, "time_limit_minutes", -1.0), ["trainer.time_limit_minutes"]),
    (lambda c: setattr(c.warmup, "action_noise", 1.5), ["warmup.action_noise"]),
    (lambda c: setattr(c.eval, "pass_k", 0), ["eval.pass_k"]),
])
def test_config_file_mistakes_fail_at_start_up(mutate, expected):
    _assert_refused(frozen_lake.get_config(), mutate, expected)


def test_num_mini_batches_on_the_command_line_replaces_the_files_mini_batch_size():
    from ragen_jax.launch import apply_exclusive_overrides

    cfg = frozen_lake.get_config()
    cfg.starpo.num_mini_batches = 4
    notes = apply_exclusive_overrides(cfg, ["launch", "--config.starpo.num_mini_batches=4"])
    assert notes == ["--config.starpo.num_mini_batches replaces starpo.mini_batch_size=16 of the config file"]
    spec = _resolve(cfg)
    assert spec.starpo.mini_batch_layout(spec.rollout.batch_size) == (4, 8)
    # Both named on the command line: still the one clear conflict.
    cfg = frozen_lake.get_config()
    cfg.starpo.num_mini_batches = 4
    assert apply_exclusive_overrides(cfg, ["launch", "--config.starpo.num_mini_batches=4",
                                           "--config.starpo.mini_batch_size=8"]) == []
    with pytest.raises(ConfigError, match="both set"):
        _resolve(cfg)


def test_cli_missing_and_broken_config_files(tmp_path):
    p = _launch("--config", "configs/frozen_lakes.py")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "config file 'configs/frozen_lakes.py' does not exist" in p.stderr and "frozen_lake.py" in p.stderr
    broken = tmp_path / "broken.py"
    broken.write_text("def get_config(:\n    pass\n")
    p = _launch("--config", str(broken))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "could not be loaded (line 1" in p.stderr and "SyntaxError" in p.stderr
    saved = tmp_path / "config.json"
    saved.write_text("{}")
    p = _launch("--config", str(saved))
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "must be a Python file defining get_config()" in p.stderr
    broken.write_text("from configs import base\n\ndef get_config():\n    c = base.get_config()\n    return c.nope\n")
    p = _launch("--config", str(broken))
    assert p.returncode == 2 and "line 5: return c.nope" in p.stderr, p.stderr


def test_cli_workdir_that_is_a_file(tmp_path):
    f = tmp_path / "notadir"
    f.write_text("x")
    p = _launch("--config", "configs/frozen_lake.py", f"--config.workdir={f}")
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert "exists and is not a directory" in p.stderr


def test_cli_context_too_short_for_the_prompt_is_one_clear_error(tmp_path):
    # Only known once the tokenizer has encoded the system prompt (at set-up, not in resolve).
    p = _launch("--config", "configs/frozen_lake.py", "--config.rollout.max_seq_len=100",
                f"--config.workdir={tmp_path}", "--config.compilation_cache_dir=")
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("Configuration error: rollout.max_seq_len=100 cannot hold even one turn"), last


@pytest.mark.parametrize("path", sorted(p.name for p in (ROOT / "configs").glob("*.py")
                                        if p.name not in ("__init__.py", "base.py")))
def test_every_shipped_config_resolves(path):
    import importlib

    module = importlib.import_module(f"configs.{path[:-3]}")
    spec = _resolve(module.get_config())
    assert spec.config.workdir.startswith("runs/"), spec.config.workdir


@pytest.mark.parametrize("size", [1, 0, 100])
def test_env_setting_out_of_range_is_one_line_before_the_workdir(size, tmp_path):
    """``env.size`` out of range fails in ``resolve`` — before ``train`` creates the workdir or
    writes its config.json — with the env's own message naming the range."""
    from configs import frozen_lake

    cfg = frozen_lake.get_config()
    cfg.workdir = str(tmp_path / "run")
    cfg.env.size = size
    with pytest.raises(ConfigError, match=rf"env.size={size}.*must be an int in \[2, 30\]"):
        _resolve(cfg)
    assert not (tmp_path / "run").exists()


def test_cli_truncated_model_config_json_is_the_one_line_model_file_error(tmp_path):
    model = tmp_path / "qwen"
    model.mkdir()
    (model / "config.json").write_text('{"hidden_size": 896, "num_hidden')
    p = _launch("--config", "configs/frozen_lake.py", "--config.model.preset=qwen2.5-0.5b",
                f"--config.model.path={model}", f"--config.workdir={tmp_path / 'run'}")
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert f"Model file error: {model / 'config.json'} is not valid JSON" in p.stderr


WEBSHOP_SMALL = ["--config.trainer.total_steps=1", "--config.rollout.num_groups=2", "--config.rollout.group_size=2",
                 "--config.rollout.max_turns=1", "--config.rollout.max_new_tokens=16", "--config.rollout.max_seq_len=1024",
                 "--config.starpo.adv_estimator=grpo", "--config.starpo.mini_batch_size=4",
                 "--config.eval.num_episodes=2", "--config.trainer.progress_bar=False",
                 "--config.model.tiny.hidden_size=32", "--config.model.tiny.intermediate_size=64",
                 "--config.model.tiny.num_layers=1", "--config.model.tiny.num_heads=2",
                 "--config.model.tiny.num_kv_heads=1", "--config.model.tiny.head_dim=16",
                 "--config.collapse.num_samples=4", "--config.collapse.micro_batch_size=8"]


def _webshop_launch(tmp_path, factory_source):
    import os

    (tmp_path / "my_webshop.py").write_text(factory_source)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    return subprocess.run(
        [sys.executable, "-m", "ragen_jax.launch", "--config", "configs/base.py", "--config.env.name=webshop",
         "--config.env.factory=my_webshop:make_webshop", f"--config.workdir={tmp_path / 'run'}", *WEBSHOP_SMALL],
        cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)


def test_a_python_environments_error_is_one_line_through_launch(tmp_path):
    p = _webshop_launch(tmp_path, (
        "from tests.environments.test_text_envs import FakeWebAgentTextEnv\n"
        "class Broken(FakeWebAgentTextEnv):\n"
        "    def reset(self, session=None):\n"
        "        raise RuntimeError('the store is closed')\n"
        "def make_webshop():\n"
        "    return Broken()\n"))
    assert p.returncode == 2, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("WARNING")]
    assert lines[-1].startswith("Environment error: HostEnv WebShop raised RuntimeError at reset of row 0"), p.stderr
    assert "the store is closed" in lines[-1] and "Traceback" not in p.stderr


def test_readme_webshop_route_runs_on_the_stand_in(tmp_path):
    """The README's command (``--config configs/base.py --config.env.name=webshop
    --config.env.factory=MODULE:FUNCTION``) on the WebShop stand-in of the text-env tests, shrunk to
    one small step: switching env.name on the command line drops the file's Sokoban settings."""
    p = _webshop_launch(tmp_path, "from tests.environments.test_text_envs import make_webshop\n")
    assert p.returncode == 0, p.stderr[-3000:]
    assert (tmp_path / "run" / "summary.json").exists()
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["env"] == {"name": "webshop", "factory": "my_webshop:make_webshop"}


def test_model_cpu_kernels_is_a_config_key_that_reaches_the_model():
    from configs import frozen_lake
    from ragen_jax.config import ConfigError
    from ragen_jax.plan import model_config

    c = frozen_lake.get_config()
    c.model.cpu_kernels = "off"
    assert model_config(resolve(c)).cpu_kernels == "off"
    c.model.cpu_kernels = "sometimes"
    with pytest.raises(ConfigError, match="model.cpu_kernels='sometimes' is not valid; allowed: auto, on, off"):
        resolve(c)
