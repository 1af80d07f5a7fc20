"""A reader of W&B's run file (``run-<id>.wandb``), written from its format, for the tests only.

The file is a 7-byte header (``:W&B``, a 2-byte magic, a version byte) followed by LevelDB's log
format: 32 KiB blocks of records, each ``crc32c (4) | length (2, little-endian) | type (1) | data``,
type 1 a whole record, 2 / 3 / 4 the first / middle / last fragment of one; a block's last < 7
bytes are padding. Each reassembled record is a ``wandb_internal_pb2.Record`` protobuf.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = 7


def records(path: str | Path):
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # block trailer
            pos += left
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        if length == 0 and kind == 0:  # zero padding up to the block end
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        pos += HEADER + length
        if kind == 1:
            pending = payload
        elif kind == 2:
            pending = payload
            continue
        elif kind == 3:
            pending += payload
            continue
        else:
            pending += payload
        record = pb.Record()
        record.ParseFromString(pending)
        pending = b""
        yield record


def history(path: str | Path) -> list[dict]:
    """Every ``run.log`` call's items, ``{key: decoded JSON value}``, in order; a media value (an
    image, a table), whose fields W&B stores as nested keys, comes back as one dict."""
    rows = []
    for r in records(path):
        if r.WhichOneof("record_type") != "history":
            continue
        row: dict = {}
        for item in r.history.item:
            path_ = [item.key] if item.key else list(item.nested_key)
            node = row
            for part in path_[:-1]:
                node = node.setdefault(part, {})
            node[path_[-1]] = json.loads(item.value_json)
        rows.append(row)
    return rows


def run_id(path: str | Path) -> str:
    for r in records(path):
        if r.WhichOneof("record_type") == "run":
            return r.run.run_id
    raise AssertionError(f"{path} holds no run record")
