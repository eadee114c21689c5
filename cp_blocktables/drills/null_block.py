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

Modules: `options` (what every rank runs), `driver` (the world, its eras and
the verdict), `era` (one CP group at one size), `executor` (serving through
the harness), `warmup_steps` and `warmup_checks` (the warm-up's batches and
its own checks); this module is the warm-up stage.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from ..harness.checks import GroupChecker, Violation
from .era import Era
from .executor import Phase, ServingExecutor
from .options import SEED_STRIDE
from .report import describe_finding, finding
from .serving import WARMUP_UID_BASE
from .warmup import WarmupError, null_block_warmup
from .warmup_checks import FLAG, after_exit, appends_after, other_instance, staged_not_null
from .warmup_steps import pick_ids, warmup_steps, workload_of


class CaptureFailed(Exception):
    """What the drill raises inside a warm-up, as a failed graph capture would."""


class NullBlockEra(Era):
    """Steps 1 to 4 of the module doc for one CP group at one world size."""

    def stages(self):
        return [
            ("serve 1", lambda: self.serve(2 * self.era, "serve 1")),
            ("warm-up", self._warmup),
            ("serve 2", lambda: self.serve(2 * self.era + 1, "serve 2")),
        ]

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
        seed = self.opts.seed + SEED_STRIDE * (2 * self.era) + self.cp_index
        steps = warmup_steps(self.preset, seed, self.seat.recent_ids)
        run = Phase(
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
            GroupChecker(self.preset, workload_of(self.preset, steps)) if run.is_leader else None
        )
        ex = ServingExecutor(self.seat, self.preset, run.comm.device, None, "warm-up", True)
        with null_block_warmup(impl, pool, kv):
            run._steps(workload_of(self.preset, steps[:1]), ex, checker)
            with null_block_warmup(impl, pool, kv):
                run._steps(workload_of(self.preset, steps[1:2]), ex, checker)
            if getattr(impl, FLAG) is not True:
                found.append(
                    finding(
                        "flag-restored",
                        "a nested warm-up ended and left the outer warm-up's flag changed",
                        self.rank,
                        expected="True",
                        actual=repr(getattr(impl, FLAG)),
                    )
                )
            run._steps(workload_of(self.preset, steps[2:]), ex, checker)
            cp_rank = self.ecomm.cp_group(self.preset.cp_size)[2].index(self.rank)
            other_instance(found, self.cls, self.preset, cp_rank, self.rank, run.comm.device)
        after_exit(found, st, self.rank, live, flag0, pool0, "after the warm-up")
        appends_after(found, st, self.preset, self.rank, run.comm.device)
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
                    finding(
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
                finding(
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
                        pick_ids(self.preset, g, 1, self.seat.recent_ids, rng) for g in groups
                    )
                    impl.append_block_ids(row, ids, True)
                found += staged_not_null(impl, self.rank)
                raise CaptureFailed("simulated failure of a warm-up's graph capture")
        except CaptureFailed:
            propagated = True
        except Exception as e:  # noqa: BLE001 - the implementation's error is a finding
            found.append(
                finding(
                    "null-ids",
                    f"append_block_ids raised {type(e).__name__}: {e} in a warm-up",
                    self.rank,
                )
            )
            propagated = True
        if not propagated:
            found.append(
                finding(
                    "exception-propagates", "the warm-up swallowed the body's exception", self.rank
                )
            )
        after_exit(
            found, st, self.rank, live, flag0, pool0, "after an exception in the warm-up body"
        )
