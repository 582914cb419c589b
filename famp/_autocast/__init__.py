"""Autocast: precision policies, op rules and their data, the `famp.autocast` transform, explain.

`policy` holds `famp.Policy` and the casts of a pytree; `rules` holds `famp.OpRules` and
`famp.default_rules`, read from the shipped tables of `rules_data` or derived by `rules_derive`
(which runs each op next to a reference of every rule); `transform` is `famp.autocast`, which
enters torch's autocast state through `region` and, for op overrides and module rules, runs the
mode of `mode` over the calls that `op_calls` names; `recompute` replays a call's state for
activation checkpointing; `custom_fwd` and `explain` build on the transform. Data flows one way:
policy and rules → transform → custom_fwd and explain.
"""
