"""A drill on one rank: join the world, check that every rank runs the same, run the eras.

Every implementation goes through every preset at every world size of
`--sizes`, an era each (`EraComm`); ranks outside an era wait for it in the
rendezvous store, watching the members' heartbeats. CP groups whose ranks
stay keep their seat (serving state, caches, instance); ranks that leave
drop theirs. Rank 0 prints the report; every rank returns the same code.
"""

from __future__ import annotations

import os
import sys
import time
import uuid

import torch.distributed as dist

from ..harness import checks, runner
from ..harness.dist import (
    Comm,
    PeerError,
    RankEnv,
    choose_backend,
    disarm_watchdog,
    end_after_peer_failure,
)
from ..harness.impl_loader import ImplSpecError, load_impl
from .era_comm import EraComm
from .executor import Seat
from .fault_inject import Fault
from .options import DrillOptions, plan
from .report import DrillReport


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
        return end_after_peer_failure(e)
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
            seat, preset_failed = Seat(), False
            for era, size in enumerate(sizes):
                n += 1
                votes = comm.all_gather_object(
                    {"preset": preset_failed, "impl": impl_failed},
                    f"start of era {era} ({spec}, preset {preset.name}, world size {size})",
                )
                impl_failed = any(v["impl"] for v in votes)
                if any(v["preset"] for v in votes) or (opts.fail_fast and impl_failed):
                    break
                ecomm = EraComm(comm, size, preset.cp_size, opts.timeout, fault)
                try:
                    if ecomm.member:
                        recs, failed = _era_class(opts)(
                            ecomm, opts, spec, cls, preset, seat, era, fault
                        ).run()
                        results += recs
                        preset_failed |= failed
                        impl_failed |= failed
                        if comm.rank == 0:
                            comm.publish(f"drill/{run_id}/{n}")
                    else:
                        seat = Seat()
                        comm.wait_for(
                            f"drill/{run_id}/{n}", ecomm.ranks, f"era {era} (world size {size})"
                        )
                finally:
                    ecomm.destroy()
    return results


def _era_class(opts: DrillOptions) -> type:
    if opts.drill == "wake-up":
        from .wake_up import WakeUpEra

        return WakeUpEra
    from .null_block import NullBlockEra

    return NullBlockEra
