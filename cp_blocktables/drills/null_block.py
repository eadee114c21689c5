"""`cp-blocktables drill null-block`: the elastic-EP warm-up, proved on live state, across ranks.

Each rank keeps a serving state (`serving.ServingState`: request pool, the
implementation's block tables, a KV cache per group written through the slot
mappings) and, per CP group of the world, in lockstep:

1. serves one harness workload (`serve 1`), checked step by step by the
   harness (`checks.GroupChecker`, SPEC.md section 6);
2. tries to start a warm-up while requests are still in the pool (it must be
   refused and change nothing), drains the pool, and records every live
   block's bytes;
3. starts a warm-up whose body fails midway (a capture that raises), then
   the real warm-up (`warmup.null_block_warmup`): warm-up requests in every
   row append real-looking block ids (the ids of live blocks), gather, map
   slots and write KV, one batch inside a nested warm-up. The harness checks
   these steps as warm-up steps (every id 0, every slot in block 0), and the
   drill's own checks (`report.WARMUP_CHECKS`) follow: live blocks unchanged, block
   0 zeroed, flag and pool restored, the redirect confined to its instance,
   appends after the warm-up staged as given;
4. serves a second workload (`serve 2`) on the same instance and caches,
   checked like the first, and drains.

Elastic resize (`--sizes 4,2,4`): the launched world stays, and each size is
an era with process groups of its own (`new_group`, destroyed after the
era). CP groups of the ranks that stay keep their state, caches included;
ranks that leave drop theirs and return fresh. Every era runs steps 1 to 4.
Ranks outside an era wait for it, watching the others' heartbeats.

Findings of every rank are all-gathered to its CP group's leader; the ranks
agree on each stage's verdict before the next one; rank 0 prints the report.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from ..contract import NULL_BLOCK_ID
from ..harness import checks, presets, runner
from ..harness.checks import GroupChecker, Violation
from ..harness.dist import Comm, PeerError, RankEnv, choose_backend, disarm_watchdog
from ..harness.impl_loader import ImplSpecError, load_impl
from ..harness.workload import Append, Step, Workload
from .faults import Fault
from .report import DrillReport, describe_finding
from .serving import JUNK_UID, WARMUP_UID_BASE, ServingState, block_id_range
from .warmup import WarmupError, null_block_warmup

DRILL_VERSION = "1"
FLAG = "redirect_writes_to_null_block"

_SEED_STRIDE = 1000


# ---------------------------------------------------------------- options


@dataclass
class DrillOptions:
    """What every rank runs; identical on every rank (compared before anything runs)."""

    impls: list[str]
    presets: list[str]
    sizes: list[int] = field(default_factory=list)
    seed: int = 0
    steps: int | None = None
    cp_size: int | None = None
    cp_interleave: int | None = None
    backend: str = "auto"
    device: str = "auto"
    timeout: float = 120.0
    fail_fast: bool = False
    report_path: str | None = None
    quiet: bool = False
    world_size: int = 4
    spawned: bool = False

    def agreement_fields(self) -> dict:
        return {
            "impls": self.impls,
            "presets": self.presets,
            "sizes": self.sizes,
            "seed": self.seed,
            "steps": self.steps,
            "cp_size": self.cp_size,
            "cp_interleave": self.cp_interleave,
            "fail_fast": self.fail_fast,
            "drill": DRILL_VERSION,
            "harness": runner.HARNESS_VERSION,
            "torch": torch.__version__,
        }

    def phase_options(self, phase: int) -> runner.VerifyOptions:
        """The harness options of serve phase `phase` (its workloads get seed + 1000 * phase)."""
        return runner.VerifyOptions(
            impls=self.impls,
            presets=self.presets,
            seed=self.seed + _SEED_STRIDE * phase,
            cp_size=self.cp_size,
            steps=self.steps,
            timeout=self.timeout,
        )


def plan(opts: DrillOptions, world_size: int) -> list[presets.Preset]:
    """The presets to drill, with overrides applied; `ValueError` naming what cannot run."""
    sizes = opts.sizes or [world_size]
    for s in sizes:
        if not 1 <= s <= world_size:
            raise ValueError(
                f"--sizes: world size {s} is outside [1, {world_size}] (the ranks launched)"
            )
    chosen = []
    for p in presets.resolve(opts.presets):
        p = p.with_overrides(opts.cp_size, opts.steps)
        if opts.cp_interleave is not None:
            p = dataclasses.replace(p, cp_interleave=opts.cp_interleave)
        p.validate()
        bad = [s for s in sizes if s % p.cp_size]
        if bad:
            raise ValueError(
                f"preset {p.name} needs cp_size {p.cp_size}, which does not divide world "
                f"size {bad[0]} of --sizes {','.join(map(str, sizes))}"
            )
        chosen.append(p)
    return chosen


# ---------------------------------------------------------------- process groups of one era


class _EraComm:
    """The launched world seen from one era: its first `size` ranks, in CP groups of `cp`.

    Every launched rank constructs it (group creation is collective over the
    launched world); members then use it where the harness uses a `Comm`.
    """

    def __init__(self, comm: Comm, size: int, cp: int, timeout: float, fault: Fault | None):
        self.comm, self.size, self.fault = comm, size, fault
        self.rank, self.world_size, self.device = comm.rank, size, comm.device
        t = timedelta(seconds=timeout)
        self.ranks = list(range(size))
        self.world = dist.new_group(self.ranks, timeout=t, backend="gloo")
        self._created = [self.world]
        self._cp = None
        for start in range(0, size, cp):
            ranks = list(range(start, start + cp))
            tensors = dist.new_group(ranks, timeout=t)
            objects = (
                tensors
                if comm.backend == "gloo"
                else dist.new_group(ranks, timeout=t, backend="gloo")
            )
            self._created += [tensors] if objects is tensors else [tensors, objects]
            if self.rank in ranks:
                self._cp = (tensors, objects, ranks)

    @property
    def member(self) -> bool:
        return self.rank < self.size

    def cp_group(self, cp: int) -> tuple[object, object, list[int]]:
        return self._cp

    def all_gather_object(self, obj: object, label: str, group=None, ranks=None) -> list:
        if self.fault is not None:
            self.fault.before_collective()
        if group is None:
            group, ranks = self.world, self.ranks
        return self.comm.all_gather_object(obj, label, group, ranks)

    def gather_tensor(self, t, label, dst, group, ranks):
        return self.comm.gather_tensor(t, label, dst, group, ranks)

    def any(self, flag: bool, label: str) -> bool:
        """Whether any rank of the era says so (every member learns it)."""
        return any(self.all_gather_object(bool(flag), label))

    def destroy(self) -> None:
        if not self.comm.teardown_safe:
            return
        for g in self._created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)


# ---------------------------------------------------------------- serving through the harness


class _Seat:
    """A rank's place in one CP group for one preset; its state outlives eras while it stays."""

    def __init__(self) -> None:
        self.state: ServingState | None = None
        self.recent_ids: list[list[int]] = []


