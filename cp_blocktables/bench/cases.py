"""The kernel benchmark's cases: inputs, and one function per family of rows.

Every row is measured inside `guarded`: an exception becomes the row's
`error` and the run goes on with the next row.
"""

from __future__ import annotations

import contextlib
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np
import torch

from .._jit import dual_jit
from ..block_tables import BlockTables
from ..contract import BlockTablesConfig
from .report import Row, tokens_label
from .timing import Timer
from .torch_rival import TorchBlockTables
from .upstream_rival import UpstreamBlockTables

MAX_REQS = 1024
BLOCK_SIZES = (16, 16, 32, 64)  # group g of a 4-group model; 1 group uses the first
MAX_CONTEXT = 32768  # decodes sit below this; prefill chunks start (prefix-cached) below half
DECODE_ONLY_UP_TO = 256  # batches of at most this many tokens are pure decode
MIXED_DECODES = 128  # larger batches: this many decodes ...
MIXED_PREFILLS = 128  # ... and this many prefill chunks sharing the remaining tokens
GATHER_BLOCK_SIZE = 16
WRITE_GROUPS = 4
WRITE_IDS = 4  # block ids appended per request and group in one step


def guarded(rows: list[Row], row: Row, measure: Callable[[Row], None]) -> None:
    """Run `measure(row)`; on any exception record it in `row.error`. Append the row."""
    try:
        measure(row)
    except Exception as e:  # noqa: BLE001 - one failing row must not stop the others
        row.error = f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
        row.extra["traceback"] = traceback.format_exc(limit=6)
        if torch.cuda.is_available():
            # A sticky CUDA error makes later rows fail too; each records it.
            with contextlib.suppress(Exception):
                torch.cuda.synchronize()
    rows.append(row)


def random_table_ids(shape: tuple[int, ...], gen: torch.Generator, device) -> torch.Tensor:
    """Block ids in [1, 2**31 - 1): never the null block, slots pass 2**31."""
    return torch.randint(1, 2**31 - 1, shape, generator=gen, dtype=torch.int32, device=device)


def fill(bt: BlockTables, gen: torch.Generator) -> None:
    """Every row of every table full of random ids, and the counts published."""
    for g, t in enumerate(bt.block_tables):
        t.gpu.copy_(random_table_ids(tuple(t.gpu.shape), gen, bt.device))
        bt.num_blocks.np[g, :] = t.gpu.shape[1]
    bt.num_blocks.copy_to_uva()
    bt.validate_inputs = False  # no rival validates values either


