"""Command-line entry point: train or evaluate from an ml-collections config file.

    python -m ragen_jax.launch --config configs/frozen_lake.py
    python -m ragen_jax.launch --config configs/sokoban.py --config.model.preset=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct --config.trainer.total_steps=200
    python -m ragen_jax.launch --config configs/frozen_lake.py --config.mode=eval \
        --config.workdir=runs/frozen_lake

Every key of the config is overridable as ``--config.section.key=value``. A bad key or value stops
the run before anything is compiled, with one message naming the key and the allowed values.
Multi-host runs (TPU pods, multi-node GPU) call ``jax.distributed.initialize()`` first: set
``--distributed`` (the scripts in ``launch/`` do).
"""
from __future__ import annotations

import difflib
import os
import sys

from absl import app, flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
_DISTRIBUTED = flags.DEFINE_bool("distributed", False, "Call jax.distributed.initialize() (multi-host).")


def _explain_unknown_override(argv: list[str]) -> str | None:
    """A clearer message than absl's for ``--config.a.b=...`` naming a key that does not exist."""
    import importlib.util

    path = _config_path(argv)
    if not path:
        return None
    spec = importlib.util.spec_from_file_location("_user_config", path)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cfg = module.get_config()
    for arg in argv:
        if not arg.startswith("--config.") or "=" not in arg:
            continue
        dotted = arg[len("--config."):].split("=", 1)[0]
        node, walked = cfg, []
        for part in dotted.split("."):
            keys = list(node.keys()) if hasattr(node, "keys") else []
            if part not in keys:
                where = ".".join(walked) or "<top level>"
                close = difflib.get_close_matches(part, keys, n=3)
                hint = f" Did you mean {', '.join(close)}?" if close else ""
                return (f"unknown config key '{dotted}': section '{where}' has no key '{part}'.{hint}\n"
                        f"Allowed keys in '{where}': {', '.join(sorted(keys))}")
            node, walked = node[part], walked + [part]
    return None


def main(argv) -> None:
    del argv
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax reports every save at INFO
    if _CONFIG.value is None:
        print("Configuration error: --config is required, e.g. --config configs/frozen_lake.py "
              "(configs/sokoban.py, configs/bandit.py)", file=sys.stderr)
        sys.exit(2)
    cache = _CONFIG.value.get("compilation_cache_dir")
    if cache:
        # Compiled XLA programs persist across runs: a second run (or a resume) skips compilation.
        import jax

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    from ragen_jax.training.configuration import ConfigError, resolve

    if _DISTRIBUTED.value:
        import jax

        jax.distributed.initialize()
    try:
        spec = resolve(_CONFIG.value)
    except ConfigError as e:
        print(f"Configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    if spec.config.mode == "eval":
        from ragen_jax.training.evaluate import run_eval

        run_eval(spec)
    else:
        from ragen_jax.training.trainer import train

        train(spec)


def _config_path(argv: list[str]) -> str | None:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
    return path.split(":")[0] if path else None


def run(argv: list[str] | None = None) -> None:
    argv = list(sys.argv if argv is None else argv)
    path = _config_path(argv)
    if path:
        # Config files import their siblings as ``configs.base``: put the folder above configs/ first.
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if root not in sys.path:
            sys.path.insert(0, root)

    def parse(args):
        try:
            return flags.FLAGS(args)
        except (flags.Error, AttributeError, KeyError, TypeError, ValueError) as e:
            # config_flags reports a missing key as AttributeError and a bad type as TypeError/ValueError.
            msg = _explain_unknown_override(args[1:]) or str(e)
            print(f"Configuration error: {msg}", file=sys.stderr)
            sys.exit(2)

    app.run(main, argv=argv, flags_parser=parse)


if __name__ == "__main__":
    run()