class _ServingExecutor(runner._Executor):
    """The harness's executor, on a serving state: keeps the pool and writes KV every step.

    In a warm-up (`in_warmup`) the steps' appends come from warm-up requests,
    and the flag is left to the enclosing `null_block_warmup`.
    """

    def __init__(
        self,
        seat: _Seat,
        preset: presets.Preset,
        device,
        fault: Fault | None,
        where: str,
        in_warmup: bool = False,
    ) -> None:
        state = seat.state
        super().__init__(state.impl, preset, device)
        self.seat, self.state, self.fault, self.where = seat, state, fault, where
        self.in_warmup = in_warmup
        self.appended: list[set[int]] = [set() for _ in range(self.num_groups)]
        self.tokens = 0

    def run(self, step: Step):
        pool = self.state.pool
        if self.in_warmup:
            for a in step.appends:
                pool.admit_warmup(a.uid, a.row)
            drive = dataclasses.replace(step, kind="real")
        else:
            for r in step.admitted:
                pool.admit(r.uid, r.row)
            drive = step
        try:
            out = super().run(drive)
            if step.kind != "dummy":
                self._write_kv(step)
        finally:
            if self.in_warmup:
                for a in step.appends:
                    pool.release_warmup(a.row)
            else:
                for f in step.finished:
                    pool.finish(f.uid)
        if step.kind == "real":
            for a in step.appends:
                for g, ids in enumerate(a.block_ids):
                    self.appended[g].update(ids)
        if self.fault is not None:
            self.fault.after_step(step.index, self.where)
        return out

    def _write_kv(self, step: Step) -> None:
        """Every non-PAD slot of `[0, num_tokens_padded)` gets its token's tag, as engines write."""
        n = step.num_tokens_padded
        slots = self.impl.slot_mappings[:, :n].cpu().numpy()  # [groups, n]
        _, uids = step.token_rows()
        uid = np.full(n, JUNK_UID, dtype=np.int64)
        pos = np.arange(n, dtype=np.int64)
        real = np.flatnonzero(uids >= 0)
        uid[real] = uids[real]
        pos[real] = step.positions[real]
        self.state.write_kv(slots, uid, pos)
        self.tokens += len(real)


