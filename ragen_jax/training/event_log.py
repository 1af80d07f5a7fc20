"""Logging: TensorBoard scalars by family, sample transcripts, the MI-vs-entropy quadrant and learning-curve images.

Metric names are ``family/name``. The families a training run writes:

    train/       success, pass@k, return, lengths, valid / effective action rates
    rollout/     SNR filter metrics (in-group reward std, kept ratio, empty-after-filter, ...)
    actor/       policy loss, clip fractions, KL, entropy, grad norm
    critic/      value loss, clip fraction
    collapse/    MI proxy, H(Z|X), H(Z), retrieval accuracy, regime
    early_stop/  the three stop signals (empty filter, reward-variance collapse, MI collapse)
    val/         evaluation success / pass@k on the fixed validation seeds
    timing_s/    rollout / update / step wall time, tokens per second

``read_scalars`` parses an event file back (a TFRecord stream of ``Event`` protos) so tests and
notebooks can check what was written without the ``tensorboard`` package.
"""
from __future__ import annotations

import errno
import io
import os
import shutil
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Iterable, Mapping

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tensorboardX import SummaryWriter
from tensorboardX.proto import event_pb2
from tensorboardX.record_writer import masked_crc32c

REGIMES = ("diverse", "template_collapse", "compressed", "low_entropy_collapse")


def to_host_scalars(metrics: Mapping) -> dict[str, float]:
    """Flatten a (possibly nested, device-resident) metrics mapping to ``{"a/b": float}``.

    Non-scalar arrays are skipped (transcripts and tables are logged separately).
    """
    out: dict[str, float] = {}

    def visit(prefix: str, value) -> None:
        if isinstance(value, Mapping):
            for k, v in value.items():
                visit(f"{prefix}/{k}" if prefix else str(k), v)
            return
        arr = np.asarray(value)
        if arr.ndim == 0 and arr.dtype.kind in "biuf":
            out[prefix] = float(arr)

    visit("", metrics)
    return out


def quadrant_lines(baseline: tuple[float, float], mi_ratio: float, entropy_ratio: float) -> tuple[float, float]:
    """``(MI line, H(Z|X) line)`` of the regime quadrants: the collapse thresholds of
    ``CollapseConfig`` (``regime_mi_ratio`` × baseline MI, ``regime_entropy_ratio`` × baseline
    H(Z|X)), the same numbers the regime metrics classify with."""
    return mi_ratio * baseline[0], entropy_ratio * baseline[1]


def quadrant_figure(history: Iterable[tuple[int, float, float]], baseline: tuple[float, float] | None = None,
                    mi_ratio: float = 0.5, entropy_ratio: float = 0.5):
    """Scatter MI (y) against H(Z|X) (x) over training, coloured by step; returns an RGB array.

    The four quadrants relative to the baseline are RAGEN-2's regimes: diverse reasoning (high MI,
    high H(Z|X)), template collapse (low MI, high H(Z|X)), compressed (high MI, low H(Z|X)) and
    low-entropy collapse (low, low).

    Args:
      history: ``(step, mi, conditional_entropy)`` triples.
      baseline: ``(mi, conditional_entropy)`` reference for the quadrant lines (None: no lines).
      mi_ratio, entropy_ratio: the lines sit at these fractions of the baseline
        (``collapse.regime_mi_ratio`` / ``collapse.regime_entropy_ratio``).
    Returns:
      uint8 ``[H, W, 3]`` image.
    """
    pts = np.asarray(list(history), dtype=np.float64).reshape(-1, 3)
    # A Figure on an Agg canvas of its own (no pyplot): nothing global changes, whatever backend
    # the caller (a notebook) uses.
    fig = Figure(figsize=(4.5, 4), dpi=80)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if len(pts):
        sc = ax.scatter(pts[:, 2], pts[:, 1], c=pts[:, 0], cmap="viridis", s=18)
        ax.plot(pts[:, 2], pts[:, 1], lw=0.5, color="grey")
        fig.colorbar(sc, ax=ax, label="step")
    if baseline is not None:
        mi_line, entropy_line = quadrant_lines(baseline, mi_ratio, entropy_ratio)
        ax.axhline(mi_line, color="red", lw=0.8, ls="--")
        ax.axvline(entropy_line, color="red", lw=0.8, ls="--")
    ax.set_xlabel("H(Z|X)  (conditional entropy, nats/token)")
    ax.set_ylabel("MI proxy  I(X;Z)")
    ax.set_title("Reasoning regime")
    fig.tight_layout()
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    return img


class LoggingError(OSError):
    """The TensorBoard writer stopped (its file could not be written: a full disk, a lost mount)."""


