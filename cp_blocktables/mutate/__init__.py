"""Mutation testing of the implementation against the coverage harness (`cp-blocktables mutate`).

Why: the harness claims that a wrong implementation fails it. Mutation testing
measures that claim on our own code: Cosmic Ray makes one small change at a
time (a mutant) to a copy of the implementation modules and reruns the
harness against the copy; every mutant the harness lets pass is either
equivalent (no input can tell it apart) or a gap in the harness's workload.

Invariants:

* Only implementation modules are mutated: every top-level module or package
  of `cp_blocktables` found at run time (`block_tables`, its mixins,
  `buffers`, `kernels`, `guards`, `integrity`, ...) except an explicit list
  of never-mutated ones (`scratch.NEVER_MUTATED`: the contract, the
  reference, the harness and the other product subpackages, the CLI).
  They are copied into a scratch package (`cpbt_mutant`) whose imports of
  every other module (`contract`, `_jit`, ...) point at the real
  `cp_blocktables`, so the reference, checks and workload are never touched,
  and the real package on disk never changes.
* The harness is reached only through its public entry point
  (`python -m cp_blocktables verify --impl ...`); this package imports
  nothing of the harness's internals, so it survives the harness being moved.
* Expectations come from the harness alone: a mutant is killed when verify
  exits non-zero.

Modules: `scratch` builds the copy, `session` drives Cosmic Ray, `shares` splits a
run into sessions run at once and resumed, `reach` records the mutants in
statements the unmutated test command never runs as survivors, `outcome`
classifies and reports, `record` keeps every verdict in a ledger that outlives
the machine, `probe` is the per-mutant test command, `command` the CLI
sub-command and `cli_args` its options.
"""
