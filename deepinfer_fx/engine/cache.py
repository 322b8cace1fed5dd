"""Cache pools: how many sequences fit, which slot each one uses, and admission by pages.

The state of ``graphs.state`` is allocated once for a fixed number of sequence slots, each
dense up to ``max_len`` tokens. This module sizes that allocation from a memory budget
(``plan_capacity``), hands slots to sequences (``CachePool.allocate`` / ``free``) and keeps
page accounting for the part of the state that grows with the sequence.

Decision: the physical storage stays per-slot dense for now; pages are only the admission
control unit. A slot's compressed entries and index keys are rows ``[0, max_len // ratio)``
of its own tensors, so the graphs index them by position without a page table. Pages
(``page_size`` tokens each) count how many tokens the running sequences have claimed, and
``num_pages`` may be set below ``slots * ceil(max_len / page_size)`` to over-subscribe
slots: many short sequences can then run side by side while the scheduler still refuses to
let their total length outgrow the budget. Moving to a paged physical layout later (to share
prefixes or to give long sequences more than one slot's rows) changes the storage and the
kernels' indexing, not this accounting API.

A recycled slot holds the previous sequence's values. The scheduler lists slots to zero (and
to clone, for n > 1 or prefix sharing) in its outputs; the runner calls ``zero`` / ``clone``.
``allocate`` does not zero, so the cost is paid where the scheduler decides it is needed.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..graphs.state import init_state, slot_view

# The only state tensors whose size scales with max_len: compressed entries and (V4.1) the
# index keys stored beside them.
GROWING_KEYS = ("entries", "index_keys")


def iter_tensors(tree: dict, prefix: str = ""):
    """``(path, tensor)`` for every tensor of a state tree, paths like ``layers.3.comp.entries``.
    Lists (``layers``, ``mtp``) contribute their index; non-tensor leaves are skipped."""
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from iter_tensors(value, path + ".")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                yield from iter_tensors(item, f"{path}.{i}.")
        elif isinstance(value, torch.Tensor):
            yield path, value


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()  # works on the meta device, where nothing is allocated


def state_bytes_per_slot(
    c: ModelConfig, max_len: int, dtype: torch.dtype, mtp: bool = True, spare: int = 0, kv_format: str = "model"
) -> dict:
    """Bytes of one sequence slot, measured on a ``meta`` state (nothing is allocated);
    ``spare``: the rings' rows for the longest draft, ``kv_format`` how rows are held (``graphs/state.py``).

    Returns ``fixed`` (window rings and compressor row rings; independent of ``max_len``),
    ``growing`` (compressed entries and index keys at this ``max_len``), ``total``
    (fixed + growing) and ``per_token`` (growing / max_len: bytes per cached token)."""
    if max_len < 1:
        raise ValueError(f"max_len must be at least 1 token, got {max_len}")
    state = init_state(c, max_len, dtype, device="meta", mtp=mtp, slots=1, spare=spare, kv_format=kv_format)
    fixed = growing = 0
    for path, t in iter_tensors(state):
        one = t[0]  # the state also holds the scratch slot
        if path.endswith(GROWING_KEYS):
            growing += _nbytes(one)
        else:
            fixed += _nbytes(one)
    return {"fixed": fixed, "growing": growing, "total": fixed + growing, "per_token": growing / max_len}


@dataclass(frozen=True)
class CapacityPlan:
    slots: int  # sequences that run at once
    max_len: int  # tokens each slot can hold (prompt + completion)
    bytes_per_slot: int  # fixed + growing bytes of one slot at max_len
    total_bytes: int  # (slots + 1 scratch) * bytes_per_slot: what the pool allocates
    per_token_bytes: float  # growing bytes per cached token
    fixed_bytes_per_slot: int  # window and compressor rings: paid once per slot
    tokens_capacity: int  # slots * max_len
    spare: int = 0  # ring rows past what readers need: the longest draft (graphs/state.py)
    kv_format: str = "model"  # "trained": windows, entries and index keys as fp8 / fp4 bytes


def plan_capacity(
    c: ModelConfig,
    budget_bytes: int,
    max_len: int,
    dtype: torch.dtype,
    max_slots: int | None = None,
    spare: int = 0,
    kv_format: str = "model",
) -> CapacityPlan:
    """As many slots of ``max_len`` tokens as ``budget_bytes`` holds (at most ``max_slots``),
    their rings ``spare`` rows longer (speculative decoding's longest draft), their rows held
    as ``kv_format`` says (``graphs/state.py``)."""
    if max_slots is not None and max_slots < 1:
        raise ValueError(f"max_slots must be at least 1, got {max_slots}")
    b = state_bytes_per_slot(c, max_len, dtype, spare=spare, kv_format=kv_format)
    per_slot = b["total"]
    slots = max(budget_bytes, 0) // per_slot - 1  # one slot's worth goes to the scratch slot
    if slots < 1:
        raise ValueError(
            f"a cache budget of {budget_bytes} bytes does not hold one sequence of {max_len} tokens: "
            f"one needs {per_slot} bytes ({b['fixed']} fixed + {b['per_token']:.1f} per token, {dtype}), "
            "and the pool keeps one more slot as scratch for padded steps; "
            "give a larger budget or a smaller max_len"
        )
    if max_slots is not None:
        slots = min(slots, max_slots)
    return CapacityPlan(
        slots=slots,
        max_len=max_len,
        bytes_per_slot=per_slot,
        total_bytes=(slots + 1) * per_slot,
        per_token_bytes=b["per_token"],
        fixed_bytes_per_slot=b["fixed"],
        tokens_capacity=slots * max_len,
        spare=spare,
        kv_format=kv_format,
    )


class CachePool:
    """The state of ``plan.slots`` sequences, a slot allocator and page accounting.

    ``allocate`` returns ``None`` when every slot is taken and ``reserve`` returns ``False``
    when the page budget cannot cover a request: callers queue the sequence and retry after
    a ``free``, never crash."""

    def __init__(
        self,
        c: ModelConfig,
        plan: CapacityPlan,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        page_size: int = 64,
        num_pages: int | None = None,
    ) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be at least 1 token, got {page_size}")
        self.config = c
        self.plan = plan
        self.dtype = dtype
        self.max_len = plan.max_len
        self.slots = plan.slots
        self.page_size = page_size
        self.pages_per_slot = math.ceil(plan.max_len / page_size)
        full = plan.slots * self.pages_per_slot
        if num_pages is not None and not 1 <= num_pages <= full:
            raise ValueError(f"num_pages must be in 1..{full} (slots * ceil(max_len / page_size)), got {num_pages}")
        self.num_pages = full if num_pages is None else num_pages
        self.state = init_state(
            c, plan.max_len, dtype, device, mtp=True, slots=plan.slots, spare=plan.spare, kv_format=plan.kv_format
        )
        self._free_slots = list(range(plan.slots))  # a heap: the lowest free slot goes first
        self._pages: dict[int, int] = {}  # slot in use -> pages reserved for it
        self._used_pages = 0

    @classmethod
    def from_budget(
        cls,
        c: ModelConfig,
        budget_bytes: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device | None = None,
        max_slots: int | None = None,
        **kw,
    ) -> "CachePool":
        return cls(c, plan_capacity(c, budget_bytes, max_len, dtype, max_slots), dtype, device, **kw)

    # -- slots ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free_slots)

    @property
    def in_use(self) -> set[int]:
        return set(self._pages)

    def allocate(self) -> int | None:
        """A free slot (lowest first), or ``None`` when all are in use. Not zeroed: see ``zero``."""
        if not self._free_slots:
            return None
        slot = heapq.heappop(self._free_slots)
        self._pages[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        """Return a slot and release its pages."""
        self._check_in_use(slot)
        self._used_pages -= self._pages.pop(slot)
        heapq.heappush(self._free_slots, slot)

    def can_ever_fit(self, n_tokens: int) -> bool:
        """Whether a sequence of ``n_tokens`` fits one slot at all (else refuse it, do not queue)."""
        return n_tokens <= self.max_len

    # -- pages ---------------------------------------------------------------------------------

    @property
    def free_pages(self) -> int:
        return self.num_pages - self._used_pages

    def reserved_pages(self, slot: int) -> int:
        self._check_in_use(slot)
        return self._pages[slot]

    def reserve(self, slot: int, n_tokens: int) -> bool:
        """Grow ``slot``'s reservation to cover ``n_tokens`` tokens. ``False`` (nothing changes)
        when the free pages cannot cover the growth or ``n_tokens`` exceeds ``max_len``.
        Reservations never shrink while the slot is held."""
        self._check_in_use(slot)
        if n_tokens > self.max_len:
            return False
        grow = math.ceil(max(n_tokens, 0) / self.page_size) - self._pages[slot]
        if grow <= 0:
            return True
        if grow > self.free_pages:
            return False
        self._pages[slot] += grow
        self._used_pages += grow
        return True

    # -- state ---------------------------------------------------------------------------------

    def slot_state(self, slot: int) -> dict:
        """One slot's part of the state (views: writes land in the pool)."""
        self._check_slot(slot)
        return {
            key: [slot_view(x, slot) for x in value] if isinstance(value, list) else slot_view(value, slot)
            for key, value in self.state.items()
            if isinstance(value, (dict, list))  # skip the scalar bookkeeping (max_len, slots)
        }

    def slot_tensors(self, slot: int) -> dict[str, torch.Tensor]:
        """``{path: view}`` of every tensor of one slot, e.g. ``layers.3.comp.entries``."""
        return dict(iter_tensors(self.slot_state(slot)))

    @torch.no_grad()
    def zero(self, slot: int) -> None:
        """Zero every tensor of ``slot`` so a recycled slot carries nothing of its last user."""
        for _, t in iter_tensors(self.slot_state(slot)):
            t.zero_()

    @torch.no_grad()
    def clone(self, src: int, dst: int) -> None:
        """Copy every tensor of slot ``src`` into slot ``dst`` (page reservations are not copied:
        reserve for ``dst`` as for any sequence)."""
        self._check_slot(src)
        self._check_slot(dst)
        if src == dst:
            return
        for _, t in iter_tensors(self.state):
            t[dst].copy_(t[src])

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} does not exist; the pool has {self.slots} slots")

    def _check_in_use(self, slot: int) -> None:
        self._check_slot(slot)
        if slot not in self._pages:
            raise ValueError(f"slot {slot} is not allocated (double free, or reserve before allocate?)")