def save_learning_curve(path: Path, history: dict) -> np.ndarray:
    """Learning curve: training success per step and validation success (with the warm-up mark),
    saved as ``path``; returns the image (RGB ``[H, W, 3]``) for the loggers."""
    fig = Figure(figsize=(6, 3.6), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    tr = np.asarray(history.get("train", []), dtype=np.float64).reshape(-1, 2)
    va = np.asarray(history.get("val", []), dtype=np.float64).reshape(-1, 2)
    if len(tr):
        ax.plot(tr[:, 0], tr[:, 1], lw=0.8, alpha=0.35, color="C0", label="train success (one batch)")
        w = min(10, len(tr))
        if w > 1:  # one batch is noisy: show the trend over the last w steps
            smooth = np.convolve(tr[:, 1], np.ones(w) / w, mode="valid")
            ax.plot(tr[w - 1:, 0], smooth, lw=1.5, color="C0", label=f"train success ({w}-step mean)")
    if len(va):
        ax.plot(va[:, 0], va[:, 1], "o-", lw=2, color="C1", label="validation success (fixed puzzles)")
    if history.get("warmup_val") is not None:
        ax.axhline(history["warmup_val"], color="grey", ls="--", lw=1, label="after warm-up only")
    ax.set_xlabel("RL step")
    ax.set_ylabel("success rate")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title(history.get("title", "StarPO training"))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    fig.canvas.draw()
    rgb = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    return rgb


class Logger:
    """TensorBoard writer (tensorboardX), and any further ``sinks`` (``wandb_sink.WandbSink``) that take
    the same ``scalars`` / ``image`` / ``text`` / ``close`` calls.

    An events file deleted while the run writes to it is noticed at the next step's scalars: a
    warning names it and a new file takes the rest of the run (nothing is written into the void).
    """

    def __init__(self, log_dir: str | os.PathLike, enabled: bool = True, sinks: tuple = ()):
        self.log_dir = Path(log_dir)
        self.enabled = enabled
        self.sinks = tuple(sinks) if enabled else ()
        self._writer = None
        if enabled:
            self._open()

    def _open(self) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # tensorboardX names a file by the second and the host: a writer opened in the same second as
        # an existing file (a quick restart, a reopened file) would truncate it. Pick a free name.
        stem = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        n, suffix = 0, ""
        while (self.log_dir / (stem + suffix)).exists():
            n += 1
            suffix = f".{n}"
        # A queue that never fills: tensorboardX's writer thread dies on a write error (a full disk),
        # and a put() into its bounded queue would then block for ever. Each add checks the thread.
        self._writer = SummaryWriter(str(self.log_dir), flush_secs=10, filename_suffix=suffix, max_queue=1 << 16)

    @property
    def events_file(self) -> Path | None:
        """The events file being written (None when disabled)."""
        if not self._writer:
            return None
        return Path(self._writer.file_writer.event_writer._ev_writer._file_name)

    def _writer_alive(self) -> bool:
        """tensorboardX writes from a thread; an exception (ENOSPC) kills it, and every later write
        would then wait forever on its full queue."""
        worker = getattr(self._writer.file_writer.event_writer, "_worker", None)
        return worker is None or worker.is_alive()

    def _abandon_writer(self) -> None:
        """Drop a writer whose thread died: nothing will drain its queue again, so neither this
        process's exit (multiprocessing's queue feeder thread) nor a close may wait for it."""
        queue = getattr(self._writer.file_writer.event_writer, "_event_queue", None)
        if queue is not None:
            queue.cancel_join_thread()
        self._writer = None

    def _check_writer(self) -> None:
        if self._writer is None or self._writer_alive():
            return

        path = self.events_file
        free = shutil.disk_usage(self.log_dir).free
        self._abandon_writer()
        if free < (1 << 20):
            raise LoggingError(errno.ENOSPC, f"no space left on the device of {self.log_dir} ({free} bytes free): "
                                             f"the TensorBoard writer of {path} stopped")
        raise LoggingError(errno.EIO, f"the TensorBoard writer of {path} stopped (its file could not be written)")

    def _check_file(self, step: int) -> None:
        self._check_writer()
        path = self.events_file
        if path is None or path.exists():
            return

        self._writer.close()
        self._open()
        print(f"warning: the TensorBoard events file {path} was deleted during the run; what was logged there "
              f"is gone, step {step} on goes to {self.events_file}", file=sys.stderr, flush=True)

    def scalars(self, step: int, metrics: Mapping[str, float]) -> None:
        for sink in self.sinks:
            sink.scalars(step, metrics)
        if not self._writer:
            return
        self._check_file(step)
        for name, value in metrics.items():
            self._check_writer()
            if np.isfinite(value):
                self._writer.add_scalar(name, value, step)

    def text(self, step: int, tag: str, text: str) -> None:
        for sink in self.sinks:
            sink.text(step, tag, text)
        self._check_writer()
        if self._writer:
            # Markdown code block: keeps the board's line breaks in TensorBoard's text view.
            self._writer.add_text(tag, "```\n" + text + "\n```", step)

    def image(self, step: int, tag: str, rgb: np.ndarray) -> None:
        for sink in self.sinks:
            sink.image(step, tag, rgb)
        self._check_writer()
        if self._writer:
            self._writer.add_image(tag, rgb, step, dataformats="HWC")

    def flush(self) -> None:
        self._check_writer()
        if self._writer:
            try:
                self._writer.flush()
            except OSError as e:
                self._abandon_writer()
                raise LoggingError(e.errno, f"{e.strerror or e}: the TensorBoard events file {self.log_dir} could "
                                            "not be written") from None

    def close(self, failed: bool = False) -> None:
        """Close the writer and the sinks (``failed``: the run ended with an error, which a sink
        such as W&B records)."""
        sinks, self.sinks = self.sinks, ()
        for sink in sinks:
            sink.close(failed)
        if self._writer and not self._writer_alive():
            self._abandon_writer()  # a dead writer's queue is never drained: closing it would hang
        if self._writer:
            try:
                self._writer.close()
                self._writer = None
            except OSError as e:
                self._abandon_writer()
                raise LoggingError(e.errno, f"{e.strerror or e}: the TensorBoard events file {self.log_dir} could "
                                            "not be written") from None


def _records(path: Path):
    """Yield the payloads of a TFRecord file (length, crc, data, crc)."""
    with open(path, "rb") as f:
        data = f.read()
    buf = io.BytesIO(data)
    while True:
        header = buf.read(8)
        if len(header) < 8:
            return
        (length,) = struct.unpack("<Q", header)
        buf.read(4)
        payload = buf.read(length)
        buf.read(4)
        yield payload


def trim_events(log_dir: str | os.PathLike, last_step: int) -> None:
    """Make a restarted run's TensorBoard series hold one value per step, as ``trim_records`` does
    for the evaluation records.

    ``last_step`` < 0 (a fresh start in a workdir where an earlier attempt died before its first
    checkpoint): the old events move to ``<log_dir>.stale-<time>`` (kept, not deleted). Otherwise (a
    resume from checkpoint ``last_step``): every events file keeps the events of steps up to it and
    all of the warm-up's (``warmup/*``, which has its own step count and is never re-run), and drops
    the later steps, which the resumed run logs again. Files are rewritten atomically.
    """
    log_dir = Path(log_dir)
    files = sorted(log_dir.rglob("events.out.tfevents.*")) if log_dir.is_dir() else []
    if not files:
        return
    if last_step < 0:
        os.replace(log_dir, log_dir.with_name(f"{log_dir.name}.stale-{time.strftime('%Y%m%d-%H%M%S')}"))
        return
    for path in files:
        kept, dropped = [], 0
        for payload in _records(path):
            ev = event_pb2.Event()
            try:
                ev.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - a record cut by the crash
                dropped += 1
                continue
            warmup = ev.HasField("summary") and all(v.tag.startswith("warmup/") for v in ev.summary.value)
            if not ev.HasField("summary") or warmup or ev.step <= last_step:
                kept.append(payload)
            else:
                dropped += 1
        if not dropped:
            continue
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            for payload in kept:
                f.write(_frame(payload))
        os.replace(tmp, path)


def _frame(payload: bytes) -> bytes:
    """One TFRecord: length, its masked CRC-32C, the data, the data's masked CRC-32C."""
    header = struct.pack("<Q", len(payload))
    return header + struct.pack("<I", masked_crc32c(header)) + payload + struct.pack("<I", masked_crc32c(payload))


def read_events(log_dir: str | os.PathLike, text_content: bool = False) -> dict[str, list]:
    """Read every event file under ``log_dir``: ``{tag: [(step, value_or_kind), ...]}``.

    Scalars give their float value; text and images give the strings ``"text"`` / ``"image"``
    (``text_content``: a text gives what was written, without TensorBoard's code-block fence).
    """
    out: dict[str, list] = {}
    for path in sorted(Path(log_dir).rglob("events.out.tfevents.*")):
        for payload in _records(path):
            ev = event_pb2.Event()
            ev.ParseFromString(payload)
            if not ev.HasField("summary"):
                continue
            for v in ev.summary.value:
                if v.HasField("simple_value"):
                    val = float(v.simple_value)
                elif v.HasField("image"):
                    val = "image"
                elif v.HasField("tensor") or v.metadata.plugin_data.plugin_name == "text":
                    val = "text"
                    if text_content:
                        val = b"".join(v.tensor.string_val).decode()
                        val = val.removeprefix("```\n").removesuffix("\n```")
                else:
                    continue
                tag = v.tag[: -len("/text_summary")] if v.tag.endswith("/text_summary") else v.tag
                out.setdefault(tag, []).append((int(ev.step), val))
    return out


def read_scalars(log_dir: str | os.PathLike) -> dict[str, list[tuple[int, float]]]:
    """Scalar series only, ``{tag: [(step, value), ...]}``."""
    return {k: [(s, v) for s, v in vs if isinstance(v, float)]
            for k, vs in read_events(log_dir).items() if any(isinstance(v, float) for _, v in vs)}