class _Phase(runner._PresetRun):
    """A harness preset run whose implementation instance and caches live in a `_Seat`."""

    def __init__(
        self,
        ecomm: _EraComm,
        opts: DrillOptions,
        phase: int,
        spec: str,
        cls: type,
        preset: presets.Preset,
        seat: _Seat,
        fault: Fault | None,
        where: str,
    ) -> None:
        totals = runner._RankTotals()
        super().__init__(ecomm, opts.phase_options(phase), spec, cls, preset, None, totals)
        self.seat, self.fault, self.where = seat, fault, where
        self.executor: _ServingExecutor | None = None

    def _build(self):
        if self.seat.state is None:
            impl, executor, found = super()._build()
            if executor is None:
                return impl, None, found
            self.seat.state = ServingState(impl, self.preset, self.comm.rank)
        ex = _ServingExecutor(self.seat, self.preset, self.comm.device, self.fault, self.where)
        found = ex.check_buffers()
        for v in found:
            v.rank = self.cp_rank
        self.executor = None if found else ex
        return self.seat.state.impl, self.executor, found


def _finding(check: str, what: str, rank: int, group: int | None = None, **kw: str) -> dict:
    return {"check": check, "what": what, "rank": rank, "group": group, **kw}


class _CaptureFailed(Exception):
    """What the drill raises inside a warm-up, as a failed graph capture would."""


def _construct(cls: type, preset: presets.Preset, cp_rank: int, device: torch.device):
    cfg = preset.config(cp_rank)
    return cls(
        cfg.block_sizes,
        cfg.max_num_reqs,
        cfg.max_num_batched_tokens,
        cfg.max_num_blocks_per_group,
        device,
        cp_size=cfg.cp_size,
        cp_rank=cfg.cp_rank,
        cp_interleave=cfg.cp_interleave,
        slot_mapping_enabled=cfg.slot_mapping_enabled,
        dcp_sharded=cfg.dcp_sharded,
        sliding_window_reach=cfg.sliding_window_reach,
    )


def _probe(impl: object, row: int, ids: list[int], device: torch.device) -> list[int]:
    """Append one id per group to `row`, apply, gather it: the first entry of each group."""
    impl.append_block_ids(row, tuple([i] for i in ids), True)
    impl.apply_staged_writes()
    idx = torch.tensor([row], dtype=torch.int32, device=device)
    return [int(t[0, 0]) for t in impl.gather_block_tables(idx, 1)]


