"""The plain-PyTorch rival against the numpy reference: it must be right to be a fair rival."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import PAD_SLOT_ID, BlockTablesConfig
from cp_blocktables.bench.torch_rival import TorchBlockTables, _StagedWrites
from cp_blocktables.reference import ReferenceBlockTables

POISON = 7


class RivalPair:
    """A `TorchBlockTables` over fresh zero tables and the reference fed the same calls."""

    def __init__(self, torch_device: torch.device, **kwargs) -> None:
        self.device = torch_device
        self.cfg = BlockTablesConfig(**kwargs)
        tables = [
            torch.zeros((self.cfg.max_num_reqs, m), dtype=torch.int32, device=torch_device)
            for m in self.cfg.max_num_blocks_per_group
        ]
        num_blocks = torch.zeros(
            (self.cfg.num_kv_cache_groups, self.cfg.max_num_reqs),
            dtype=torch.int32,
            device=torch_device,
        )
        self.rival = TorchBlockTables(self.cfg, tables, num_blocks)
        self.ref = ReferenceBlockTables(self.cfg)

    def tensor(self, values, dtype=torch.int32) -> torch.Tensor:
        return torch.tensor(np.asarray(values), dtype=dtype, device=self.device)

    def append(self, req_index: int, ids: tuple[list[int], ...], overwrite: bool = False) -> None:
        self.rival.append_block_ids(req_index, ids, overwrite)
        self.ref.append_block_ids(req_index, ids, overwrite)

    def assert_state(self, where: str = "") -> None:
        for g, t in enumerate(self.rival.tables):
            np.testing.assert_array_equal(t.cpu().numpy(), self.ref.tables[g], err_msg=where)
        np.testing.assert_array_equal(
            self.rival.num_blocks.cpu().numpy(), self.ref.num_blocks, err_msg=where
        )

    def assert_slots(self, idx, qsl, positions, where: str = "") -> None:
        out = torch.full(
            (self.cfg.num_kv_cache_groups, self.cfg.max_num_batched_tokens),
            POISON,
            dtype=torch.int64,
            device=self.device,
        )
        self.rival.compute_slot_mappings(
            self.tensor(idx), self.tensor(qsl), self.tensor(positions, torch.int64), out
        )
        expected = self.ref.slot_mappings(idx, qsl, np.asarray(positions), out.shape[1])
        np.testing.assert_array_equal(out.cpu().numpy(), expected, err_msg=where)

    def assert_gather(self, idx, num_rows, nct=None, where: str = "") -> None:
        out = [torch.full_like(t, POISON) for t in self.rival.tables]
        views = self.rival.gather_block_tables(
            self.tensor(idx), num_rows, out, None if nct is None else self.tensor(nct)
        )
        assert [len(v) for v in views] == [num_rows] * len(out), where
        expected = self.ref.gathered_block_tables(np.asarray(idx), num_rows, nct)
        for g, (values, defined) in enumerate(expected):
            got = out[g][:num_rows].cpu().numpy()
            np.testing.assert_array_equal(got[defined], values[defined], err_msg=f"{where} g{g}")


def random_config(rng: np.random.Generator) -> dict:
    num_groups = int(rng.integers(1, 5))
    cp_size = int(rng.choice([1, 2, 4]))
    block_sizes = [int(rng.choice([1, 4, 16, 64])) for _ in range(num_groups)]
    sharded = [bool(rng.random() < 0.7) for _ in range(num_groups)]
    limit = min([bs for bs, s in zip(block_sizes, sharded) if s] or [16])
    interleave = int(rng.choice([i for i in (1, 2, 4, 16) if limit % i == 0]))
    return dict(
        block_sizes=block_sizes,
        max_num_reqs=int(rng.integers(1, 9)),
        max_num_batched_tokens=64,
        max_num_blocks_per_group=[int(rng.integers(1, 24)) for _ in range(num_groups)],
        cp_size=cp_size,
        cp_rank=int(rng.integers(cp_size)),
        cp_interleave=interleave,
        slot_mapping_enabled=[bool(rng.random() < 0.85) for _ in range(num_groups)],
        dcp_sharded=sharded,
        sliding_window_reach=[int(rng.choice([0, 3, 17])) for _ in range(num_groups)],
    )


def random_appends(rng: np.random.Generator, p: RivalPair) -> None:
    """Appends to random rows, some rows twice in one step (overlapping staged writes)."""
    cfg = p.cfg
    for r in rng.integers(cfg.max_num_reqs, size=int(rng.integers(0, 2 * cfg.max_num_reqs))):
        overwrite = bool(rng.random() < 0.4)
        ids = []
        for g, cap in enumerate(cfg.max_num_blocks_per_group):
            room = cap - (0 if overwrite else int(p.ref.num_blocks[g, r]))
            n = int(rng.integers(0, room + 1))
            ids.append([int(x) for x in rng.integers(1, 2**31 - 1, size=n)])
        p.append(int(r), tuple(ids), overwrite)


def random_batch(rng: np.random.Generator, p: RivalPair):
    """Distinct rows and dummies; positions inside every enabled group's appended blocks."""
    cfg = p.cfg
    num_reqs = int(rng.integers(0, cfg.max_num_reqs + 1))
    rows = rng.permutation(cfg.max_num_reqs)[:num_reqs]
    idx = np.where(rng.random(num_reqs) < 0.2, -1, rows)
    lens, positions = [], []
    for r in idx:
        spans = [
            int(p.ref.num_blocks[g, r]) * cfg.block_sizes[g] * cfg.group_cp_size(g)
            for g in range(cfg.num_kv_cache_groups)
            if cfg.slot_mapping_enabled[g] and r >= 0
        ]
        span = min(spans, default=1000)
        n = int(rng.integers(0, 8)) if span else 0
        lens.append(n)
        positions.append(rng.integers(0, max(span, 1), size=n))
    qsl = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    extra = rng.integers(0, 1000, size=int(rng.integers(0, 3)))  # past num_tokens: ignored
    positions = np.concatenate(positions + [extra]).astype(np.int64)
    return idx.astype(np.int32), qsl.astype(np.int32), positions


