"""Cache pools (sizing, slots, pages, zero/clone) and the per-request state export format."""

from __future__ import annotations

import json
import random

import pytest
import torch

from tiny import tiny_v4

from deepinfer_fx import random_model
from deepinfer_fx.config import config_from_dict, load_config  # noqa: E402
from deepinfer_fx.config import released_config  # noqa: E402
from deepinfer_fx.engine.cache import CachePool, iter_tensors, plan_capacity, state_bytes_per_slot  # noqa: E402
from deepinfer_fx.engine.state_io import META_FILE, STATE_FILE, export_slot, import_slot  # noqa: E402
from deepinfer_fx.graphs.model import forward  # noqa: E402

FLASH = released_config("deepseek_v4_flash")
TINY = config_from_dict(tiny_v4())


@pytest.fixture
def seed() -> int:
    s = random.SystemRandom().randrange(1 << 31)
    print(f"seed={s}")
    return s


def _pool(slots: int = 3, max_len: int = 32, c=TINY, **kw) -> CachePool:
    return CachePool.from_budget(c, 1 << 40, max_len, torch.float32, max_slots=slots, **kw)


def _fill(pool: CachePool, gen: torch.Generator) -> None:
    for slot in range(pool.slots):
        for t in pool.slot_tensors(slot).values():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))


def _snapshot(pool: CachePool, slot: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in pool.slot_tensors(slot).items()}


# -- sizing ------------------------------------------------------------------------------------


def test_flash_bytes_per_token_match_spec():
    c = load_config(FLASH)
    spec = 21 * (1024 + 256) / 4 + 20 * 1024 / 128  # spec §4.4, bf16 storage: ≈ 6.9 KB/token
    b = state_bytes_per_slot(c, 1 << 20, torch.bfloat16)
    assert abs(b["per_token"] - spec) <= 0.1 * spec, (b, spec)
    short = state_bytes_per_slot(c, 4096, torch.bfloat16)
    assert short["fixed"] == b["fixed"] > 0, "fixed part must not depend on max_len"
    assert b["total"] == b["fixed"] + b["growing"]


def test_plan_capacity_numbers_and_too_small_budget():
    b = state_bytes_per_slot(TINY, 64, torch.float32)
    plan = plan_capacity(TINY, 4 * b["total"] - 1, 64, torch.float32)
    assert plan.slots == 2 and plan.max_len == 64, "one slot's worth is the scratch slot"
    assert plan.bytes_per_slot == b["total"] and plan.total_bytes == 3 * b["total"]
    assert plan.fixed_bytes_per_slot == b["fixed"] and plan.per_token_bytes == b["per_token"]
    assert plan.tokens_capacity == 2 * 64
    assert plan_capacity(TINY, 4 * b["total"], 64, torch.float32, max_slots=2).slots == 2
    pool = CachePool(TINY, plan)
    real = sum(t.numel() * t.element_size() for t in pool.slot_tensors(0).values())
    assert real * (plan.slots + 1) == plan.total_bytes, "meta sizing must equal what is allocated"
    assert sum(t.numel() * t.element_size() for _, t in iter_tensors(pool.state)) == plan.total_bytes
    with pytest.raises(ValueError, match=rf"needs {b['total']} bytes.*scratch.*larger budget or a smaller max_len"):
        plan_capacity(TINY, 2 * b["total"] - 1, 64, torch.float32)


# -- slots and pages ---------------------------------------------------------------------------


def test_allocate_until_full_then_free_and_reuse():
    pool = _pool(slots=3)
    got = [pool.allocate() for _ in range(3)]
    assert got == [0, 1, 2] and pool.num_free == 0 and pool.in_use == {0, 1, 2}
    assert pool.allocate() is None, "a full pool answers None (callers queue)"
    pool.free(1)
    assert pool.num_free == 1 and pool.in_use == {0, 2}
    assert pool.allocate() == 1
    pool.free(1)
    with pytest.raises(ValueError, match="not allocated"):
        pool.free(1)
    assert pool.can_ever_fit(32) and not pool.can_ever_fit(33)


def test_reserve_pages_and_release_on_free():
    pool = _pool(slots=3, max_len=16, page_size=4, num_pages=6)
    assert pool.num_pages == 6 and pool.free_pages == 6
    a, b = pool.allocate(), pool.allocate()
    assert pool.reserve(a, 5) and pool.reserved_pages(a) == 2 and pool.free_pages == 4
    assert pool.reserve(a, 8) and pool.reserved_pages(a) == 2, "within the reservation: no growth"
    assert pool.reserve(a, 3) and pool.reserved_pages(a) == 2, "reservations never shrink"
    assert pool.reserve(b, 13) and pool.free_pages == 0
    assert not pool.reserve(a, 9) and pool.reserved_pages(a) == 2, "a refused reserve changes nothing"
    assert not pool.reserve(a, 17), "beyond max_len never fits"
    pool.free(b)
    assert pool.free_pages == 4 and pool.reserve(a, 16) and pool.free_pages == 2
    assert _pool(slots=2, max_len=100, page_size=64).num_pages == 4  # default: slots * ceil(max_len / page)
    with pytest.raises(ValueError, match="num_pages"):
        _pool(slots=2, max_len=16, page_size=4, num_pages=9)


def test_zero_clears_one_slot_only(seed):
    pool = _pool(slots=3)
    _fill(pool, torch.Generator().manual_seed(seed))
    before = {s: _snapshot(pool, s) for s in (0, 2)}
    pool.zero(1)
    for name, t in pool.slot_tensors(1).items():
        assert not t.any(), f"seed={seed}: {name} not zeroed"
    for s, snap in before.items():
        for name, t in pool.slot_tensors(s).items():
            assert torch.equal(t, snap[name]), f"seed={seed}: zero(1) touched slot {s} {name}"