def warmup_steps(preset: presets.Preset, seed: int, recent_ids: list[list[int]]) -> list[Step]:
    """Three warm-up batches: every row, then a third of them (with a dummy and padding), then
    another third. Each request appends ids from `recent_ids[g]` (live blocks) or, when those
    run out, from the group's id range; tokens sit anywhere in the blocks appended.
    """
    cfg = preset.config(0)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5EED]))
    groups = range(cfg.num_kv_cache_groups)
    virtual = min((cfg.block_sizes[g] * cfg.group_cp_size(g) for g in groups), default=1)
    most = min([3, *cfg.max_num_blocks_per_group])
    rows = rng.permutation(cfg.max_num_reqs).tolist()
    third = max(1, len(rows) // 3)
    batches = [rows, rows[:third], rows[third : 2 * third] or rows[:1]]
    window = any(w > 0 for w in cfg.sliding_window_reach)
    steps, uid = [], WARMUP_UID_BASE
    for index, batch in enumerate(batches):
        per = max(1, min(8, cfg.max_num_batched_tokens // (len(batch) + 2)))
        entries, appends = [], []
        nct = np.zeros(cfg.max_num_reqs, dtype=np.int32)
        for row in batch:
            uid += 1
            n_blocks = int(rng.integers(1, most + 1))
            ids = tuple(tuple(_pick_ids(preset, g, n_blocks, recent_ids, rng)) for g in groups)
            span = n_blocks * virtual
            n = int(rng.integers(1, min(per, span) + 1))
            start = int(rng.integers(0, span - n + 1))
            appends.append(Append(uid, row, ids, True))
            entries.append((uid, row, start, n))
            nct[row] = start
        if index == 1 and len(entries) < cfg.max_num_reqs:
            entries.insert(int(rng.integers(len(entries) + 1)), (-1, -1, 0, 2))
        steps.append(_warmup_step(index, appends, entries, nct if window else None, cfg))
    return steps


def _pick_ids(preset, g: int, n: int, recent_ids: list[list[int]], rng) -> list[int]:
    pool = recent_ids[g] if g < len(recent_ids) else []
    if len(pool) >= n:
        return [int(x) for x in rng.choice(pool, n, replace=False)]
    first, count = block_id_range(preset, g)
    return [int(x) for x in rng.integers(first, first + count, n)]


def _warmup_step(index: int, appends: list[Append], entries: list, nct, cfg) -> Step:
    counts = [e[3] for e in entries]
    qsl = np.zeros(len(entries) + 1, dtype=np.int32)
    qsl[1:] = np.cumsum(counts)
    num_tokens = int(qsl[-1])
    padded = min(cfg.max_num_batched_tokens, -(-num_tokens // 8) * 8)
    positions = np.concatenate(
        [np.arange(e[2], e[2] + e[3], dtype=np.int64) for e in entries]
        + [np.zeros(padded - num_tokens, dtype=np.int64)]
    )
    return Step(
        index=index,
        kind="warmup",
        appends=appends,
        idx_mapping=np.array([e[1] for e in entries], dtype=np.int32),
        uids=np.array([e[0] for e in entries], dtype=np.int64),
        query_start_loc=qsl,
        positions=positions,
        num_tokens_padded=padded,
        num_reqs_padded=min(cfg.max_num_reqs, len(entries) + (index == 1)),
        num_computed_tokens=nct,
    )


def _workload(preset: presets.Preset, steps: list[Step]) -> Workload:
    return Workload(preset, 0, steps, {}, "", [], None, 0)


class _Era:
    """Steps 1 to 4 of the module doc for one CP group at one world size."""

    def __init__(
        self,
        ecomm: _EraComm,
        opts: DrillOptions,
        spec: str,
        cls: type,
        preset: presets.Preset,
        seat: _Seat,
        era: int,
        fault: Fault | None,
    ) -> None:
        self.ecomm, self.opts, self.spec, self.cls = ecomm, opts, spec, cls
        self.preset, self.seat, self.era, self.fault = preset, seat, era, fault
        self.rank = ecomm.rank
        self.cp_index = ecomm.rank // preset.cp_size
        self.base = {
            "impl": spec,
            "preset": preset.name,
            "era": era,
            "size": ecomm.size,
            "cp_group": self.cp_index,
            "ranks": list(ecomm.cp_group(preset.cp_size)[2]),
            "kept_state": seat.state is not None,
        }

    def run(self) -> tuple[list[dict], bool]:
        """This CP group's records (on its leader) and whether any CP group of the era failed."""
        records = []
        stages = (
            ("serve 1", lambda: self._serve(2 * self.era, "serve 1")),
            ("warm-up", self._warmup),
            ("serve 2", lambda: self._serve(2 * self.era + 1, "serve 2")),
        )
        for label, stage in stages:
            record = stage()
            if record is not None:
                records.append(record)
            failed = record is not None and bool(record["failures"])
            if self.ecomm.any(failed, f"verdict of {label} (world size {self.ecomm.size})"):
                return records, True
        self.seat.state.pool.drain()
        return records, False

    # ------------------------------------------------------------ serving

    def _serve(self, phase: int, label: str) -> dict | None:
        where = f"preset {self.preset.name}, {label}, world size {self.ecomm.size}"
        run = _Phase(
            self.ecomm,
            self.opts,
            phase,
            self.spec,
            self.cls,
            self.preset,
            self.seat,
            self.fault,
            where,
        )
        result = run.run()
        if run.executor is not None:
            self.seat.recent_ids = [sorted(s) for s in run.executor.appended]
        if result is None:
            return None
        failures = []
        if result["violations"]:
            failures.append(Violation(**result["violations"][0]).describe())
        enforced = self.opts.cp_interleave is None and result["coverage_enforced"]
        if enforced and result["missing_corners"]:
            failures.append(
                f"coverage: preset {result['preset']} promised corners it never reached: "
                f"{', '.join(result['missing_corners'])}"
            )
        read = sum(s["read_back"] for s in result["stats"])
        want = sum(s["read_expected"] for s in result["stats"])
        return {
            **self.base,
            "stage": label,
            "seed": result["seed"],
            "steps": result["steps_checked"],
            "tokens": result["tokens_checked"],
            "failures": failures,
            "failed_checks": sorted(result["violation_counts"]),
            "violations": result["violations"][:20],
            "findings": [],
            "summary": f"KV read back {read}/{want}",
        }

    # ------------------------------------------------------------ the warm-up

    def _warmup(self) -> dict | None:
        st = self.seat.state
        impl, pool, kv = st.impl, st.pool, st.kv_tensors()
        found: list[dict] = []
        refused = self._while_serving(found)
        pool.drain()
        live, flag0, pool0 = st.live(), getattr(impl, FLAG), pool.snapshot()
        writes0 = st.writes
        self._aborted(found, live, flag0, pool0)
        seed = self.opts.seed + _SEED_STRIDE * (2 * self.era) + self.cp_index
        steps = warmup_steps(self.preset, seed, self.seat.recent_ids)
        run = _Phase(
            self.ecomm,
            self.opts,
            2 * self.era,
            self.spec,
            self.cls,
            self.preset,
            self.seat,
            None,
            "warm-up",
        )
        checker = (
            GroupChecker(self.preset, _workload(self.preset, steps)) if run.is_leader else None
        )
        ex = _ServingExecutor(self.seat, self.preset, run.comm.device, None, "warm-up", True)
        with null_block_warmup(impl, pool, kv):
            run._steps(_workload(self.preset, steps[:1]), ex, checker)
            with null_block_warmup(impl, pool, kv):
                run._steps(_workload(self.preset, steps[1:2]), ex, checker)
            if getattr(impl, FLAG) is not True:
                found.append(
                    _finding(
                        "flag-restored",
                        "a nested warm-up ended and left the outer warm-up's flag changed",
                        self.rank,
                        expected="True",
                        actual=repr(getattr(impl, FLAG)),
                    )
                )
            run._steps(_workload(self.preset, steps[2:]), ex, checker)
            self._other_instance(found, run.comm.device)
        self._after_exit(found, live, flag0, pool0, "after the warm-up")
        self._appends_after(found, run.comm.device)
        mine = {
            "found": found,
            "live": sum(len(x.rows) for x in live),
            "writes": st.writes - writes0,
            "digest": hashlib.sha256("".join(x.digest() for x in live).encode()).hexdigest()[:12],
            "refused": refused,
        }
        metas = run.comm.all_gather_object(mine, "warm-up findings", run.ogroup, run.ranks)
        if checker is None:
            return None
        return self._warmup_record(steps, checker, metas, ex.tokens)

    def _warmup_record(self, steps, checker: GroupChecker, metas: list[dict], tokens: int) -> dict:
        found = [f for m in metas for f in m["found"]]
        failures = [Violation(**v.as_dict()).describe() for v in checker.violations[:1]]
        failures += [describe_finding(f) for f in found[:1]]
        rows = len({a.row for s in steps for a in s.appends})
        live = [m["live"] for m in metas]
        return {
            **self.base,
            "stage": "warm-up",
            "seed": None,
            "steps": checker.steps_checked,
            "tokens": tokens,
            "failures": failures,
            "failed_checks": sorted({str(k) for k in checker.counts} | {f["check"] for f in found}),
            "violations": [v.as_dict() for v in checker.violations[:20]],
            "findings": found[:50],
            "summary": f"{rows} warm-up rows, {sum(m['writes'] for m in metas)} KV writes, "
            f"{sum(live)} live blocks on {len(live)} ranks checked; "
            + (
                "refused while serving"
                if metas[0]["refused"].startswith("a null-block")
                else metas[0]["refused"]
            ),
            "live_digests": [m["digest"] for m in metas],
            "refusal": metas[0]["refused"],
        }

    def _while_serving(self, found: list[dict]) -> str:
        """A warm-up must refuse to start while requests are served, and change nothing."""
        st = self.seat.state
        impl, pool = st.impl, st.pool
        if not pool.serving():
            return "not exercised: the workload finished every request"
        flag, before, null = (
            getattr(impl, FLAG),
            pool.snapshot(),
            [c.data[0].clone() for c in st.caches],
        )
        message = ""
        try:
            with null_block_warmup(impl, pool, st.kv_tensors()):
                found.append(
                    _finding(
                        "refused-while-serving",
                        "a warm-up started with requests in the pool",
                        self.rank,
                    )
                )
        except WarmupError as e:
            message = str(e)
        unchanged = (
            getattr(impl, FLAG) == flag
            and pool.snapshot() == before
            and all(torch.equal(c.data[0], n) for c, n in zip(st.caches, null))
        )
        if not unchanged:
            found.append(
                _finding(
                    "refused-while-serving",
                    "the refused warm-up changed the flag, pool or block 0",
                    self.rank,
                )
            )
        return message

    def _aborted(self, found: list[dict], live, flag0: bool, pool0: tuple) -> None:
        """A warm-up whose body raises after staging appends: everything must still be undone."""
        st = self.seat.state
        impl, pool = st.impl, st.pool
        rng = np.random.default_rng(
            np.random.SeedSequence([self.opts.seed, self.era, self.cp_index])
        )
        groups = range(len(st.caches))
        propagated = False
        try:
            with null_block_warmup(impl, pool, st.kv_tensors()):
                for i, row in enumerate(pool.free_rows()[:3]):
                    pool.admit_warmup(WARMUP_UID_BASE + 1000 + i, row)
                    ids = tuple(
                        _pick_ids(self.preset, g, 1, self.seat.recent_ids, rng) for g in groups
                    )
                    impl.append_block_ids(row, ids, True)
                found += self._staged_not_null(impl)
                raise _CaptureFailed("simulated failure of a warm-up's graph capture")
        except _CaptureFailed:
            propagated = True
        except Exception as e:  # noqa: BLE001 - the implementation's error is a finding
            found.append(
                _finding(
                    "null-ids",
                    f"append_block_ids raised {type(e).__name__}: {e} in a warm-up",
                    self.rank,
                )
            )
            propagated = True
        if not propagated:
            found.append(
                _finding(
                    "exception-propagates", "the warm-up swallowed the body's exception", self.rank
                )
            )
        self._after_exit(found, live, flag0, pool0, "after an exception in the warm-up body")

    def _staged_not_null(self, impl: object) -> list[dict]:
        """For the project's own class: the staged lists themselves must hold only 0."""
        from ..block_tables import BlockTables

        if not isinstance(impl, BlockTables):
            return []
        out = []
        for g, t in enumerate(impl.block_tables):
            bad = [v for v in t._staged_write_contents if v != NULL_BLOCK_ID]
            if bad:
                out.append(
                    _finding(
                        "null-ids",
                        "a warm-up's append staged real block ids",
                        self.rank,
                        g,
                        expected="0",
                        actual=f"{bad[:4]}",
                    )
                )
        return out

    def _after_exit(self, found: list[dict], live, flag0: bool, pool0: tuple, when: str) -> None:
        st = self.seat.state
        flag = getattr(st.impl, FLAG)
        if flag != flag0:
            found.append(
                _finding(
                    "flag-restored",
                    f"{when}, the flag is not back",
                    self.rank,
                    expected=repr(flag0),
                    actual=repr(flag),
                )
            )
        if st.pool.snapshot() != pool0:
            found.append(
                _finding(
                    "pool-restored",
                    f"{when}, the pool differs",
                    self.rank,
                    expected=str(pool0)[:200],
                    actual=str(st.pool.snapshot())[:200],
                )
            )
        for g, cache in enumerate(st.caches):
            if not cache.null_block_is_zero():
                found.append(_finding("null-zeroed", f"{when}, block 0 is not zero", self.rank, g))
        for c in st.changed_blocks(live):
            found.append(
                _finding(
                    "live-kv",
                    f"{when}, block {c['block']} changed at offset {c['offset']}",
                    self.rank,
                    c["group"],
                    expected=c["before"],
                    actual=c["after"],
                )
            )

    def _other_instance(self, found: list[dict], device: torch.device) -> None:
        """Another instance, built during the warm-up, must stage what it is given."""
        ids = [block_id_range(self.preset, g)[0] for g in range(len(self.seat.state.caches))]
        cp_rank = self.ecomm.cp_group(self.preset.cp_size)[2].index(self.rank)
        try:
            other = _construct(self.cls, self.preset, cp_rank, device)
            flag = getattr(other, FLAG)
            got = _probe(other, 0, ids, device)
        except Exception as e:  # noqa: BLE001
            found.append(
                _finding(
                    "per-instance", f"a second instance raised {type(e).__name__}: {e}", self.rank
                )
            )
            return
        if flag is not False or got != ids:
            found.append(
                _finding(
                    "per-instance",
                    "an instance built during another's warm-up is redirected "
                    f"too (its flag reads {flag!r})",
                    self.rank,
                    expected=f"ids {ids}",
                    actual=f"ids {got}",
                )
            )

    def _appends_after(self, found: list[dict], device: torch.device) -> None:
        st = self.seat.state
        ids = [block_id_range(self.preset, g)[0] for g in range(len(st.caches))]
        try:
            got = _probe(st.impl, st.pool.free_rows()[0], ids, device)
        except Exception as e:  # noqa: BLE001
            found.append(
                _finding(
                    "appends-after",
                    f"an append after the warm-up raised {type(e).__name__}: {e}",
                    self.rank,
                )
            )
            return
        if got != ids:
            found.append(
                _finding(
                    "appends-after",
                    "ids appended after the warm-up were redirected",
                    self.rank,
                    expected=f"ids {ids}",
                    actual=f"ids {got}",
                )
            )


# ---------------------------------------------------------------- the whole drill on one rank


def run_drill_rank(opts: DrillOptions) -> int:
    """Join the launched world (torchrun's environment), run the drill, agree on the verdict."""
    env = RankEnv.from_environ()
    if env is None:
        print("cp-blocktables: no torchrun environment (RANK, WORLD_SIZE)", file=sys.stderr)
        return 2
    comm = Comm(env, choose_backend(opts.backend, env), opts.timeout, opts.device)
    return _run(comm, opts, Comm.init)


def run_drill_in_process_group(opts: DrillOptions) -> int:
    """The drill in a process group that the caller formed (a pytest plugin's ranks)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    env = RankEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)), world, "", 0)
    return _run(Comm(env, dist.get_backend(), opts.timeout), opts, Comm.adopt)


def _run(comm: Comm, opts: DrillOptions, join) -> int:
    t0 = time.monotonic()
    try:
        join(comm)
        return _drill(comm, opts, t0)
    except PeerError as e:
        print(f"cp-blocktables: {e}", file=sys.stderr, flush=True)
        return 1
    finally:
        disarm_watchdog()
        comm.close()


def _drill(comm: Comm, opts: DrillOptions, t0: float) -> int:
    loaded, chosen, error, fault = [], [], "", None
    try:
        fault = Fault.from_environ(comm.rank)
        loaded = [(spec, load_impl(spec)) for spec in opts.impls]
        chosen = plan(opts, comm.world_size)
    except (ImplSpecError, ValueError) as e:
        error = str(e)
    records = comm.all_gather_object(
        {"agree": opts.agreement_fields(), "error": error, "run": uuid.uuid4().hex[:12]},
        "drill start",
    )
    errors = {r: m["error"] for r, m in enumerate(records) if m["error"]}
    if errors:
        if comm.rank == 0:
            for r, msg in errors.items():
                print(f"cp-blocktables drill: rank {r}: {msg}", file=sys.stderr)
        return 2
    mismatch = checks.agreement_violations([m["agree"] for m in records], "drill options", -1)
    if mismatch:
        if comm.rank == 0:
            print(
                "cp-blocktables drill: refused before any step: the ranks were started with "
                "different options",
                file=sys.stderr,
            )
            for v in mismatch:
                print(f"  {v.describe()}", file=sys.stderr)
        return 1
    sizes = opts.sizes or [comm.world_size]
    results = _impls(comm, opts, loaded, chosen, sizes, fault, records[0]["run"])
    info = {
        "rank": comm.rank,
        "max_rss_mb": runner._max_rss_mb(),
        "wall_s": round(time.monotonic() - t0, 3),
    }
    gathered = comm.all_gather_object({"results": results, "info": info}, "end of drill")
    report = DrillReport(opts, comm.world_size, comm.backend, sizes, gathered)
    if comm.rank == 0:
        report.emit()
    return 0 if report.passed() else 1


def _impls(comm, opts, loaded, chosen, sizes, fault, run_id: str) -> list[dict]:
    """Every implementation through every preset at every size; this rank's leader records."""
    results, n = [], 0
    for spec, cls in loaded:
        impl_failed = False
        for preset in chosen:
            seat, preset_failed = _Seat(), False
            for era, size in enumerate(sizes):
                n += 1
                votes = comm.all_gather_object(
                    {"preset": preset_failed, "impl": impl_failed},
                    f"start of era {era} ({spec}, preset {preset.name}, world size {size})",
                )
                impl_failed = any(v["impl"] for v in votes)
                if any(v["preset"] for v in votes) or (opts.fail_fast and impl_failed):
                    break
                ecomm = _EraComm(comm, size, preset.cp_size, opts.timeout, fault)
                try:
                    if ecomm.member:
                        recs, failed = _Era(ecomm, opts, spec, cls, preset, seat, era, fault).run()
                        results += recs
                        preset_failed |= failed
                        impl_failed |= failed
                        if comm.rank == 0:
                            comm.publish(f"drill/{run_id}/{n}")
                    else:
                        seat = _Seat()
                        comm.wait_for(
                            f"drill/{run_id}/{n}", ecomm.ranks, f"era {era} (world size {size})"
                        )
                finally:
                    ecomm.destroy()
    return results
