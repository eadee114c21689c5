"""One rank of a harness run: build the implementation, replay the workload, ship outputs.

Per preset, every rank of a CP group builds the implementation with its own
`cp_rank`, and per step it (1) appends, applies, gathers and computes slot
mappings through SPEC.md section 7's surface only, (2) checks what it can see
alone (returned views against the persistent buffers, dummy views' addresses,
exceptions), (3) all-gathers a small record (digest of its gathered tables,
local findings, the leader's verdict so far) and (4) gathers its persistent
outputs on the group's leader, which runs `checks.GroupChecker`.

Ranks stop a preset together: after a step in which any rank raised, or one
step after the leader saw the first violation (its verdict rides on the next
step's record, so the leader's checking overlaps the others' next step).
At the end every rank all-gathers the results, so all ranks agree on the exit
code; rank 0 writes the report.
"""

from __future__ import annotations

import dataclasses
import faulthandler
import hashlib
import json
import resource
import sys
import time
from dataclasses import dataclass

import torch

from . import checks, presets, probes, report, wake_probe
from .checks import GroupChecker, Violation
from .device_checks import split_on_device, use_device_checks
from .dist import (
    Comm,
    PeerError,
    RankEnv,
    arm_watchdog,
    choose_backend,
    disarm_watchdog,
    end_after_peer_failure,
)
from .executor import _Executor
from .features import UNSUPPORTED, Accepts, constructor_kwargs, inspect_factory, missing_methods
from .impl_loader import ImplSpecError, load_impl
from .options import VerifyOptions, plan
from .workload import Workload, generate

# ---------------------------------------------------------------- one preset on one rank


@dataclass
class _RankTotals:
    tokens: int = 0
    steps: int = 0
    busy_s: float = 0.0  # in the implementation's calls
    gather_s: float = 0.0  # moving the step's outputs to the CP group's leader
    check_s: float = 0.0  # the leader's checks (GroupChecker.check_step)
    warm_s: float = 0.0  # steps after a preset's first (compiles, communicators) ...
    warm_tokens: int = 0  # ... and the tokens they verified


