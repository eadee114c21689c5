"""What a drill tells a person: a table per stage, the verdict, a repro line, JSON.

Records come from the CP groups' leaders (`era.Era`), one per stage
(`serve 1`, `warm-up`, `serve 2` for `null-block`; `serve 1`, `serve 2` for
`wake-up`, or one skipped `wake-up` record where the implementation lacks
the feature) of each CP group at each world size; each holds its failures
as lines of text, the checks that failed (SPEC.md section 6's numbers, the
names of `WARMUP_CHECKS` or `WAKE_UP_CHECKS`) and a one-line summary.
"""

from __future__ import annotations

import json
import os
import sys

from ..harness.checks import CHECKS

WARMUP_CHECKS = {
    "refused-while-serving": "a warm-up started with serving requests in the pool is refused "
    "and changes nothing",
    "exception-propagates": "an exception in the warm-up body leaves the warm-up",
    "null-ids": "every block id appended in a warm-up is staged as 0",
    "live-kv": "every live block is byte-identical to its bytes from before the warm-up",
    "null-zeroed": "block 0 of every group's KV cache is zero after the warm-up",
    "flag-restored": "redirect_writes_to_null_block has its value from before the warm-up "
    "(also after an exception; a nested warm-up keeps the outer one's)",
    "pool-restored": "the request pool is as before: warm-up requests gone",
    "per-instance": "the redirect set on one instance does not redirect another instance",
    "appends-after": "after the warm-up, appended block ids are staged as given",
}
"""The drill's own checks, beyond SPEC.md section 6 (which also runs on the warm-up steps)."""

WAKE_UP_CHECKS = {
    "wake-up-runs": "init_block_table_layout_tensors(), the re-appends of the live rows and "
    "apply_staged_writes() after a sleep raise nothing",
    "rebuilt": "after init_block_table_layout_tensors(), no device tensor of the instance other "
    "than section 3's buffers holds the sleep's garbage or a copy of it",
    "stable-addresses": "the forward-pass tables and the slot mappings keep their addresses "
    "across a sleep (CUDA graphs captured them)",
}
"""The wake-up drill's own checks, beyond SPEC.md section 6 (which runs on every step)."""

DRILL_CHECKS = {"null-block": WARMUP_CHECKS, "wake-up": WAKE_UP_CHECKS}
STAGES = ("serve 1", "warm-up", "wake-up", "serve 2")


def finding(check: str, what: str, rank: int, group: int | None = None, **kw: str) -> dict:
    """A drill check's finding on one rank: the check, what broke, where, expected and actual."""
    return {"check": check, "what": what, "rank": rank, "group": group, **kw}


def describe_finding(f: dict) -> str:
    """One line: the drill check, what broke, where, expected and actual."""
    where = f"rank {f['rank']}" + (f", group {f['group']}" if f.get("group") is not None else "")
    checks = {**WARMUP_CHECKS, **WAKE_UP_CHECKS}
    text = f"{f['check']} ({checks[f['check']]}): {f['what']} [{where}]"
    if f.get("expected") or f.get("actual"):
        text += f"; expected {f.get('expected', '')}, actual {f.get('actual', '')}"
    return text


