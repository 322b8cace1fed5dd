"""A checkpoint's files: its directory (local, ``$DEEPINFER_HF_MODEL_DIR`` or a hub repo id), its
safetensors shards and index, read header by header (nothing but headers); ``CheckpointError``,
which every checkpoint problem raises. ``io/checkpoint_reader.py`` reads the tensors."""

from __future__ import annotations

import json
import os
import pathlib
import struct
from dataclasses import dataclass

from deepinfer_fx.settings import setting

ENV_MODEL_DIR = "DEEPINFER_HF_MODEL_DIR"
INDEX_FILE = "model.safetensors.index.json"
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt"]


class CheckpointError(ValueError):
    """A checkpoint problem; the message is one line naming file and tensor."""

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))


def resolve_model_dir(model: str | os.PathLike[str] | None) -> pathlib.Path:
    """Local directory, $DEEPINFER_HF_MODEL_DIR, or a hub repo id -> directory."""
    from_env = model is None
    if from_env:
        model = setting(ENV_MODEL_DIR)
        if not model:
            raise CheckpointError(
                f"no model given and {ENV_MODEL_DIR} is not set; pass a checkpoint directory "
                f"or hub repo id, or export {ENV_MODEL_DIR}=/path/to/checkpoint"
            )
    text = os.fspath(model)
    path = pathlib.Path(text).expanduser()
    if path.is_dir():
        return path.resolve()
    # Anything path-shaped must exist locally; only bare "org/name" goes to the hub.
    if from_env or isinstance(model, os.PathLike) or text.startswith(("/", ".", "~")) or path.exists():
        where = f" (from {ENV_MODEL_DIR})" if from_env else ""
        raise CheckpointError(f"{text}{where}: no such directory; pass an existing checkpoint directory")
    import huggingface_hub  # deferred: only hub ids need it
    from huggingface_hub import errors as hf_errors

    # Read the offline switch at call time: huggingface_hub caches it at import.
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return pathlib.Path(
            huggingface_hub.snapshot_download(text, allow_patterns=_HUB_PATTERNS, local_files_only=offline)
        )
    except (OSError, ValueError, hf_errors.HfHubHTTPError, hf_errors.OfflineModeIsEnabled) as exc:
        raise CheckpointError(
            f"hub repo '{text}' could not be fetched (offline? {type(exc).__name__}); pass a local "
            f"checkpoint directory path instead, or set {ENV_MODEL_DIR}=/path/to/checkpoint"
        ) from exc


@dataclass(frozen=True)
class StoredTensor:
    """One tensor as written on disk (from the shard header; nothing read yet)."""

    shard: pathlib.Path
    name: str
    dtype: str  # safetensors dtype tag, e.g. "F8_E4M3", "I8", "BF16"
    shape: tuple[int, ...]


def read_header(shard: pathlib.Path) -> dict[str, StoredTensor]:
    """Parse a safetensors header ourselves: cheap, and catches truncation early."""
    bad = f"{shard}: not a valid safetensors file"
    try:
        size = shard.stat().st_size
        with open(shard, "rb") as fh:
            head = fh.read(8)
            hlen = struct.unpack("<Q", head)[0] if len(head) == 8 else size
            header = json.loads(fh.read(hlen)) if hlen <= size - 8 else None
    except OSError as exc:
        raise CheckpointError(f"{shard}: cannot read shard ({exc})") from exc
    except ValueError as exc:  # JSON or UTF-8 decoding
        raise CheckpointError(f"{bad} (header is not JSON: {exc}); re-download it") from exc
    if header is None:
        raise CheckpointError(f"{bad} (header length {hlen} does not fit in {size} bytes); re-download it")
    out: dict[str, StoredTensor] = {}
    for name, info in header.items() if isinstance(header, dict) else [("<header>", None)]:
        if name == "__metadata__":
            continue
        try:
            end = 8 + hlen + int(info["data_offsets"][1])
            out[name] = StoredTensor(shard, name, str(info["dtype"]), tuple(int(d) for d in info["shape"]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CheckpointError(f"{bad} (bad header entry for tensor '{name}'); re-download it") from exc
        if end > size:  # the usual symptom of an interrupted download
            raise CheckpointError(
                f"{bad} (truncated: tensor '{name}' ends at byte {end}, file has {size}); re-download it"
            )
    return out


def scan_shards(model_dir: pathlib.Path) -> list[StoredTensor]:
    """All stored tensors, validated against the index and shard headers."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(
                f"{index}: unreadable or corrupt index ({type(exc).__name__}: {exc}); "
                f"it needs a 'weight_map' of tensor name -> shard file"
            ) from exc
        by_shard: dict[str, list[str]] = {}
        for name, shard in weight_map.items():
            by_shard.setdefault(str(shard), []).append(name)
        stored: list[StoredTensor] = []
        for shard_name, names in sorted(by_shard.items()):
            shard = model_dir / shard_name
            if not shard.is_file():
                raise CheckpointError(
                    f"{shard}: shard listed in {INDEX_FILE} is missing (it should hold tensor "
                    f"'{names[0]}'); re-download it"
                )
            header = read_header(shard)
            for name in names:
                if name not in header:
                    raise CheckpointError(f"{shard}: tensor '{name}' listed in {INDEX_FILE} is not in this shard")
                stored.append(header[name])
        return stored
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(
            f"{model_dir}: no *.safetensors files and no {INDEX_FILE}; point at a directory holding the checkpoint"
        )
    return [t for shard in shards for t in read_header(shard).values()]
