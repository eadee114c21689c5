"""Drills: the harness's checks around engine events that happen on live state.

`serving` keeps a rank's request pool, `warmup` is the elastic-EP null-block
warm-up, `null_block` runs the drill across eras of the world (elastic
resizes), `faults` runs it under torchrun with injected rank failures, and
`report` renders what a drill found.

Imports: the core and the harness (`cp_blocktables.harness`).
"""
