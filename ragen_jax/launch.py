"""Command-line entry point: train or evaluate from an ml-collections config file.

    python -m ragen_jax.launch --config configs/frozen_lake.py
    python -m ragen_jax.launch --config configs/sokoban_ragen.py --config.model.preset=qwen2.5-0.5b \
        --config.model.path=/models/Qwen2.5-0.5B-Instruct --config.trainer.total_steps=200
    python -m ragen_jax.launch --config configs/frozen_lake.py --config.mode=eval \
        --config.workdir=runs/frozen_lake
    python -m ragen_jax.launch --config configs/frozen_lake.py --config.mode=export \
        --config.workdir=runs/frozen_lake   # -> runs/frozen_lake/export: HF safetensors, LoRA merged

Every key of the config is overridable as ``--config.section.key=value``. A bad key or value stops
the run before anything is compiled, with one message naming the key and the allowed values.
Multi-process runs (TPU pods, multi-node GPU) call ``jax.distributed.initialize()`` first: set
``--distributed`` (the scripts in ``launch/`` do). Every process runs the same command; together they
form one mesh (``config.mesh``), each holding its share of every batch, and process 0 alone writes
TensorBoard, transcripts and the summary. Without a scheduler that jax detects (SLURM, Open MPI,
Cloud TPU), name the coordinator:

    python -m ragen_jax.launch --distributed --coordinator_address=10.0.0.1:1234 --num_processes=2 \
        --process_id=0 --config configs/sokoban_ragen.py
"""
from __future__ import annotations

if __name__ == "__main__":  # first, before JAX is imported: the opt-in restart with huge pages (malloc_tuning)
    from ragen_jax.malloc_tuning import reexec_with_huge_pages

    reexec_with_huge_pages()

import ast
import contextlib
import difflib
import errno
import importlib.util
import logging
import os
import sys
import threading
import traceback

# transformers serves tokenizers and chat templates here; its advice that "models won't be
# available" without PyTorch is about its own models, not ours.
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import jax  # noqa: E402
from absl import app, flags  # noqa: E402
from absl import logging as absl_logging  # noqa: E402
from ml_collections import ConfigDict, config_flags  # noqa: E402