@pytest.mark.parametrize("seed", range(16), ids=lambda s: f"seed-{s}")
def test_random_steps_match_reference(torch_device, seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    p = RivalPair(torch_device, **cfg)
    for step in range(3):
        where = f"seed {seed}, step {step}, config {cfg}"
        random_appends(rng, p)
        p.rival.apply_staged_writes()
        p.assert_state(where)
        p.assert_slots(*random_batch(rng, p), where=where)
        idx = random_batch(rng, p)[0]
        g = rng.integers(len(cfg["block_sizes"]), size=cfg["max_num_reqs"])
        reach = np.asarray(cfg["sliding_window_reach"])[g]
        bs = np.asarray(cfg["block_sizes"])[g]
        nct = reach + bs * rng.integers(0, 8, size=g.size) + rng.integers(-1, 2, size=g.size)
        use_nct = bool(rng.random() < 0.7)
        num_rows = int(rng.integers(len(idx), cfg["max_num_reqs"] + 1))
        p.assert_gather(idx, num_rows, np.maximum(nct, 0) if use_nct else None, where=where)


@pytest.fixture
def one_group(torch_device) -> RivalPair:
    return RivalPair(
        torch_device, block_sizes=[4], max_num_reqs=3, max_num_batched_tokens=12,
        max_num_blocks_per_group=[6],
    )  # fmt: skip


def test_overlapping_writes_keep_the_last(one_group):
    p = one_group
    p.append(1, ([5, 6, 7],))
    p.append(1, ([8, 9],), overwrite=True)
    p.append(1, ([10],))
    p.rival.apply_staged_writes()
    p.assert_state()
    assert p.rival.tables[0][1, :3].tolist() == [8, 9, 10]


def test_flattened_writes_name_each_element_once():
    """CUDA's `index_put_` with repeated indices picks any writer; the rival must not repeat."""
    staged = _StagedWrites()
    staged.add(1, 0, [5, 6, 7])
    staged.add(0, 1, [1])
    staged.add(1, 1, [9])
    flat, values = staged.flatten(row_stride=10)
    assert flat.tolist() == [10, 12, 1, 11]
    assert values.tolist() == [5, 7, 1, 9]


def test_dummy_tokens_and_tail_are_pad(one_group):
    p = one_group
    p.append(2, ([3, 4],))
    p.rival.apply_staged_writes()
    # Request 2 then a dummy; positions end before the buffer does.
    p.assert_slots([2, -1], [0, 3, 5], [1, 4, 7, 0, 0])
    out = torch.zeros((1, 12), dtype=torch.int64, device=p.device)
    p.rival.compute_slot_mappings(
        p.tensor([2, -1]), p.tensor([0, 3, 5]), p.tensor([1, 4, 7, 0, 0], torch.int64), out
    )
    assert out[0, :3].tolist() == [3 * 4 + 1, 4 * 4 + 0, 4 * 4 + 3]
    assert (out[0, 3:] == PAD_SLOT_ID).all()


def test_empty_batch_fills_pad(one_group):
    p = one_group
    p.assert_slots(np.zeros(0, np.int32), [0], np.zeros(0, np.int64))


def test_capacity_overflow_stages_nothing(torch_device):
    p = RivalPair(
        torch_device, block_sizes=[4, 4], max_num_reqs=2, max_num_batched_tokens=4,
        max_num_blocks_per_group=[4, 2],
    )  # fmt: skip
    with pytest.raises(RuntimeError, match="group 1"):
        p.rival.append_block_ids(0, ([1, 2], [3, 4, 5]), overwrite=False)
    p.rival.apply_staged_writes()
    p.assert_state()


@pytest.mark.parametrize(
    "tables, match",
    [
        pytest.param([torch.zeros((2, 4), dtype=torch.int64)], "tables\\[0\\]", id="dtype"),
        pytest.param([torch.zeros((2, 5), dtype=torch.int32)], "tables\\[0\\]", id="shape"),
        pytest.param([], "1 KV-cache groups", id="count"),
    ],
)
def test_bad_tables_are_refused(tables, match):
    cfg = BlockTablesConfig([4], 2, 4, [4])
    with pytest.raises(ValueError, match=match):
        TorchBlockTables(cfg, tables, torch.zeros((1, 2), dtype=torch.int32))
