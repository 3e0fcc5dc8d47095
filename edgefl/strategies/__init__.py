"""Federated-learning algorithms as strategies: a server half and a client half, pure, no I/O
(docs/algorithms.md says what each one computes; docs/architecture.md how one plugs in).

    strategy = get_strategy("mfl", gamma=0.5)
    state = strategy.init(w0, Setup(clients=range(10), train={"lr": 0.05}))
    tasks = strategy.configure(1, [2, 5, 7], state)                 # {client: Task}
    update, cstate = strategy.train(tasks[2], local_data[2], None)  # on the client
    state, metrics = strategy.aggregate(1, {2: u2, 5: u5, 7: u7}, state)
    w = strategy.global_model(state)

Rules every strategy follows:

- **Pure.** No I/O, no clocks, no global RNG. Randomness comes from the seeds in `Task.train`
  (derived from (run seed, round, client) by `Strategy.local_config`), so a client's local
  round is the same whichever thread or board runs it.
- **Copy-on-write.** `State`, `Task` and `Update` hand their buffers over: the constructors
  make them read-only, so a strategy that writes into a buffer it received fails loudly
  instead of corrupting the caller's model. New buffers are new arrays.
- **State is returned**, never mutated: `aggregate` returns a new `State`; `train` returns the
  client's new state. A `State` is what a checkpoint saves (buffers + JSON-able meta).
- **Fixed order.** Aggregation visits clients in sorted id order with float64 accumulation
  (`weighted_average`), so the result does not depend on the order updates arrived in.

Round numbers start at 1 (round t = 1..T); papers that count from 0 are translated.
The global model is `state.buffers["params"]` unless a strategy overrides `global_model`.

The package's own machinery lives in modules whose names start with "_", which discovery
never takes for algorithms: `_types` (the values above and StrategyError), `_base` (the
Strategy base class), `_registry` (register, discovery, look-up by name), `_checks`
(parameter checks), `_seeds` (client seeds and selection), `_aggregation` (weights and
averages, and the deltas and mean deltas of a server step from a sum) and `_local` (the client's local round). Everything is imported from here.
"""
from __future__ import annotations

from ._aggregation import (WEIGHTINGS, aggregation_weights, apply_mean_delta, average_updates,
                           client_weight, contribution_of, exact_weights, mean_delta,
                           mean_train_loss, number_scalars, update_buffers, update_delta,
                           weighted_average)
from ._base import Strategy, extension_field
from ._checks import check_choice, check_number
from ._local import local_round
from ._registry import get_strategy, register, strategy_names, strategy_params
from ._seeds import client_seed, select_clients
from ._types import (Contribution, LocalData, PrepareContext, Setup, State, StrategyError, SumTotal,
                     Task, Update)

__all__ = ["StrategyError", "Setup", "Task", "Update", "State", "LocalData", "PrepareContext",
           "Strategy", "register", "get_strategy", "strategy_names", "strategy_params",
           "client_seed", "select_clients", "exact_weights", "aggregation_weights",
           "weighted_average", "average_updates", "mean_train_loss", "local_round",
           "check_choice", "check_number", "WEIGHTINGS", "extension_field", "Contribution",
           "SumTotal", "client_weight", "update_delta", "contribution_of", "mean_delta",
           "apply_mean_delta", "update_buffers", "number_scalars"]
