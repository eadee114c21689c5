"""The upstream-style rival against the reference and `BlockTables`: a fair rival is right."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cp_blocktables import PAD_SLOT_ID, BlockTables, BlockTablesConfig
from cp_blocktables.bench.upstream_rival import UpstreamBlockTables
from cp_blocktables.reference import ReferenceBlockTables

POISON = 7
CPU = torch.device("cpu")


class RivalPair:
    """An `UpstreamBlockTables` owning zero tables, and the reference fed the same calls."""

    def __init__(self, device: torch.device, **kwargs) -> None:
        self.device = device
        self.cfg = BlockTablesConfig(**kwargs)
        self.rival = UpstreamBlockTables.owned_state(self.cfg, device)
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
    num_groups = int(rng.integers(1, 4))
    cp_size = int(rng.choice([1, 2, 4]))
    block_sizes = [int(rng.choice([1, 4, 16])) for _ in range(num_groups)]
    sharded = [bool(rng.random() < 0.7) for _ in range(num_groups)]
    limit = min([bs for bs, s in zip(block_sizes, sharded) if s] or [16])
    interleave = int(rng.choice([i for i in (1, 2, 4) if limit % i == 0]))
    return dict(
        block_sizes=block_sizes,
        max_num_reqs=int(rng.integers(1, 7)),
        max_num_batched_tokens=40,
        max_num_blocks_per_group=[int(rng.integers(1, 12)) for _ in range(num_groups)],
        cp_size=cp_size,
        cp_rank=int(rng.integers(cp_size)),
        cp_interleave=interleave,
        slot_mapping_enabled=[bool(rng.random() < 0.85) for _ in range(num_groups)],
        dcp_sharded=sharded,
        sliding_window_reach=[int(rng.choice([0, 3, 17])) for _ in range(num_groups)],
    )


def random_appends(rng: np.random.Generator, p: RivalPair) -> None:
    """Appends to distinct rows (one program per write: a step writes a row once, as engines do)."""
    cfg = p.cfg
    for r in rng.permutation(cfg.max_num_reqs)[: int(rng.integers(0, cfg.max_num_reqs + 1))]:
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
        n = int(rng.integers(0, 6)) if span else 0
        lens.append(n)
        positions.append(rng.integers(0, max(span, 1), size=n))
    qsl = np.concatenate([[0], np.cumsum(lens, dtype=np.int64)])
    positions = np.concatenate(positions + [np.zeros(1, np.int64)]).astype(np.int64)
    return idx.astype(np.int32), qsl.astype(np.int32), positions


@pytest.mark.parametrize("seed", range(6), ids=lambda s: f"seed-{s}")
def test_random_steps_match_reference(seed):
    rng = np.random.default_rng(seed)
    cfg = random_config(rng)
    p = RivalPair(CPU, **cfg)
    for step in range(2):
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


def test_dummy_tokens_and_tail_are_pad():
    p = RivalPair(
        CPU, block_sizes=[4], max_num_reqs=3, max_num_batched_tokens=12,
        max_num_blocks_per_group=[6],
    )  # fmt: skip
    p.append(2, ([3, 4],))
    p.rival.apply_staged_writes()
    out = torch.zeros((1, 12), dtype=torch.int64)
    p.rival.compute_slot_mappings(
        p.tensor([2, -1]), p.tensor([0, 3, 5]), p.tensor([1, 4, 7, 0, 0], torch.int64), out
    )
    assert out[0, :3].tolist() == [3 * 4 + 1, 4 * 4 + 0, 4 * 4 + 3]
    assert (out[0, 3:] == PAD_SLOT_ID).all()


@pytest.mark.parametrize("cp_size", [1, 4])
def test_outputs_equal_ours_bit_for_bit(cp_size):
    """The benchmark's comparison in small: shared tables, a shuffled batch, two groups."""
    rng = np.random.default_rng(cp_size)
    widths = [40, 20]
    bt = BlockTables([16, 32], 8, 64, widths, CPU, cp_size=cp_size, cp_rank=cp_size // 2)
    for g, t in enumerate(bt.block_tables):
        t.gpu.copy_(torch.randint(1, 2**31 - 1, tuple(t.gpu.shape), dtype=torch.int32))
        bt.num_blocks.np[g, :] = widths[g]
    bt.num_blocks.copy_to_uva()
    rival = UpstreamBlockTables(bt.config, [t.gpu for t in bt.block_tables], bt.num_blocks.gpu)
    lens = np.array([1, 17, 1, 30, 3])
    qsl = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32)
    positions = torch.tensor(
        np.concatenate([rng.integers(0, 600) + np.arange(n) for n in lens]), dtype=torch.int64
    )
    idx = torch.tensor(rng.permutation(8)[: lens.size], dtype=torch.int32)
    ours = bt.compute_slot_mappings(idx, qsl, positions, 64)
    theirs = rival.compute_slot_mappings(idx, qsl, positions, torch.zeros_like(bt.slot_mappings))
    assert torch.equal(ours, theirs)
    tables = bt.gather_block_tables(idx, 7)
    out = [torch.full_like(t, POISON) for t in bt.input_block_tables]
    rival.gather_block_tables(idx, 7, out)
    for mine, rivals in zip(tables, out):
        assert torch.equal(mine, rivals[:7])
