"""WebShop and ALFWorld through ``HostEnv``: adapters for a locally installed copy of each.

Neither can be downloaded here (WebShop needs its product index, ALFWorld its game files), so
this project ships the adapters, not the data. With the data installed, point ``factory`` at a
zero-argument callable that builds the environment, e.g. a module of your own::

    # my_envs.py
    def webshop():
        from web_agent_site.envs import WebAgentTextEnv
        return WebAgentTextEnv(observation_mode="text", num_products=1000)

    def alfworld():
        import yaml
        from alfworld.agents.environment import get_environment
        config = yaml.safe_load(open("base_config.yaml"))
        return get_environment("AlfredTWEnv")(config, train_eval="train").init_env(batch_size=1)

    python -m ragen_jax.launch --config configs/base.py --config.env.name=webshop \\
        --config.env.factory=my_envs:webshop

The interfaces the adapters use:
  * WebShop's ``WebAgentTextEnv``: ``reset(session=i) -> (obs, info)``, ``step(action) -> (obs,
    reward, done, info)``, ``get_available_actions() -> {"has_search_bar": bool, "clickables":
    [...]}``; answers are ``search[...]`` / ``click[...]``, the available ones listed after the page
    text as the original does;
  * ALFWorld's batched TextWorld env (``init_env(batch_size=1)``): ``reset() -> ([obs], infos)``,
    ``step([command]) -> ([obs], [score], [done], infos)`` with ``infos["admissible_commands"][0]``
    and ``infos["won"][0]``; the task line ``Your task is to: ...`` is part of the first text.
"""
from __future__ import annotations

import importlib


def _factory(path: str | None, name: str):
    if not path:
        raise ValueError(f"{name} needs config.env.factory='module:callable', a zero-argument function that builds "
                         f"the environment from your local data (see environments/text/adapters.py)")
    module, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"config.env.factory={path!r} must look like 'module:callable'")
    return getattr(importlib.import_module(module), attr)


class WebShop:
    """WebShop's text env as a host env (``factory`` builds one ``WebAgentTextEnv``)."""

    action_names = None
    instruction = (
        "You are shopping in an online store for the product the instruction describes. Search, open a result, "
        "choose its options and buy it. Answer with one available action, search[keywords] or click[name], "
        "for example <answer>search[red cotton pillow cover]</answer>.\n"
    )

    def __init__(self, factory: str | None = None, num_sessions: int = 500):
        self.env = _factory(factory, "webshop")()
        self.num_sessions = int(num_sessions)

    def _text(self, obs: str) -> str:
        avail = self.env.get_available_actions()
        actions = (["search[<content>]"] if avail.get("has_search_bar") else []) + \
            [f"click[{c}]" for c in avail.get("clickables", [])]
        return f"{obs}\nAvailable actions: {', '.join(actions)}"

    def reset(self, seed: int) -> str:
        obs, _ = self.env.reset(session=int(seed) % self.num_sessions)
        return self._text(obs)

    def step(self, action: str):
        obs, reward, done, info = self.env.step(action.strip())
        info = dict(info or {})
        return self._text(obs), float(reward), bool(done), {"success": bool(done) and float(reward) >= 1.0,
                                                           "action_is_valid": info.get("valid", True)}


class ALFWorld:
    """ALFWorld's TextWorld env (batch of one) as a host env."""

    action_names = None
    instruction = (
        "You are an agent in a household. Complete the task by moving around and using objects. Answer with one "
        "admissible command, for example <answer>go to countertop 1</answer>.\n"
    )

    def __init__(self, factory: str | None = None):
        self.env = _factory(factory, "alfworld")()
        self.commands: list[str] = []

    def _text(self, obs: str, infos) -> str:
        self.commands = list(infos["admissible_commands"][0])
        return f"{obs}\nAdmissible commands: {', '.join(self.commands)}"

    def reset(self, seed: int) -> str:
        obs, infos = self.env.reset()
        return self._text(obs[0], infos)

    def step(self, action: str):
        command = action.strip()
        valid = command in self.commands
        obs, scores, dones, infos = self.env.step([command])
        won = bool(infos.get("won", [False])[0])
        return self._text(obs[0], infos), float(scores[0]), bool(dones[0]), {"success": won, "action_is_valid": valid}