from ragen_jax.config import ConfigError, resolve  # noqa: E402
from ragen_jax.models.loading import ModelFileError  # noqa: E402
from ragen_jax.rollout.host_env import FAILURES  # noqa: E402
from ragen_jax.training.checkpoint import CheckpointMismatch, NoIntactCheckpoint  # noqa: E402
from ragen_jax.training.evaluate import run_eval, run_export  # noqa: E402
from ragen_jax.training.trainer import train  # noqa: E402

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file (configs/*.py).",
                                          lock_config=True)
_DISTRIBUTED = flags.DEFINE_bool(
    "distributed", False, "Join a multi-process run (jax.distributed.initialize): SLURM, Open MPI and Cloud TPU "
    "pods are detected from their environment; elsewhere give --coordinator_address, --num_processes and "
    "--process_id.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None,
                                   "host:port of process 0 (with --distributed, where nothing detects it)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "number of processes (with --coordinator_address)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "this process's index (with --coordinator_address)")


# Keys of which a run sets one at most. A config file may set one (the shipped ones set
# mini_batch_size); naming the other on the command line replaces it rather than conflicting.
EXCLUSIVE_KEYS = (("starpo.mini_batch_size", "starpo.num_mini_batches"),)


# ``--config.env.*`` arguments of a command line that switches ``env.name`` away from the config
# file's env: applied in ``main`` as the whole env section (see ``_take_env_switch``).
_ENV_SWITCH: dict[str, str] = {}


def _take_env_switch(argv: list[str], file_env_name: str | None) -> list[str]:
    """When ``--config.env.name=X`` names another env than the config file's, the file's env settings
    (Sokoban's ``dim_room``, …) belong to the other env: the env section becomes exactly the command
    line's ``--config.env.*`` keys (which may be any of X's own, e.g. ``env.factory`` for WebShop).
    Those arguments are taken out of ``argv`` and kept for ``main``; returns the rest."""
    env_args = {a[len("--config.env."):].split("=", 1)[0]: a.split("=", 1)[1]
                for a in argv if a.startswith("--config.env.") and "=" in a}
    if "name" not in env_args or env_args["name"] == file_env_name:
        return argv
    _ENV_SWITCH.clear()
    _ENV_SWITCH.update(env_args)
    return [a for a in argv if not (a.startswith("--config.env.") and "=" in a)]


def _env_section(values: dict[str, str]):
    """The env section from command-line strings (Python literals where they parse: numbers, tuples)."""
    def value(text: str):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError):
            return text

    return ConfigDict({k: value(v) for k, v in values.items()})


def _override_keys(argv: list[str]) -> list[str]:
    """The dotted keys set by ``--config.a.b=value`` arguments."""
    return [a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.") and "=" in a]


def load_config_file(path: str):
    """``get_config()`` of the config file at ``path``; raises ``ValueError`` saying what is wrong."""
    if not os.path.isfile(path):
        here = os.path.dirname(path) or "."
        shipped = sorted(f for f in os.listdir(here) if f.endswith(".py") and f != "__init__.py") \
            if os.path.isdir(here) else []
        hint = f"; config files in {here}/: {', '.join(shipped)}" if shipped else \
            " (run from the repository root, e.g. --config configs/frozen_lake.py)"
        raise ValueError(f"config file {path!r} does not exist{hint}")
    if not path.endswith(".py"):
        raise ValueError(f"config file {path!r} must be a Python file defining get_config() (configs/*.py); a run's "
                         "config.json records what ran: launch the config file it was made from, with the same overrides")
    spec = importlib.util.spec_from_file_location("_user_config", path)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        if not hasattr(module, "get_config"):
            raise ValueError(f"config file {path!r} defines no get_config() returning a ConfigDict")
        cfg = module.get_config()
    except ValueError as e:
        if "get_config" in str(e):
            raise
        cause = e
    except Exception as e:  # noqa: BLE001 - any error in the user's file is reported, not raised
        cause = e
    else:
        if not hasattr(cfg, "keys"):
            raise ValueError(f"config file {path!r}: get_config() returned {type(cfg).__name__}, not a ConfigDict")
        return cfg
    if isinstance(cause, SyntaxError):
        where = f"line {cause.lineno}: {(cause.text or '').strip()}"
    else:
        frames = [f for f in traceback.extract_tb(cause.__traceback__)
                  if os.path.abspath(f.filename) == os.path.abspath(path)]
        where = f"line {frames[-1].lineno}: {frames[-1].line}" if frames else "while loading"
    raise ValueError(f"config file {path!r} could not be loaded ({where}): {type(cause).__name__}: {cause}")


def unknown_key_message(cfg, dotted: str) -> str | None:
    """A message naming the first part of ``dotted`` (``"filter.vale"``) that ``cfg`` has no key
    for, the closest keys and the allowed ones; None when the key exists."""
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


def _explain_unknown_override(argv: list[str]) -> str | None:
    """A clearer message than absl's for ``--config.a.b=...`` naming a key that does not exist."""
    path = _config_path(argv)
    if not path:
        return None
    cfg = load_config_file(path)
    for dotted in _override_keys(argv):
        message = unknown_key_message(cfg, dotted)
        if message:
            return message
    return None


def apply_exclusive_overrides(config, argv: list[str]) -> list[str]:
    """Clear the partner of each ``EXCLUSIVE_KEYS`` key that only the command line sets.

    Returns one note per key cleared (printed at start-up, so the replacement is never silent).
    """
    given = set(_override_keys(argv))
    notes = []
    for pair in EXCLUSIVE_KEYS:
        for key in pair:
            others = [k for k in pair if k != key]
            if key not in given or any(o in given for o in others):
                continue
            for other in others:
                section, name = other.split(".")
                if config[section][name] is not None:
                    notes.append(f"--config.{key} replaces {other}={config[section][name]} of the config file")
                    config[section][name] = None
    return notes


def initialize_distributed(coordinator_address=None, num_processes=None, process_id=None) -> None:
    """``jax.distributed.initialize`` before any device is touched: afterwards ``jax.devices()`` lists
    every process's devices and the run's mesh spans them all.

    CPU processes exchange collectives through gloo (XLA's CPU client has no other cross-process
    transport); GPUs and TPUs use their own, and the setting does not touch them.
    """
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    address = cross_host_transfer_address(coordinator_address, process_id)
    if address:
        jax.config.update("jax_cross_host_transfer_socket_address", address)
    jax.distributed.initialize(coordinator_address=coordinator_address, num_processes=num_processes,
                               process_id=process_id)


def cross_host_transfer_address(coordinator_address=None, process_id=None) -> str | None:
    """The socket this process receives arrays on from other processes (``placement.send``: the
    asynchronous rollout on processes of its own), on CPU-only installs, where XLA's client has no
    cross-host transfers of its own: the coordinator's host when it is this machine (127.0.0.1),
    else this host's address, and the port after the coordinator's plus the process index. GPUs and
    TPUs transfer over their own interconnect: None. ``RAGEN_JAX_TRANSFER_ADDRESS`` (host:port) overrides."""
    if os.environ.get("RAGEN_JAX_TRANSFER_ADDRESS"):
        return os.environ["RAGEN_JAX_TRANSFER_ADDRESS"]
    accelerators = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin", "libtpu")
    on_cpu = os.environ.get("JAX_PLATFORMS", "").lower() == "cpu" or not any(
        importlib.util.find_spec(name) for name in accelerators)
    if not on_cpu or not coordinator_address or process_id is None:
        return None
    host, _, port = coordinator_address.rpartition(":")
    if host not in ("127.0.0.1", "localhost"):
        import socket

        host = socket.gethostbyname(socket.gethostname())
    return f"{host}:{int(port) + 1 + int(process_id)}"


def _quiet_host_env_callback_log() -> None:
    """JAX logs a failed ``io_callback`` with the whole traceback before re-raising it; a Python
    environment's failure is reported in one line by ``user_errors``, so that log record is dropped
    (any other callback's stays). The same for a full disk's errors in orbax's writer threads."""
    def keep(record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        return not any(error is f or (error is not None and error.__cause__ is f) for f in FAILURES)

    logging.getLogger("jax._src.callback").addFilter(keep)
    # A full disk is reported once, in one line (user_errors); orbax's writer threads log it with
    # their tracebacks first.
    logging.getLogger("absl").addFilter(lambda r: not (r.exc_info and _is_disk_full(r.exc_info[1])))
    # ... and so does the TensorBoard writer's thread when it dies of it (the Logger then raises).

    default_hook = threading.excepthook
    threading.excepthook = lambda args: None if _is_disk_full(args.exc_value) else default_hook(args)


def start(config) -> None:
    """What every command does before building anything: quiet logs, the persistent compilation
    cache, the notes on replaced keys, joining a multi-process run."""
    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax reports every save at INFO
    _quiet_host_env_callback_log()
    cache = config.get("compilation_cache_dir")
    if cache:
        # Compiled XLA programs persist across runs: a second run (or a resume) skips compilation.

        jax.config.update("jax_compilation_cache_dir", os.path.expanduser(cache))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    for note in apply_exclusive_overrides(config, _ARGV):
        print(f"note: {note}")
    if _DISTRIBUTED.value:
        initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)


@contextlib.contextmanager
def user_errors():
    """Errors a user can fix (a config key, a checkpoint that does not fit, a model file) end the
    command with one line saying what and how (exit status 2), not a traceback."""
    try:
        yield
    except ConfigError as e:
        print(f"Configuration error: {e}", file=sys.stderr)
        sys.exit(2)
    except (CheckpointMismatch, NoIntactCheckpoint) as e:
        print(f"Checkpoint error: {e}", file=sys.stderr)
        sys.exit(2)
    except ModelFileError as e:
        print(f"Model file error: {e}", file=sys.stderr)
        sys.exit(2)
    except Exception as e:  # noqa: BLE001 - a full disk, or a Python environment's failure wrapped by XLA

        if _is_disk_full(e):
            workdir = (_CONFIG.value or {}).get("workdir", "the workdir")
            _exit_now(2, f"Disk full: {e}. Free space under {workdir} and run the same command again: it resumes "
                         "from the last intact checkpoint")
        if not FAILURES:
            raise
        _exit_now(2, f"Environment error: {FAILURES[-1]}")


def _exit_now(status: int, report: str) -> None:
    """End a run that failed mid-way at once with ``report`` as the last line on stderr: background
    writers (orbax's threads around a failed asynchronous save) are silenced and abandoned rather
    than left to print their errors after it. Nothing is lost: finished checkpoints are committed
    atomically, and the TensorBoard writer was closed when the run failed
    (``trainer._close_after_failure``)."""
    sys.stdout.flush()
    sys.stderr.flush()
    err = os.dup(2)
    quiet = os.open(os.devnull, os.O_WRONLY)
    sys.stderr = open(os.devnull, "w")  # Python-level writes of other threads
    os.dup2(quiet, 2)  # and native ones (tensorstore, absl)
    os.write(err, (report + "\n").encode("utf-8", "replace"))
    os._exit(status)


def _is_disk_full(e: BaseException | None) -> bool:
    """``e`` (or what caused it) is an ``OSError`` of a full device."""
    while e is not None:
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(e):  # tensorstore's RESOURCE_EXHAUSTED, raised as ValueError
            return True
        e = e.__cause__ or e.__context__
    return False


def main(argv) -> None:
    del argv
    if _CONFIG.value is None:
        print("Configuration error: --config is required, e.g. --config configs/frozen_lake.py "
              "(configs/sokoban.py, configs/bandit.py)", file=sys.stderr)
        sys.exit(2)
    start(_CONFIG.value)
    if _ENV_SWITCH:  # --config.env.name switched the env: its section is the command line's env keys
        with _CONFIG.value.unlocked():
            _CONFIG.value.env = _env_section(_ENV_SWITCH)
    with user_errors():
        spec = resolve(_CONFIG.value)
        if spec.mode == "eval":
            run_eval(spec)
        elif spec.mode == "export":
            run_export(spec)
        else:
            train(spec)


def _config_path(argv: list[str]) -> str | None:
    path = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if path is None and "--config" in argv:
        i = argv.index("--config")
        path = argv[i + 1] if i + 1 < len(argv) else None
    return path.split(":")[0] if path else None


_ARGV: list[str] = []


def run(argv: list[str] | None = None, main=main) -> None:
    """Parse ``argv`` (``--config FILE --config.a.b=v ...``, every error one clear message) and
    call ``main`` (this module's: train / eval / export; ``ragen_jax.compare`` passes its own)."""
    from_sys = argv is None
    argv = list(sys.argv if argv is None else argv)
    _ARGV[:] = argv
    path = _config_path(argv)
    if path:
        # Config files import their siblings as ``configs.base``: put the folder above configs/ first.
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if root not in sys.path:
            sys.path.insert(0, root)
        try:  # a missing or broken file: one line naming it, not config_flags' traceback
            file_config = load_config_file(path)
        except ValueError as e:
            print(f"Configuration error: {e}", file=sys.stderr)
            sys.exit(2)
        argv = _take_env_switch(argv, file_config.get("env", {}).get("name"))
        if _ENV_SWITCH and from_sys:
            sys.argv[:] = argv  # config_flags reads its overrides from sys.argv too

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