def batch(
    tokens: int, rng: np.random.Generator, max_context: int = MAX_CONTEXT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(rows [R] int32, lens [R] int64, positions [tokens] int64)` of a realistic batch.

    Up to `DECODE_ONLY_UP_TO` tokens: one decode token per request. Larger:
    decodes and prefill chunks (starting at prefix-cached positions), shuffled.
    Decodes sit below `max_context`, prefill chunks start below half of it.
    """
    if tokens <= DECODE_ONLY_UP_TO:
        lens = np.ones(tokens, dtype=np.int64)
        first = rng.integers(0, max_context, size=tokens)
    else:
        prefill = tokens - MIXED_DECODES
        chunks = np.full(MIXED_PREFILLS, prefill // MIXED_PREFILLS, dtype=np.int64)
        chunks[: prefill % MIXED_PREFILLS] += 1
        lens = np.concatenate([np.ones(MIXED_DECODES, dtype=np.int64), chunks])
        first = np.concatenate(
            [
                rng.integers(0, max_context, size=MIXED_DECODES),
                rng.integers(0, max_context // 2, size=MIXED_PREFILLS),
            ]
        )
        order = rng.permutation(lens.size)
        lens, first = lens[order], first[order]
    begin = np.cumsum(lens) - lens
    positions = np.repeat(first - begin, lens) + np.arange(tokens)
    rows = rng.permutation(MAX_REQS)[: lens.size].astype(np.int32)
    return rows, lens, positions.astype(np.int64)


def slot_bytes(
    cfg: BlockTablesConfig, idx: torch.Tensor, lens: torch.Tensor, pos: torch.Tensor
) -> int:
    """Positions, qsl and idx read; the whole buffer written; each distinct table entry read."""
    num_reqs, num_tokens = idx.shape[0], pos.shape[0]
    total = 8 * num_tokens + 4 * (num_reqs + 1) + 4 * num_reqs
    total += 8 * cfg.num_kv_cache_groups * cfg.max_num_batched_tokens
    row = torch.repeat_interleave(idx.to(torch.int64), lens)  # [num_tokens]
    for g, width in enumerate(cfg.max_num_blocks_per_group):
        cp, bs = cfg.group_cp_size(g), cfg.block_sizes[g]
        key = row * width + pos // (bs * cp)
        if cp > 1:
            key = key[((pos % (bs * cp)) // cfg.cp_interleave) % cp == cfg.cp_rank]
        total += 4 * int(torch.unique(key).numel())
    return total


# ---------------------------------------------------------------- a step's reads


@dataclass
class _ReadInputs:
    """One rotated copy of a step's inputs, and the rival's outputs."""

    idx: torch.Tensor  # int32 [num_reqs]
    qsl: torch.Tensor  # int32 [num_reqs + 1]
    pos: torch.Tensor  # int64 [num_tokens]
    slots: torch.Tensor  # int64 [groups, tokens], the rival's
    tables: list[torch.Tensor]  # the rival's gathered tables
    torch_slots: torch.Tensor


class _ReadCase:
    """One (tokens, groups, cp) configuration: its state, and one method per row."""

    def __init__(self, timer: Timer, tokens: int, groups: int, cp: int, batch_, gen) -> None:
        self.timer, self.tokens, self.groups, self.cp, self.gen = timer, tokens, groups, cp, gen
        self.req_rows, self.lens, self.positions = batch_
        self.num_reqs = len(self.req_rows)
        self.qsl = np.concatenate([[0], np.cumsum(self.lens)]).astype(np.int32)

    def setup(self) -> None:
        device, tokens, groups = self.timer.device, self.tokens, self.groups
        block_sizes = list(BLOCK_SIZES[:groups])
        top = int(self.positions.max())
        widths = [top // bs + 1 for bs in block_sizes]
        bt = BlockTables(
            block_sizes, MAX_REQS, tokens, widths, device, cp_size=self.cp, cp_rank=self.cp // 2
        )
        fill(bt, self.gen)
        tables = [t.gpu for t in bt.block_tables]
        self.bt = bt
        self.rival = UpstreamBlockTables(bt.config, tables, bt.num_blocks.gpu)
        self.torch = TorchBlockTables(bt.config, tables, bt.num_blocks.gpu)
        n = self.timer.num_sets(8 * tokens * (1 + 2 * groups))
        self.sets = [
            _ReadInputs(
                torch.tensor(self.req_rows, device=device),
                torch.tensor(self.qsl, device=device),
                torch.tensor(self.positions, device=device),
                torch.empty((groups, tokens), dtype=torch.int64, device=device),
                [torch.zeros_like(t) for t in bt.input_block_tables],
                torch.empty((groups, tokens), dtype=torch.int64, device=device),
            )
            for _ in range(n)
        ]

    def slots(self, row: Row, with_torch: bool) -> None:
        self.setup()
        bt, rival, sets, tokens = self.bt, self.rival, self.sets, self.tokens
        ours = self.timer.time(
            [partial(bt.compute_slot_mappings, s.idx, s.qsl, s.pos, tokens) for s in sets]
        )
        theirs = self.timer.time(
            [partial(rival.compute_slot_mappings, s.idx, s.qsl, s.pos, s.slots) for s in sets]
        )
        _fill_row(row, ours, theirs)
        row.params["slot_layout"] = self.slot_layout = bt._slot_plan.layout(self.num_reqs, tokens)
        s = sets[0]
        mine = bt.compute_slot_mappings(s.idx, s.qsl, s.pos, tokens)
        row.agrees = torch.equal(mine, s.slots)
        if with_torch:
            f = self.torch.compute_slot_mappings
            t = self.timer.time(
                [partial(f, s.idx, s.qsl, s.pos, s.torch_slots) for s in sets], host=False
            )
            row.torch_device_us = t.device_us
            row.agrees = row.agrees and torch.equal(mine, s.torch_slots)
        lens = torch.tensor(self.lens, device=self.timer.device)
        row.bytes = self.slot_bytes = slot_bytes(bt.config, s.idx, lens, s.pos)

    def gather(self, row: Row) -> None:
        bt, rival, sets, n = self.bt, self.rival, self.sets, self.num_reqs
        ours = self.timer.time([partial(bt.gather_block_tables, s.idx, n) for s in sets])
        theirs = self.timer.time(
            [partial(rival.gather_block_tables, s.idx, n, s.tables) for s in sets]
        )
        _fill_row(row, ours, theirs)
        s = sets[0]
        mine = bt.gather_block_tables(s.idx, n)
        row.agrees = all(torch.equal(a, b[:n]) for a, b in zip(mine, s.tables))
        row.bytes = self.gather_bytes = 8 * n + 8 * n * sum(t.shape[1] for t in s.tables)

    def _rival_both(self, s: _ReadInputs) -> None:
        self.rival.gather_block_tables(s.idx, self.num_reqs, s.tables)
        self.rival.compute_slot_mappings(s.idx, s.qsl, s.pos, s.slots)

    def both(self, row: Row) -> None:
        bt, sets, n, tokens = self.bt, self.sets, self.num_reqs, self.tokens
        f = bt.gather_and_compute_slot_mappings
        ours = self.timer.time([partial(f, s.idx, n, s.qsl, s.pos, tokens) for s in sets])
        theirs = self.timer.time([partial(self._rival_both, s) for s in sets])
        _fill_row(row, ours, theirs)
        row.params["slot_layout"] = self.slot_layout
        s = sets[0]
        tables, mine = f(s.idx, n, s.qsl, s.pos, tokens)
        row.agrees = torch.equal(mine, s.slots) and all(
            torch.equal(a, b[:n]) for a, b in zip(tables, s.tables)
        )
        row.bytes = self.slot_bytes + self.gather_bytes  # both reads' bytes

    def rows(self, with_torch: bool) -> list[Row]:
        case = f"T={tokens_label(self.tokens)} G={self.groups} cp={self.cp}"
        params = dict(
            tokens=self.tokens, groups=self.groups, cp_size=self.cp, requests=self.num_reqs,
            decode=self.tokens <= DECODE_ONLY_UP_TO,
        )  # fmt: skip
        rows: list[Row] = []
        guarded(rows, Row("compute_slot_mappings", case, dict(params)),
                partial(self.slots, with_torch=with_torch))  # fmt: skip
        if hasattr(self, "bt"):
            guarded(rows, Row("gather_block_tables", case, dict(params)), self.gather)
            if hasattr(BlockTables, "gather_and_compute_slot_mappings"):
                kind = "gather_and_compute_slot_mappings"
                guarded(rows, Row(kind, case, dict(params)), self.both)
        return rows


def read_rows(timer: Timer, cfg: dict, rng, gen, with_torch: bool) -> list[Row]:
    """For each (tokens, groups, cp): slot mappings, gather, and both in one call, vs the rival."""
    rows = []
    for tokens in cfg["tokens"]:
        batch_ = batch(tokens, rng, cfg.get("max_context", MAX_CONTEXT))
        for groups in cfg["groups"]:
            for cp in cfg["cp_sizes"]:
                rows += _ReadCase(timer, tokens, groups, cp, batch_, gen).rows(with_torch)
    return rows


def _fill_row(row: Row, ours, theirs) -> None:
    row.device_us, row.host_us, row.timing = ours.device_us, ours.host_us, ours.method
    row.rival_device_us, row.rival_host_us = theirs.device_us, theirs.host_us


# ---------------------------------------------------------------- gathers with masking


def _masked_gather(
    timer: Timer, gen, blocks: int, reqs: int, masked: bool, req_rows, nct, row: Row
) -> None:
    device, bs = timer.device, GATHER_BLOCK_SIZE
    reach = blocks * bs // 4
    bt = BlockTables([bs], MAX_REQS, 1, [blocks], device, sliding_window_reach=[reach])
    fill(bt, gen)
    rival = UpstreamBlockTables(bt.config, [bt.block_tables[0].gpu], bt.num_blocks.gpu)
    out = [torch.zeros_like(bt.input_block_tables[0])]
    idx = torch.tensor(req_rows, device=device)
    n = torch.tensor(nct, device=device) if masked else None
    ours = timer.time([partial(bt.gather_block_tables, idx, reqs, num_computed_tokens=n)])
    theirs = timer.time([partial(rival.gather_block_tables, idx, reqs, out, n)])
    _fill_row(row, ours, theirs)
    mine = bt.gather_block_tables(idx, reqs, num_computed_tokens=n)
    row.agrees = torch.equal(mine[0], out[0][:reqs])
    dead = np.clip((nct.astype(np.int64) - reach) // bs, 0, blocks)
    live = reqs * blocks - (int(dead[req_rows].sum()) if masked else 0)
    row.bytes = 4 * reqs * (2 + masked) + 4 * live + 4 * reqs * blocks


def gather_rows(timer: Timer, cfg: dict, rng, gen) -> list[Row]:
    """Wide rows of one group, without and with sliding-window masking."""
    rows, bs = [], GATHER_BLOCK_SIZE
    for blocks in cfg["gather_blocks"]:
        nct = rng.integers(blocks * bs // 2, blocks * bs + 1, size=MAX_REQS).astype(np.int32)
        for reqs in cfg["gather_reqs"]:
            req_rows = rng.permutation(MAX_REQS)[:reqs].astype(np.int32)
            for masked in (False, True):
                params = dict(requests=reqs, blocks_per_row=blocks, sliding_window=masked)
                case = f"R={reqs} W={blocks}" + (" swa" if masked else "")
                measure = partial(_masked_gather, timer, gen, blocks, reqs, masked, req_rows, nct)
                guarded(rows, Row("gather_block_tables", case, params), measure)
    return rows


# ---------------------------------------------------------------- a step's writes


def write_rows(timer: Timer, cfg: dict, rng) -> list[Row]:
    """`append_block_ids` for every request, then the apply: ours against the rival's writer."""
    reqs, groups, k = cfg["write_reqs"], WRITE_GROUPS, WRITE_IDS
    kwargs = dict(
        block_sizes=[16] * groups, max_num_reqs=reqs, max_num_batched_tokens=1,
        max_num_blocks_per_group=[k] * groups,
    )  # fmt: skip
    steps = [
        [tuple(rng.integers(1, 2**31 - 1, size=(groups, k)).tolist()) for _ in range(reqs)]
        for _ in range(4)
    ]
    case = f"{reqs} reqs x {groups} groups x {k} ids"
    params = dict(requests=reqs, groups=groups, ids=k)
    rows: list[Row] = []
    figures: dict = {}

    def stage_into(target) -> Callable[[int], None]:
        def stage(i: int) -> None:
            append = target.append_block_ids
            for r, ids in enumerate(steps[i % len(steps)]):
                append(r, ids, True)

        return stage

    def measure(row: Row) -> None:
        ours = BlockTables(device=timer.device, **kwargs)
        rival = UpstreamBlockTables.owned_state(BlockTablesConfig(**kwargs), timer.device)
        figures["ours"] = timer.steps(stage_into(ours), ours.apply_staged_writes, reqs)
        figures["rival"] = timer.steps(stage_into(rival), rival.apply_staged_writes, reqs)
        row.agrees = all(torch.equal(a.gpu, b) for a, b in zip(ours.block_tables, rival.tables))
        row.agrees = row.agrees and torch.equal(ours.num_blocks.gpu.cpu(), rival.num_blocks.cpu())
        _step_row(row, "step_us", figures)
        row.bytes = 8 * reqs * groups * k + 12 * reqs * groups

    guarded(rows, Row("step writes (append + apply)", case, dict(params)), measure)
    for kind, key, decode in (("append_block_ids", "call_us", True),
                              ("apply_staged_writes", "apply_us", False)):  # fmt: skip
        row = Row(kind, case, dict(params, decode=decode), agrees=rows[0].agrees)
        guarded(rows, row, partial(_step_row, key=key, figures=figures))
    return rows


def _step_row(row: Row, key: str, figures: dict) -> None:
    if not figures:
        raise RuntimeError("the step row failed; see it")
    row.host_us, row.rival_host_us = figures["ours"][key], figures["rival"][key]
    row.timing = "host wall, one sync per step"


# ---------------------------------------------------------------- yardsticks


@dual_jit
def _empty_kernel(x):
    pass


def yardstick_rows(timer: Timer, cfg: dict, gen) -> list[Row]:
    device, rows = timer.device, []
    x = torch.empty(1, dtype=torch.int32, device=device)

    def floor(row: Row) -> None:
        t = timer.time([lambda: _empty_kernel.launch(device, (1,), x)])
        row.device_us, row.host_us, row.timing = t.device_us, t.host_us, t.method

    n = cfg["copy_bytes"]

    def copy(row: Row) -> None:
        src = random_table_ids((n // 4,), gen, device)
        dst = torch.empty_like(src)
        t = timer.time([lambda: dst.copy_(src)], host=False)
        row.device_us, row.timing, row.bytes = t.device_us, t.method, 2 * n

    guarded(rows, Row("launch_floor", "empty Triton kernel", {}), floor)
    guarded(rows, Row("copy", f"{n >> 20} MiB device-to-device", dict(bytes=n)), copy)
    return rows
