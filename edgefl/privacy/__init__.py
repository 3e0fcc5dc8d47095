"""Privacy of what leaves a board: secure aggregation (SecAgg+) and differential privacy.

The round engine (`edgefl.rounds`) calls into this package; nothing here knows about
transports or roles.

Both act on rounds that SUM. A strategy with `secure_sum` gives, on each client, a
`Contribution` (its update as a float32 delta from the task's model, a whole-number weight,
named scalars: `Strategy.contribution`) and, on the server, takes its step from the sum of
the round's contributions alone (`SumTotal`: sum_i weight_i * vector_i, the weights' sum,
the scalars' sums, the count: `Strategy.aggregate_sum`). The round engine runs it as

    client:  update = strategy.train(...)
             c = rounds.client_contribution(strategy, task, update, hooks, rng)
                 # = strategy.contribution(task, update) with its vector passed through
                 #   hooks.client_delta(vector, rng)       <- DP hook (a): clip, noise share
             then either sent as is (a DP-only round) or quantised and masked (secure)
    server:  total = engine.sum_clear(contributions)      (in sorted client order)
                  or the secure aggregation protocol's unmasked sum (`privacy.secagg`)
             closed = engine.close_round_from_sum(plan, total, totals, state, hooks=hooks)
                 # total = hooks.server_sum(total, round)  <- DP hook (b): central noise,
                 #   accountant, adaptive clip; raising BudgetExhausted ends the run
                 # state, metrics = strategy.aggregate_sum(round, total, state)
                 # record_round(...), with hooks.round_metrics(round) in the record

`hooks` is a `PrivacyHooks` (`privacy.hooks`); `NO_HOOKS` does nothing.

Modules: `settings` (the `privacy:` config section as values), `hooks` (the DP hooks),
`secagg` and `shamir` (secure aggregation).
"""
from .hooks import NO_HOOKS, BudgetExhausted, PrivacyHooks

__all__ = ["PrivacyHooks", "NO_HOOKS", "BudgetExhausted"]