class _PresetRun:
    def __init__(
        self,
        comm: Comm,
        opts: VerifyOptions,
        impl_spec: str,
        impl_cls: object,
        preset: presets.Preset,
        progress: report.Progress | None,
        totals: _RankTotals,
    ) -> None:
        self.comm, self.opts, self.preset = comm, opts, preset
        self.impl_spec, self.impl_cls = impl_spec, impl_cls
        self.accepts: Accepts = inspect_factory(impl_cls)
        self.unsupported: list[str] = []
        self.progress, self.totals = progress, totals
        c = preset.cp_size
        self.tgroup, self.ogroup, self.ranks = comm.cp_group(c)
        self.cp_rank = self.ranks.index(comm.rank)
        self.cp_index = comm.rank // c
        self.leader = self.ranks[0]
        self.is_leader = comm.rank == self.leader
        self.seed = opts.seed + self.cp_index

    def run(self) -> dict | None:
        t0 = time.monotonic()
        workload = generate(self.preset, self.seed, reach=self._corners_enforced())
        self.workload_steps = workload.steps
        impl, executor, found = self._build()
        checker = None
        if self.is_leader:
            on_device = use_device_checks(self.opts.checks, self.comm.device)
            checker = GroupChecker(
                self.preset, workload, device=self.comm.device if on_device else None
            )
        metas = self.comm.all_gather_object(
            self._start_record(workload, found),
            f"start of preset {self.preset.name}",
            self.ogroup,
            self.ranks,
        )
        start = checks.agreement_violations(
            [m["agree"] for m in metas], f"preset {self.preset.name} start", -1, self.ranks
        )
        local = [Violation(**v) for m in metas for v in m["found"]]
        stop = bool(start or local)
        if checker is not None:
            checker.record(start + local)
        steps_done = 0
        if not stop:
            steps_done = self._steps(workload, executor, checker)
        if self.progress is not None:
            self.progress.advance(self.preset.num_steps - steps_done)
        if checker is None:
            return None
        if steps_done == len(workload.steps) and checker.first_failed_step is None:
            checker.record(checker.read_back(len(workload.steps), workload.unfinished))
        return self._result(workload, checker, time.monotonic() - t0)

    def _build(self) -> tuple[object, _Executor | None, list[Violation]]:
        cfg = self.preset.config(self.cp_rank)
        kwargs = constructor_kwargs(self.preset, self.cp_rank, self.accepts)
        if self.preset.integrity_checks and "integrity_checks" not in kwargs:
            self.unsupported.append(f"integrity_checks (SPEC.md 8.3): {UNSUPPORTED}")
        try:
            impl = self.impl_cls(*probes.constructor_args(cfg, self.comm.device), **kwargs)
            executor = _Executor(impl, self.preset, self.comm.device)
            found = executor.check_buffers()
        except Exception as e:  # noqa: BLE001 - whatever the implementation raises is a finding
            return None, None, [self._error(-1, "constructor", e)]
        missing = missing_methods(impl)
        if any(s.fused_read for s in self.workload_steps):
            self.unsupported += [f"{m}: {UNSUPPORTED}" for m in missing]
        found += probes.run_probes(
            self.impl_cls, cfg, self.comm.device, kwargs, self.accepts, self.cp_rank,
            fused=not missing, first_cp_group=self.cp_index == 0,
            buffer_lengths=self.preset.probe_buffer_lengths,
        )  # fmt: skip
        if self.cp_index == 0:  # every CP rank of the preset's config; the other groups repeat it
            woke, skipped = wake_probe.probe_wake_up(
                self.impl_cls, probes.constructor_args(cfg, self.comm.device), kwargs,
                self.cp_rank, fused=not missing, seed=(self.seed,),
            )  # fmt: skip
            found += woke
            if skipped is not None:
                self.unsupported.append(skipped)
        for v in found:
            v.rank = self.cp_rank
        return impl, (None if found else executor), found

    def _start_record(self, workload: Workload, found: list[Violation]) -> dict:
        definition = json.dumps(self.preset.describe(), sort_keys=True)
        return {
            "agree": {
                "preset": self.preset.name,
                "cp_size": self.preset.cp_size,
                "definition": hashlib.sha256(definition.encode()).hexdigest()[:16],
                "seed": self.seed,
                "impl": self.impl_spec,
                "workload_digest": workload.digest[:16],
            },
            "found": [v.as_dict() for v in found],
        }

    def _steps(self, workload: Workload, executor: _Executor, checker: GroupChecker | None) -> int:
        done = 0
        for step in workload.steps:
            arm_watchdog(self.opts.timeout + 60)
            t = t_step = time.monotonic()
            try:
                bulk, found, digest = executor.run(step)
            except Exception as e:  # noqa: BLE001
                bulk, found, digest = executor.empty_bulk(), [self._error(step.index, "", e)], ""
            self.totals.busy_s += time.monotonic() - t
            for v in found:
                v.rank, v.step = self.cp_rank, step.index
            failed = checker is not None and checker.first_failed_step is not None
            label = f"step {step.index} of preset {self.preset.name}"
            metas = self.comm.all_gather_object(
                {
                    "digest": digest,
                    "found": [v.as_dict() for v in found],
                    "failed": failed,
                    "error": any(v.check == 0 for v in found),
                },
                label,
                self.ogroup,
                self.ranks,
            )
            t = time.monotonic()
            parts = self.comm.gather_tensor(bulk, label, self.leader, self.tgroup, self.ranks)
            if bulk.is_cuda:  # NCCL returns once the gather is queued
                torch.cuda.synchronize(bulk.device)
            self.totals.gather_s += time.monotonic() - t
            disarm_watchdog()
            done += 1
            self.totals.steps += 1
            self.totals.tokens += step.num_tokens if step.kind == "real" else 0
            if checker is not None:
                t = time.monotonic()
                if checker.dev is None:
                    (slots, tables), aux = executor.split_all(parts)
                else:  # the outputs stay where they were gathered
                    (slots, tables), aux = split_on_device(executor, parts)
                local = [Violation(**v) for m in metas for v in m["found"]]
                digests = [m["digest"] for m in metas]
                checker.check_step(step, slots, tables, local, digests, aux)
                self.totals.check_s += time.monotonic() - t
            if done > 1:
                self.totals.warm_s += time.monotonic() - t_step
                self.totals.warm_tokens += step.num_tokens if step.kind == "real" else 0
            if self.progress is not None:
                self.progress.advance(1, f"{self.preset.name} step {step.index}")
            if any(m["error"] for m in metas) or (metas[0]["failed"] and not self.opts.keep_going):
                break
        return done

    def _error(self, step: int, where: str, e: Exception) -> Violation:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        loc = f" at {tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else ""
        return Violation(
            0,
            f"{where + ' ' if where else ''}raised {type(e).__name__}: {e}{loc}",
            step,
            rank=self.cp_rank,
        )

    def _corners_enforced(self) -> bool:
        """A preset run at its own steps and CP size must reach every corner it promises."""
        return self.opts.cp_size is None and self.opts.steps is None

    def _result(self, workload: Workload, checker: GroupChecker, wall: float) -> dict:
        p = self.preset
        enforced = self._corners_enforced()
        plot = None
        if checker.plot_points and checker.plot_group is not None:
            plot = {
                "request": workload.plot_uid,
                "group": checker.plot_group,
                "points": checker.plot_points,
                "block_size": p.block_sizes[checker.plot_group],
                "cp_size": p.group_cp_size(checker.plot_group),
                "interleave": p.cp_interleave,
            }
        return {
            "impl": self.impl_spec,
            "preset": p.name,
            "cp_size": p.cp_size,
            "cp_interleave": p.cp_interleave,
            "cp_group": self.cp_index,
            "ranks": self.ranks,
            "seed": self.seed,
            "groups": [dataclasses.asdict(g) for g in p.groups],
            "steps_planned": len(workload.steps),
            "steps_checked": checker.steps_checked,
            "tokens_checked": checker.tokens_checked,
            "corners": workload.corners,
            "promised": sorted(p.corners),
            "missing_corners": workload.missing_corners(),
            "coverage_enforced": enforced,
            "unsupported": self.unsupported,
            "stats": checker.stat_rows(self.ranks),
            "violation_counts": {str(k): v for k, v in sorted(checker.counts.items())},
            "violations": [v.as_dict() for v in checker.violations],
            "plot": plot,
            "wall_s": round(wall, 3),
            "workload_digest": workload.digest,
        }