def test_clone_copies_a_slot(seed):
    pool = _pool(slots=3)
    _fill(pool, torch.Generator().manual_seed(seed))
    other = _snapshot(pool, 0)
    pool.clone(2, 1)
    for name, t in pool.slot_tensors(1).items():
        assert torch.equal(t, pool.slot_tensors(2)[name]), f"seed={seed}: {name} not copied"
        assert torch.equal(pool.slot_tensors(0)[name], other[name]), f"seed={seed}: clone touched slot 0"


# -- export / import ---------------------------------------------------------------------------


def _live(c, name: str, t: torch.Tensor, n_tokens: int) -> torch.Tensor:
    return t[: n_tokens // c.compress_ratios[int(name.split(".")[1])]] if name.endswith(".entries") else t


def test_export_import_round_trip_random_state(seed, tmp_path):
    n_tokens = 1 + seed % 32
    src = _pool(slots=2)
    _fill(src, torch.Generator().manual_seed(seed))
    meta = {"n_tokens": n_tokens, "prompt_token_ids": [5, 6, 7], "last_token": 9, "seed": seed, "request_id": "r1"}
    export_slot(src, 1, tmp_path / "req", meta)
    dst = _pool(slots=3)
    got = import_slot(dst, 2, tmp_path / "req", TINY)
    assert got["n_tokens"] == n_tokens and got["prompt_token_ids"] == [5, 6, 7]
    assert got["last_token"] == 9 and got["seed"] == seed and got["request_id"] == "r1"
    out, into = src.slot_tensors(1), dst.slot_tensors(2)
    for name, t in out.items():
        live = _live(TINY, name, t, n_tokens)
        assert torch.equal(into[name][: live.shape[0]], live), f"seed={seed} n_tokens={n_tokens}: {name} differs"
        assert not into[name][live.shape[0] :].any(), f"seed={seed}: {name} rows past the live prefix not zero"


@torch.no_grad()
def test_imported_slot_continues_identically(seed, tmp_path):
    c, params = random_model(tiny_v4(), seed)
    gen = torch.Generator().manual_seed(seed)
    n_prompt = int(torch.randint(9, 24, (1,), generator=gen))
    prompt = torch.randint(0, c.vocab_size, (n_prompt,), generator=gen)
    nxt = torch.randint(0, c.vocab_size, (5,), generator=gen)
    src = _pool(slots=2, c=c)
    src.zero(0)
    forward(params, src.state, c, prompt, start=0, slot=0)
    export_slot(src, 0, tmp_path / "req", {"n_tokens": n_prompt, "prompt_token_ids": prompt.tolist(), "seed": seed})
    dst = _pool(slots=2, c=c)
    _fill(dst, gen)  # junk everywhere: import must overwrite all of slot 1 and read nothing else
    import_slot(dst, 1, tmp_path / "req", c)
    want, _ = forward(params, src.state, c, nxt, start=n_prompt, slot=0)
    got, _ = forward(params, dst.state, c, nxt, start=n_prompt, slot=1)
    assert torch.equal(got, want), f"seed={seed} prompt={n_prompt}: max diff {(got - want).abs().max()}"


def test_import_errors_name_the_file(tmp_path):
    src = _pool(slots=1)
    d = tmp_path / "req"
    export_slot(src, 0, d, {"n_tokens": 10, "prompt_token_ids": [1, 2]})
    other = TINY.replace(rms_norm_eps=1e-5)
    with pytest.raises(ValueError, match=rf"{META_FILE}.*different model config"):
        import_slot(_pool(slots=1, c=other), 0, d, other)
    with pytest.raises(ValueError, match="dtype"):
        import_slot(CachePool.from_budget(TINY, 1 << 40, 32, torch.bfloat16, max_slots=1), 0, d, TINY)
    with pytest.raises(ValueError, match="do not fit"):
        import_slot(_pool(slots=1, max_len=8), 0, d, TINY)
    (d / STATE_FILE).write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: corrupt"):
        import_slot(_pool(slots=1), 0, d, TINY)
    (d / STATE_FILE).unlink()
    with pytest.raises(ValueError, match=rf"{STATE_FILE}: missing"):
        import_slot(_pool(slots=1), 0, d, TINY)
    (d / META_FILE).write_text("{not json")
    with pytest.raises(ValueError, match=rf"{META_FILE}: corrupt"):
        import_slot(_pool(slots=1), 0, d, TINY)
    meta = {"format": "deepinfer_fx.state", "version": 99}
    (d / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=rf"{META_FILE}: format version 99"):
        import_slot(_pool(slots=1), 0, d, TINY)
    with pytest.raises(ValueError, match=rf"{tmp_path / 'nowhere' / META_FILE}: missing"):
        import_slot(_pool(slots=1), 0, tmp_path / "nowhere", TINY)


def test_import_rejects_wrong_shapes(tmp_path):
    src = _pool(slots=1)
    export_slot(src, 0, tmp_path / "req", {"n_tokens": 12, "prompt_token_ids": []})
    meta = json.loads((tmp_path / "req" / META_FILE).read_text())
    meta["n_tokens"] = 20  # entries now claim more live rows than the file holds
    (tmp_path / "req" / META_FILE).write_text(json.dumps(meta))
    with pytest.raises(ValueError, match=r"state.safetensors: tensor layers\.\d\.\w+\.entries has shape"):
        import_slot(_pool(slots=1), 0, tmp_path / "req", TINY)
