"""On-disk export of one request's cache state, between the PROMPT and COMPLETION engines.

A PROMPT engine prefills a request and exports its slot; a COMPLETION engine (same model,
same state dtype) imports it into one of its own slots and continues decoding at position
``n_tokens``. One request is one directory holding two files:

``state.safetensors``
    Every tensor of the slot, keyed by its path in the state tree (the slot dim dropped):

    - ``layers.{i}.window`` ``[sliding_window, head_dim]``: the window ring. Every ring is
      stored at its width without spare rows (position p at ``p % width``), whatever spare rows
      the exporting pool's rings held for speculative decoding; import puts each position back
      where the importing pool keeps it, so engines with and without speculation trade states.
    - ``layers.{i}.comp.rows_kv`` / ``rows_gate`` (layers with a compressor): the fp32 ring
      of raw projected rows (the open window, plus the previous one where windows overlap).
    - ``layers.{i}.comp.entries`` ``[n_tokens // ratio, head_dim]``: only the live prefix of
      the compressed entries, ``ratio = c.compress_ratios[i]``; rows past it are never read
      before a later step writes them, so they are not stored (and import zeroes them).
    - ``layers.{i}.index.*`` (CSA layers): the indexer compressor, the same three tensors with
      ``index_head_dim`` (entries again ``n_tokens // ratio`` rows).
    - ``engram.history`` (V4.1 with Engram): the compressed ids of the last
      ``engram_max_ngram_size - 1`` positions, a ring (position p at ``p % width``).
    - ``mtp.{j}.window``: the MTP blocks' window rings; ``mtp.{j}.pending`` ``[hc, hidden]``: the
      target's streams that wait for the drafter's next row (``graphs/mtp.py``).

``meta.json`` (an object)
    - ``format``: ``"deepinfer_fx.state"``; ``version``: ``FORMAT_VERSION`` (an integer,
      bumped on any incompatible change).
    - ``model_type``: the ModelConfig's ``model_type``.
    - ``config_fingerprint``: ``config_fingerprint(c)``, sha256 of ``repr(ModelConfig)``: a
      state is only valid for the exact config (layer ratios, dims, fake-quant switch) that
      wrote it.
    - ``dtype``: the state dtype, e.g. ``"bfloat16"``; the importing pool must use the same
      (a silent cast would change the continuation's numerics).
    - ``kv_format``: ``"model"`` or ``"trained"`` (windows, entries and index keys as fp8 / fp4
      bytes, ``graphs/state.py``); the importing pool must hold the same (absent: ``"model"``).
    - ``n_tokens``: positions processed so far; the next step runs at ``start = n_tokens``.
    - ``prompt_token_ids``: the request's prompt (list of ints).
    - ``last_token``: the last sampled token not yet fed to the model, or ``null``.
    - ``seed``: the request's sampling seed, or ``null``.
    - any further keys the exporter's caller supplied (JSON values), returned unchanged.

``meta.json`` is written last and both files are renamed into place, so a reader that finds
``meta.json`` finds a complete ``state.safetensors`` beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..config import ModelConfig
from ..graphs.state import init_state
from .cache import CachePool, iter_tensors

FORMAT = "deepinfer_fx.state"
FORMAT_VERSION = 3  # 2: mtp.{j}.pending; 3: engram.history a ring keyed by position (was oldest first)
STATE_FILE = "state.safetensors"
META_FILE = "meta.json"
_OWN_KEYS = ("format", "version", "model_type", "config_fingerprint", "dtype", "kv_format")
_DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64)}


def config_fingerprint(c: ModelConfig) -> str:
    return hashlib.sha256(repr(c).encode()).hexdigest()[:32]


def _live_rows(c: ModelConfig, path: str, n_tokens: int) -> int | None:
    """Rows of ``path`` to store: ``n_tokens // ratio`` for entries tensors, else None (all)."""
    if not path.endswith((".entries", ".index_keys")):
        return None
    layer = int(path.split(".")[1])  # only backbone layers ("layers.{i}.…") compress
    return n_tokens // c.compress_ratios[layer]


def _expected_shape(c: ModelConfig, path: str, full: torch.Size, n_tokens: int, rings: dict) -> tuple[int, ...]:
    rows = _live_rows(c, path, n_tokens) if path not in rings else rings[path]
    return tuple(full) if rows is None else (rows, *full[1:])