# ---------------------------------------------------------------- the whole run on one rank


def run_rank(opts: VerifyOptions) -> int:
    """Join the process group, run every preset for every implementation, agree on the verdict."""
    t0 = time.monotonic()
    if not faulthandler.is_enabled():  # a crash (a read past an input's end) shows where
        faulthandler.enable()
    env = RankEnv.from_environ()
    if env is None:
        print("cp-blocktables: no torchrun environment (RANK, WORLD_SIZE)", file=sys.stderr)
        return 2
    comm = Comm(env, choose_backend(opts.backend, env), opts.timeout, opts.device)
    try:
        comm.init()
        return _run(comm, opts, t0)
    except PeerError as e:
        return end_after_peer_failure(e)
    finally:
        disarm_watchdog()
        comm.close()


def _run(comm: Comm, opts: VerifyOptions, t0: float) -> int:
    loaded, load_error = [], ""
    try:
        loaded = [(spec, load_impl(spec)) for spec in opts.impls]
        chosen, skipped = plan(opts, comm.world_size)
    except (ImplSpecError, ValueError) as e:
        chosen, skipped, load_error = [], [], str(e)
    records = comm.all_gather_object(
        {"agree": opts.agreement_fields(), "error": load_error}, "run start"
    )
    errors = {r: m["error"] for r, m in enumerate(records) if m["error"]}
    if errors:
        if comm.rank == 0:
            for r, msg in errors.items():
                print(f"cp-blocktables: rank {r}: {msg}", file=sys.stderr)
        return 2
    mismatch = checks.agreement_violations([m["agree"] for m in records], "run options", -1)
    if mismatch:
        if comm.rank == 0:
            for v in mismatch:
                print(f"cp-blocktables: {v.describe()}", file=sys.stderr)
        return 1
    opts.skipped = skipped
    progress = None
    if comm.rank == 0:
        progress = report.Progress(sum(p.num_steps for p in chosen) * len(loaded), opts.progress)
    totals = _RankTotals()
    results = []
    for spec, cls in loaded:
        accepts = inspect_factory(cls)
        for i, p in enumerate(chosen):
            missing = accepts.missing(p)
            if missing:
                needs = "; ".join(f"{k} for {why}" for k, why in missing.items())
                opts.unsupported.append(
                    {"impl": spec, "preset": p.name, "what": f"{UNSUPPORTED} (needs {needs})"}
                )
                if progress is not None:
                    progress.advance(p.num_steps)
                continue
            result = None
            if comm.cp_group(p.cp_size) is not None:  # else a rank past the last whole group
                result = _PresetRun(comm, opts, spec, cls, p, progress, totals).run()
            results.append(result)
            if opts.fail_fast and _any_failed(comm, result, p.name):
                if progress is not None:
                    progress.advance(sum(q.num_steps for q in chosen[i + 1 :]))
                break
    if progress is not None:
        progress.close()
    rank_info = {
        "rank": comm.rank,
        "max_rss_mb": _max_rss_mb(),
        "wall_s": round(time.monotonic() - t0, 3),
        "tokens": totals.tokens,
        "steps": totals.steps,
        "busy_s": round(totals.busy_s, 3),
        "gather_s": round(totals.gather_s, 3),
        "check_s": round(totals.check_s, 3),
        "warm_s": round(totals.warm_s, 3),
        "warm_tokens": totals.warm_tokens,
        "backend": comm.backend,
        "device": str(comm.device),
        "checks": "device" if use_device_checks(opts.checks, comm.device) else "host",
    }
    gathered = comm.all_gather_object(
        {"results": [r for r in results if r], "info": rank_info}, "end of run"
    )
    all_results = [r for g in gathered for r in g["results"]]
    all_results.sort(
        key=lambda r: (
            opts.impls.index(r["impl"]),
            [p.name for p in chosen].index(r["preset"]),
            r["cp_group"],
        )
    )
    run = report.RunReport(
        opts, comm.world_size, comm.backend, all_results, [g["info"] for g in gathered]
    )
    if comm.rank == 0:
        run.emit()
    # Every rank exits with the verdict, and the spawner gives the last rank standing 5 s
    # once one has exited 1: so no rank leaves before the leader has written the report.
    comm.all_gather_object(None, "report written")
    return 0 if run.passed() else 1


def _any_failed(comm: Comm, result: dict | None, preset: str) -> bool:
    """Whether any CP group's leader saw a violation in this preset (all ranks learn it)."""
    failed = bool(result and (result["violations"] or result["violation_counts"]))
    return any(comm.all_gather_object(failed, f"verdict of preset {preset}"))


def _max_rss_mb() -> float:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(rss / (1024 * 1024) if sys.platform == "darwin" else rss / 1024, 1)
