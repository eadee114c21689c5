"""Drills: the harness's checks around engine events that happen on live state.

`serving` keeps a rank's request pool, `warmup` is the elastic-EP null-block
warm-up. A drill run is `options` (what every rank runs) and `driver` (the
world, its eras, the verdict); `era` runs one CP group's stages at one world
size (its process groups in `era_comm`), serving through the harness
(`executor`). `null_block` is the warm-up stage (`warmup_steps`,
`warmup_checks`); `wake_up` is sleep mode and wake-up (SPEC.md 8.4), with
`sleep` simulating the sleep. `faults` runs a drill under torchrun with
injected rank failures (`fault_inject`, `procs`), `report` renders what a
drill found and `cli_args` holds the actions' command-line arguments.

Imports: the core, the harness (`cp_blocktables.harness`) and the command
line's shared helpers (`cp_blocktables.cli_base`).
"""