def ring_widths(pool: CachePool) -> dict[str, int]:
    """``{path: rows}`` of the pool's rings that hold spare rows: the rows they have without."""
    plain = init_state(pool.config, 1, pool.dtype, "meta", mtp=True, slots=1, kv_format=pool.plan.kv_format)
    plain = dict(iter_tensors(plain))
    return {
        p: plain[p].shape[1]
        for p, t in iter_tensors(pool.state)
        if not p.endswith((".entries", ".index_keys")) and t.shape[1] != plain[p].shape[1]
    }


def rekey_ring(ring: torch.Tensor, n_tokens: int, rows: int) -> torch.Tensor:
    """A ring holding positions ``< n_tokens`` at ``p % len(ring)`` as a ring of ``rows``: each
    of the last ``min`` positions moved to ``p % rows`` (older ones are read by nobody)."""
    out = ring.new_zeros((rows, *ring.shape[1:]))
    pos = torch.arange(max(0, n_tokens - min(rows, ring.shape[0])), n_tokens, device=ring.device)
    out[pos % rows] = ring[pos % ring.shape[0]]
    return out


def export_slot(pool: CachePool, slot: int, path: str | os.PathLike, meta: dict) -> Path:
    """Write ``slot``'s state and ``meta`` (needs ``n_tokens`` and ``prompt_token_ids``;
    ``last_token`` and ``seed`` default to null) into the directory ``path``."""
    c, out = pool.config, Path(path)
    for key in ("n_tokens", "prompt_token_ids"):
        if key not in meta:
            raise ValueError(f"export_slot: meta needs '{key}'")
    clash = [k for k in _OWN_KEYS if k in meta]
    if clash:
        raise ValueError(f"export_slot: meta keys {clash} are written by the exporter; leave them out")
    n_tokens = int(meta["n_tokens"])
    if not 0 <= n_tokens <= pool.max_len:
        raise ValueError(f"export_slot: n_tokens {n_tokens} is outside 0..{pool.max_len} (the pool's max_len)")
    tensors, rings = {}, ring_widths(pool)
    for name, t in pool.slot_tensors(slot).items():
        rows = _live_rows(c, name, n_tokens)
        t = rekey_ring(t, n_tokens, rings[name]) if name in rings else t if rows is None else t[:rows]
        tensors[name] = t.detach().to("cpu").contiguous()
    full_meta = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "model_type": c.model_type,
        "config_fingerprint": config_fingerprint(c),
        "dtype": str(pool.dtype).removeprefix("torch."),
        "kv_format": pool.plan.kv_format,
        "last_token": None,
        "seed": None,
        **meta,
        "n_tokens": n_tokens,
        "prompt_token_ids": [int(t) for t in meta["prompt_token_ids"]],
    }
    out.mkdir(parents=True, exist_ok=True)
    tmp_state, tmp_meta = out / (STATE_FILE + ".tmp"), out / (META_FILE + ".tmp")
    save_file(tensors, str(tmp_state), metadata={"format": FORMAT, "version": str(FORMAT_VERSION)})
    tmp_meta.write_text(json.dumps(full_meta, indent=1))
    os.replace(tmp_state, out / STATE_FILE)
    os.replace(tmp_meta, out / META_FILE)
    return out


def read_meta(path: str | os.PathLike) -> dict:
    """``meta.json`` of an exported request, checked to be ours; errors name the file."""
    f = Path(path) / META_FILE
    try:
        meta = json.loads(f.read_text())
    except FileNotFoundError:
        raise ValueError(f"{f}: missing; not an exported request state (or the export did not finish)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f}: corrupt, not valid JSON ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(
            f"{f}: not a {FORMAT} export (format field is {meta.get('format') if isinstance(meta, dict) else None!r})"
        )
    if meta.get("version") != FORMAT_VERSION:
        raise ValueError(f"{f}: format version {meta.get('version')!r}; this build reads version {FORMAT_VERSION}")
    for key in ("model_type", "config_fingerprint", "dtype", "n_tokens", "prompt_token_ids"):
        if key not in meta:
            raise ValueError(f"{f}: field '{key}' is missing")
    if not isinstance(meta["n_tokens"], int) or meta["n_tokens"] < 0:
        raise ValueError(f"{f}: n_tokens must be a non-negative integer, got {meta['n_tokens']!r}")
    return meta