class DrillReport:
    """Every rank's records, as a table, a verdict, a reproduction line and JSON."""

    def __init__(self, opts, world_size: int, backend: str, sizes, gathered) -> None:
        self.opts, self.world_size, self.backend, self.sizes = opts, world_size, backend, sizes
        self.records = sorted(
            (r for g in gathered for r in g["results"]),
            key=lambda r: (
                opts.impls.index(r["impl"]),
                opts.presets.index(r["preset"]) if r["preset"] in opts.presets else 0,
                r["era"],
                r["cp_group"],
                STAGES.index(r["stage"]),
            ),
        )
        self.ranks = sorted((g["info"] for g in gathered), key=lambda i: i["rank"])

    @property
    def drill(self) -> str:
        return getattr(self.opts, "drill", "null-block")

    def passed(self) -> bool:
        ran = [r for r in self.records if not r.get("skipped")]
        return bool(ran) and not any(r["failures"] for r in self.records)

    def impl_verdicts(self) -> dict[str, dict]:
        out = {}
        for spec in self.opts.impls:
            mine = [r for r in self.records if r["impl"] == spec]
            bad = [r for r in mine if r["failures"]]
            skipped = next((r["skipped"] for r in mine if r.get("skipped")), None)
            out[spec] = {
                "passed": bool(mine) and not bad and skipped is None,
                "skipped": skipped,
                "failed_stage": bad[0]["stage"] if bad else None,
                "failed_checks": sorted({c for r in bad for c in r["failed_checks"]}),
                "first_failure": bad[0]["failures"][0] if bad else None,
            }
        return out

    def repro(self, spec: str) -> str:
        parts = [
            os.path.basename(sys.executable),
            "-m",
            "cp_blocktables",
            "drill",
            self.drill,
            "--world-size",
            str(self.world_size),
        ]
        if self.opts.sizes:
            parts += ["--sizes", ",".join(map(str, self.opts.sizes))]
        for p in self.opts.presets:
            parts += ["--preset", p]
        parts += ["--seed", str(self.opts.seed)]
        if self.drill == "wake-up" and getattr(self.opts, "cycles", 2) != 2:
            parts += ["--cycles", str(self.opts.cycles)]
        for name in ("steps", "cp_size", "cp_interleave"):
            value = getattr(self.opts, name)
            if value is not None:
                parts += [f"--{name.replace('_', '-')}", str(value)]
        if spec != "cp_blocktables:BlockTables":
            parts += ["--impl", spec]
        return " ".join(parts)

    def render(self) -> str:
        lines = [
            f"cp-blocktables drill {self.drill}: world sizes {' -> '.join(map(str, self.sizes))} "
            f"({self.world_size} ranks launched"
            + (
                f", torchrun attempt {os.environ.get('TORCHELASTIC_RESTART_COUNT')}"
                if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0"
                else ""
            )
            + f"), backend {self.backend}, seed {self.opts.seed}"
        ]
        header = (
            f"{'preset':<16} {'size':>4} {'cp grp':>6} {'ranks':<8} {'stage':<8} "
            f"{'steps':>5} {'tokens':>7}  result"
        )
        current = None
        for r in self.records:
            if r["impl"] != current:
                current = r["impl"]
                lines += ["", f"implementation {current}", header, "-" * len(header)]
            ranks = (
                f"{r['ranks'][0]}-{r['ranks'][-1]}" if len(r["ranks"]) > 1 else str(r["ranks"][0])
            )
            verdict = "FAIL" if r["failures"] else "skipped" if r.get("skipped") else "ok"
            kept = (
                " (state kept from the previous size)"
                if r["kept_state"] and r["stage"] == "serve 1"
                else ""
            )
            lines.append(
                f"{r['preset']:<16} {r['size']:>4} {r['cp_group']:>6} {ranks:<8} {r['stage']:<8} "
                f"{r['steps']:>5} {r['tokens']:>7}  {verdict}: {r['summary']}{kept}"
            )
        if self.drill == "wake-up":
            lines += ["", "wake-up checks, on every rank of every CP group at every sleep:"]
            lines += [f"  {name}: {text}" for name, text in WAKE_UP_CHECKS.items()]
            lines += ["  and SPEC.md section 6's checks on every step before and after a sleep"]
        else:
            lines += ["", "warm-up checks, on every rank of every CP group at every size:"]
            lines += [f"  {name}: {text}" for name, text in WARMUP_CHECKS.items()]
            lines += [
                "  and SPEC.md section 6's checks on every warm-up step (ids 0, slots in block 0)"
            ]
        lines += [
            "",
            "per rank: "
            + "; ".join(
                f"rank {i['rank']}: {i['wall_s']:.1f} s, {i['max_rss_mb']:.0f} MB peak RSS"
                for i in self.ranks
            ),
        ]
        return "\n".join(lines + [""] + self.verdict_lines()) + "\n"

    def verdict_lines(self) -> list[str]:
        skips = [
            f"SKIP: implementation {spec}: drill {self.drill} {v['skipped']}"
            for spec, v in self.impl_verdicts().items()
            if v["skipped"]
        ]
        return skips + self._pass_fail_lines()

    def _pass_fail_lines(self) -> list[str]:
        if self.passed() and self.drill == "wake-up":
            ran = [r for r in self.records if not r.get("skipped")]
            groups = len({(r["impl"], r["preset"], r["era"], r["cp_group"]) for r in ran})
            return [
                f"PASS: {len(ran)} stages in {groups} CP-group runs at world sizes "
                f"{', '.join(map(str, self.sizes))}: after every sleep the wake-up rebuilt "
                f"every derived tensor, and every check held before and after it"
            ]
        if self.passed():
            groups = len({(r["impl"], r["preset"], r["era"], r["cp_group"]) for r in self.records})
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            return [
                f"PASS: {len(self.records)} stages in {groups} CP-group runs at world sizes "
                f"{', '.join(map(str, self.sizes))}: every warm-up left live KV untouched, and "
                f"every check held before and after it"
                + (f" (torchrun attempt {attempt}, from a fresh start)" if attempt != "0" else "")
            ]
        lines = []
        for spec, v in self.impl_verdicts().items():
            if v["skipped"] and not v["failed_stage"]:
                continue
            if not v["passed"]:
                bad = next(r for r in self.records if r["impl"] == spec and r["failures"])
                lines += [
                    f"FAIL: implementation {spec}: preset {bad['preset']}, world size "
                    f"{bad['size']}, CP group {bad['cp_group']}, stage {bad['stage']}",
                    *(f"  {text}" for text in bad["failures"]),
                    f"reproduce: {self.repro(spec)}",
                ]
            elif v["first_failure"] is None and not any(r["impl"] == spec for r in self.records):
                lines.append(f"FAIL: implementation {spec}: no stage ran")
        return lines or ["FAIL: no stage ran" + (" (every one skipped)" if self.records else "")]

    def as_dict(self) -> dict:
        return {
            "passed": self.passed(),
            "world_size": self.world_size,
            "sizes": self.sizes,
            "backend": self.backend,
            "options": vars(self.opts),
            "checks": CHECKS,
            "drill": self.drill,
            "drill_checks": DRILL_CHECKS[self.drill],
            "warmup_checks": WARMUP_CHECKS,
            "implementations": self.impl_verdicts(),
            "records": self.records,
            "ranks": self.ranks,
        }

    def emit(self) -> None:
        out = sys.stdout
        out.write("\n".join(self.verdict_lines()) + "\n" if self.opts.quiet else self.render())
        out.flush()
        if self.opts.report_path:
            parent = os.path.dirname(self.opts.report_path)
            if parent:
                os.makedirs(parent, exist_ok=True)
            with open(self.opts.report_path, "w") as f:
                json.dump(self.as_dict(), f, indent=1)
                f.write("\n")
