"""Where compiled steps read V4.1's Engram tables from: the device, or host memory.

A released V4.1 table is ~384M rows of 256 fp8 bytes plus 8 ue8m0 bytes (~101 GB); two of them
do not fit one GPU beside the model. Compiled steps hold every table as tensors in its stored
format (fp8 rows + ue8m0 scales, or the unquantised dtype), placed by ``DEEPINFER_ENGRAM_TABLES``
(``StepGraphs(engram_tables=)``):

- ``device``: every table on the device, within the Engram budget
  (``DEEPINFER_ENGRAM_DEVICE_GIB``; default an eighth of the device's memory, all of it on the
  CPU), or an error naming the table, its size and the budget;
- ``host``: every table in host memory, which the GPU reads through unified addressing: the
  table's pages are registered with the CUDA driver (``cudaHostRegister``: pinned in place,
  at its exact size; ``pin_memory`` would round a 101 GB buffer up to 128 GB), and the step
  gathers the rows its hash ids address with ``deepinfer::engram_rows``, a device kernel
  loading them over the bus (at most (N-1) x heads = 24 rows of 264 bytes a token a layer),
  so no step waits on the host and the gather is captured in the step's CUDA graph;
- ``auto`` (default): tables on the device while they fit the budget, the rest in host memory.

A host table is copied once from the checkpoint's memory map into anonymous memory and pinned:
a file-backed mapping cannot be pinned reliably (pages of a shared file mapping may be dropped
and re-read) and a GPU cannot fault pages in, so reading a step's rows straight from the map
would need the ids on the host, a sync per decode step. Host tables are refused, naming the
table, its size, the device budget and the host memory available, when the host has less
memory available than the tables take. Eager steps need none of this: they read the memory
map (``graphs/engram.py``).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch._subclasses.fake_tensor import FakeTensor

from ..graphs.engram import EngramTable
from ..settings import argument

GiB = 2**30
DEVICE_SHARE = 8  # the default budget: this fraction (1/8) of the device's memory
_COPY_ROWS = 1 << 20  # rows copied from the memory map at a time (264 MiB of a released table)


@dataclass(frozen=True)
class Placed:
    """Where one table went: its parameter path, bytes as stored and ``device`` or ``host``."""

    path: str
    nbytes: int
    where: str


def engram_budget(device: torch.device, gib: float | None = None) -> int:
    """Bytes of Engram tables the device may hold: ``gib`` (``DEEPINFER_ENGRAM_DEVICE_GIB``; None:
    an eighth of the device's memory; on the CPU, where host and device are one, no limit)."""
    if gib is not None:
        return int(gib * GiB)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory // DEVICE_SHARE
    return 1 << 62


def host_available() -> int:
    """Bytes of host memory available to new allocations (``MemAvailable``)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/meminfo has no MemAvailable line")


def place_engram_tables(
    params: dict, device: torch.device, mode: str | None = None, budget: int | None = None
) -> list[Placed]:
    """Replace every Engram table of ``params`` (in place) by tensors on ``device`` or in host
    memory, per ``mode`` (None: ``DEEPINFER_ENGRAM_TABLES``) and ``budget`` (bytes; None:
    ``engram_budget``). Returns where each went; steps read a host table with
    ``deepinfer::engram_rows`` (``StepGraphs`` swaps it in when any table is on the host)."""
    mode = argument("DEEPINFER_ENGRAM_TABLES", mode)
    budget = engram_budget(device, argument("DEEPINFER_ENGRAM_DEVICE_GIB", None)) if budget is None else budget
    tables = [(i, lp["engram"]["embed"]) for i, lp in enumerate(params.get("layers", [])) if "engram" in lp]
    placed, on_device, new_host = [], 0, 0
    for i, table in tables:
        host = mode == "host" or (mode == "auto" and on_device + table.nbytes > budget)
        if not host and on_device + table.nbytes > budget:
            raise ValueError(
                f"DEEPINFER_ENGRAM_TABLES=device: Engram table {table.name} takes {table.nbytes / GiB:.2f} GiB and "
                f"the device budget (DEEPINFER_ENGRAM_DEVICE_GIB) is {budget / GiB:.2f} GiB "
                f"({on_device / GiB:.2f} GiB taken by earlier tables): raise the budget or use host or auto"
            )
        on_device += 0 if host else table.nbytes
        # a table already held as host tensors (a random model on the CPU) takes no new host memory,
        # nor does a fake one (a dry run's: nothing behind it)
        new_host += (
            table.nbytes if host and not (table.is_dense and (table.device.type == "cpu" or _fake(table))) else 0
        )
        placed.append(Placed(f"layers.{i}.engram.embed", table.nbytes, "host" if host else "device"))
    if new_host and new_host > (free := host_available()):
        big = max((p for p in placed if p.where == "host"), key=lambda p: p.nbytes)
        raise ValueError(
            f"Engram tables fit neither the device nor the host: {big.path} takes {big.nbytes / GiB:.2f} GiB "
            f"({new_host / GiB:.2f} GiB for every host table), the device budget (DEEPINFER_ENGRAM_DEVICE_GIB) is "
            f"{budget / GiB:.2f} GiB and the host has {free / GiB:.2f} GiB available: run on a larger host"
        )
    for (i, table), p in zip(tables, placed):
        params["layers"][i]["engram"]["embed"] = _to_host(table, device) if p.where == "host" else _to(table, device)
    return placed


def _copy(table: EngramTable, make) -> EngramTable:
    """``table`` as tensors from ``make(shape, dtype)``, filled a slice of rows at a time."""
    w0, s0 = table.tensors() if _fake(table) else table.planes(0, 0)
    weight = make((table.num_rows, table.head_dim), w0.dtype)
    scale = None if s0 is None else make((table.num_rows, s0.shape[1]), s0.dtype)
    for lo in range(0, 0 if _fake(table) else table.num_rows, _COPY_ROWS):  # a fake table has no values
        w, s = table.planes(lo, min(lo + _COPY_ROWS, table.num_rows))
        weight[lo : lo + w.shape[0]].copy_(w)
        if scale is not None:
            scale[lo : lo + w.shape[0]].copy_(s)
    return EngramTable.from_tensor(weight, table.name, scale)


def _to(table: EngramTable, device: torch.device) -> EngramTable:
    if table.is_dense and table.device == device:
        return table
    return _copy(table, lambda shape, dtype: torch.empty(shape, dtype=dtype, device=device))


def _to_host(table: EngramTable, device: torch.device) -> EngramTable:
    if device.type == "cpu":  # host and device are one: a tensor table as it is
        return _to(table, device)
    if device.type != "cuda":
        raise ValueError(f"host Engram tables are read through CUDA's unified addressing; not built for {device}")
    placed = _copy(table, lambda shape, dtype: torch.empty(shape, dtype=dtype))
    for t in placed.tensors():
        if t is not None:
            _register(t)
    return placed


def _fake(table: EngramTable) -> bool:
    return table.is_dense and isinstance(table.tensors()[0], FakeTensor)


def _register(t: torch.Tensor) -> None:
    """Pin ``t``'s pages in place and map them for the GPU (portable | mapped), until ``t`` is freed."""
    if isinstance(t, FakeTensor):
        return  # a dry run's table: nothing behind it
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 3)
    if int(err) != 0:
        raise RuntimeError(
            f"cudaHostRegister of {t.numel() * t.element_size() / GiB:.2f} GiB failed ({err}): "
            "raise the locked-memory limit (ulimit -l) or use DEEPINFER_ENGRAM_TABLES=device"
        )
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
