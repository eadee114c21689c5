"""Drills: the harness's checks around engine events that happen on live state.

`serving` keeps a rank's request pool, `warmup` is the elastic-EP null-block
warm-up. A drill run is `options` (what every rank runs) and `driver` (the
world, its eras, the verdict); `era` runs one CP group's stages at one world
size, serving through the harness (`executor`). `null_block` is the warm-up
stage (`warmup_steps`, `warmup_checks`). `faults` runs a drill under torchrun
with injected rank failures (`fault_inject`, `procs`), and `report` renders
what a drill found.

Imports: the core and the harness (`cp_blocktables.harness`).
"""
