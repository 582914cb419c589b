"""Autocast: precision policies, op rules and their data, the `famp.autocast` transform, explain.

- Policies: `policy` (`famp.Policy`), `tree_casts` (the casts of a pytree).
- Op rules: `ops` (aten op names), `rules` (`famp.OpRules`), `defaults` (`famp.default_rules`),
  read from `tables` (which assembles the shipped data of `rules_data`) or derived by
  `rules_derive`, which runs each op on its `samples` next to the `reference` of every rule
  (`compare`); `rules_table` prints the docs' table.
- The transform: `transform` (`famp.autocast`) runs each call under a record (`call`) inside
  torch's autocast state (`region`); for overrides and module rules, `mode` hands each op call
  (`op_calls`; torch's Python functions are entered through the copies of `entered`) to the
  record, which casts it per its rule (`overrides`, the overload it reaches: `overloads`;
  `casts`), keeps weight casts fresh (`weights`; the dtypes each thread computes in:
  `threads`) and enters module scopes through global `hooks` (a scope's inputs: `inputs`);
  `recompute` restores the record while torch recomputes a checkpointed block.
- On top of the transform: `custom_fwd` and `explain` (with its `recorder` and `trace`).

Data flows one way: policy and rules → transform → custom_fwd and explain.
"""