def _check_meta(f: Path, meta: dict, pool: CachePool, c: ModelConfig) -> None:
    if meta["model_type"] != c.model_type:
        raise ValueError(f"{f}: exported from model_type {meta['model_type']!r}; this model is {c.model_type!r}")
    if meta["config_fingerprint"] != config_fingerprint(c):
        raise ValueError(
            f"{f}: config fingerprint {meta['config_fingerprint']} differs from this model's "
            f"{config_fingerprint(c)}: the state was exported from a different model config"
        )
    if _DTYPES.get(meta["dtype"]) != pool.dtype:
        raise ValueError(f"{f}: state dtype is {meta['dtype']}; this pool holds {pool.dtype} (use the same dtype)")
    held = meta.get("kv_format", "model")
    if held != pool.plan.kv_format:
        raise ValueError(
            f"{f}: the state holds kv_format {held!r}; this engine's cache holds {pool.plan.kv_format!r} "
            f"(build the COMPLETION engine with kv_format={held!r})"
        )
    if meta["n_tokens"] > pool.max_len:
        raise ValueError(f"{f}: {meta['n_tokens']} tokens do not fit this pool's max_len {pool.max_len}")


@torch.no_grad()
def import_slot(pool: CachePool, slot: int, path: str | os.PathLike, c: ModelConfig) -> dict:
    """Load an exported request into ``slot`` (zeroed first; rows past the live prefix stay
    zero) and return its meta. Version, config, dtype, tensor names and shapes are checked
    before anything is written; a mismatch raises ValueError naming the file."""
    if pool.config != c:
        raise ValueError("import_slot: the pool was built for a different ModelConfig than the one given")
    d = Path(path)
    meta = read_meta(d)
    _check_meta(d / META_FILE, meta, pool, c)
    n_tokens = meta["n_tokens"]
    f = d / STATE_FILE
    targets, rings = pool.slot_tensors(slot), ring_widths(pool)
    try:
        with safe_open(str(f), framework="pt") as sf:
            keys = set(sf.keys())
            missing, extra = sorted(set(targets) - keys), sorted(keys - set(targets))
            if missing or extra:
                raise ValueError(
                    f"{f}: tensors do not match this model's state (missing {missing[:4]}, unexpected {extra[:4]})"
                )
            for name, t in targets.items():
                got = tuple(sf.get_slice(name).get_shape())
                want = _expected_shape(c, name, t.shape, n_tokens, rings)
                if got != want:
                    raise ValueError(
                        f"{f}: tensor {name} has shape {list(got)}; expected {list(want)} for {n_tokens} tokens"
                    )
            loaded = {name: sf.get_tensor(name) for name in targets}
    except FileNotFoundError:
        raise ValueError(f"{f}: missing; the export beside {META_FILE} is incomplete") from None
    except SafetensorError as e:
        raise ValueError(f"{f}: corrupt safetensors file ({e})") from None
    for name, t in loaded.items():
        if t.dtype != targets[name].dtype:
            raise ValueError(f"{f}: tensor {name} is {t.dtype}; the pool holds {targets[name].dtype}")
    pool.zero(slot)
    for name, t in loaded.items():
        if name in rings:
            t = rekey_ring(t, n_tokens, targets[name].shape[0])
        targets[name][: t.shape[0]].copy_(t)
    return meta


class StateTransfer:
    """Request states between a PROMPT engine (``export``: a finished request's slot to
    ``root/request-NNNNNN``) and a COMPLETION engine (``load``: an exported state into the
    request's slot, its last sampled token into ``next_token``)."""

    def __init__(self, pool: CachePool, c: ModelConfig, root: Path, next_token: torch.Tensor) -> None:
        self.pool, self.config, self.root, self.next_token = pool, c, root, next_token

    def dir_for(self, seq) -> Path:
        return self.root / f"request-{seq.id:06d}"

    def export(self, seq) -> None:
        meta = {
            "n_tokens": seq.prompt_len,
            "prompt_token_ids": seq.prompt_ids,
            "last_token": seq.output_ids[-1],
            "seed": seq.seed,
            "prompt": seq.prompt,
        }
        export_slot(self.pool, seq.slot, self.dir_for(seq), meta)

    def load(self, seq) -> None:
        meta = import_slot(self.pool, seq.slot, seq.import_path, self.config)
        self.next_token[seq.slot] = int(meta["last_token"])
