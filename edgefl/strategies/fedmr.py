"""FedMR, Federated Model Recombination: Hu, Yue, Ling, Huang, Chen, Wei, Liu, Chen,
"FedMR: Federated Learning via Model Recombination" (arXiv; KDD 2024 as "Is Aggregation the
Only Choice? Federated Learning via Layer-wise Model Recombination"); docs/algorithms.md#fedmr.
Section and algorithm numbers below are the arXiv paper's.

The server keeps a list L_m of K models, K = the clients selected per round, instead of one
global model. Round r (1-based, as the paper's Algorithm 1 lines 2-9 and §4.2):

 1. L_r = K clients, uniformly without replacement (`select_clients`, outside).
 2. Slot i of L_m goes to the i-th selected client (sorted ids; a slot carries no meaning
    across rounds, Algorithm 1 line 5): a per-client downlink, Task(source="client").
 3. Each client runs ordinary local SGD from its model (a fresh momentum buffer every
    round, never uploaded: our choice, the paper's §5.1 only names momentum 0.9) and
    uploads the whole model; L_m[i] <- upload (line 6).
 4. w_glb = (1/K) sum_i L_m[i] (uniform, as line 11), the model evaluated and exported;
    never a starting point in stage 2 (the paper's §4.2: it is for inference only).
 5. Stage 1 (r <= stage1_rounds, the two-stage scheme of §4.3): L_m[i] <- w_glb for all i,
    i.e. uniform FedAvg.
    Stage 2: L_m <- ModelRecombine(L_m) (§4.2, lines 8-9): for every unit u an independent
    uniform permutation pi_u of the K models (Fisher-Yates via numpy's Generator), new model
    k takes unit u from upload pi_u(k). Every uploaded unit lands in exactly one new model, in the
    same position; nothing is averaged, scaled or dropped.

So with stage1_rounds = R1 rounds 1..R1+1 dispatch one model (round R1+1 starts from the last
stage-1 average) and from round R1+2 on clients receive distinct recombined models (where
the authors' code switches; the paper does not say). The list is stored as one flat K x P
buffer ("models"), one model per row; in stage 1 it is K copies of "params" and is not stored.

Units: `granularity: tensor` (default; the authors' code) permutes every layer-
table entry (weight and bias separately); `granularity: layer` keeps a layer's weight and
bias together (the paper's wording). Both come from Setup.units (`Setup.units_of(model)`).
`seg_x` in (0, 1] is the segment variant FedMR-p x (§5.4): one permutation per
contiguous segment of units, segment s starting at unit ceil(s n x) (exact rational
arithmetic on x's decimal value); seg_x = 1 is Indep (whole models shuffled); 0 is FedMR.

Recombination randomness comes from a Generator seeded by (run seed, round) alone, so a run
is deterministic and a resumed round recombines identically; the round metrics log the
permutations ("permutations": one list of K source slots per unit), which replay a round.

Traffic (the paper's §4.2: 2K models per round): K models down (one per client) and K up per
round, the same bytes as FedAvg counted as unicast. Lemma 4.4: recombination keeps the
per-coordinate multiset of the list, so the mean of the recombined list equals w_glb up to
summation order (tests/test_fedmr.py checks it).

Not in the paper: `weighting: samples` weights the stage-1 average and w_glb by |D_i| (the
FedAvg baseline of the authors' code; uniform is FedMR's). With fewer uploads K' < K (a
dropout, which the paper does not consider) only the K' received models are recombined;
next round slot i gets model i mod K' (a copy of a received model refills a missing slot);
the round metric "slots" is the number of models aggregated and recombined. Secure
recombination (App. B) needs client-to-client channels and encryption this runtime does not
have; it is not implemented.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import Sequence

import numpy as np

from . import (WEIGHTINGS, Strategy, StrategyError, Task, aggregation_weights, average_updates,
               check_choice, check_number, mean_train_loss, register)
from .fedavg import FedAvg

GRANULARITIES = ("tensor", "layer")
_RECOMBINE_STREAM = 0xFED3B   # separates the recombination stream from selection and training


# ---------------------------------------------------------------------------------------
# ModelRecombine as free functions (the paper's §4.2; segments as FedMR-p x, §5.4)
# ---------------------------------------------------------------------------------------

def recombination_units(setup_units, granularity: str, size: int) -> tuple:
    """The units to permute, each a tuple of (offset, size) slices: every slice on its own
    (`tensor`) or the per-layer groups as given (`layer`). They must tile [0, size)."""
    check_choice("fedmr", "granularity", granularity, GRANULARITIES)
    units = tuple(tuple((int(o), int(n)) for o, n in unit) for unit in setup_units)
    if not units:
        raise StrategyError("fedmr: Setup.units is empty; FedMR recombines per layer and needs "
                            "the model's layout: Setup(..., units=Setup.units_of(model)) "
                            "(run_federation fills it in)")
    slices = sorted(s for unit in units for s in unit)
    end = 0
    for offset, n in slices:
        if offset != end or n <= 0:
            raise StrategyError(f"fedmr: Setup.units do not tile the {size}-parameter buffer "
                                f"(slice ({offset}, {n}) where offset {end} was expected)")
        end += n
    if end != size:
        raise StrategyError(f"fedmr: Setup.units cover {end} parameters but the model has {size}")
    if granularity == "tensor":
        return tuple((s,) for unit in units for s in unit)
    return units


def segment_ids(n_units: int, seg_x: float) -> list:
    """The permutation index of each unit: 0..n-1 for seg_x = 0 (one permutation per unit);
    for seg_x = x in (0, 1], segment s starts at unit ceil(s n x) (ceil(1/x) segments, as the
    paper's FedMR-p x, §5.4), computed exactly on x's decimal value (0.3 is 3/10, not
    0.299999...)."""
    if seg_x == 0:
        return list(range(n_units))
    x = Fraction(str(seg_x))
    starts = set()
    s = 0
    while True:
        b = math.ceil(s * n_units * x)
        if b >= n_units:
            break
        starts.add(b)
        s += 1
    ids, current = [], -1
    for j in range(n_units):
        current += j in starts
        ids.append(current)
    return ids


def draw_permutations(seed: int, round: int, n_units: int, k: int, seg_x: float = 0.0):
    """(n_units, k) int64: row u is pi_u, unit u of new model i comes from model pi_u[i].
    One uniform permutation per segment (per unit when seg_x = 0), from a Generator seeded
    by (seed, round): stateless, so a resumed run draws the same."""
    ids = segment_ids(n_units, seg_x)
    rng = np.random.default_rng((int(seed), _RECOMBINE_STREAM, int(round)))
    per_segment = [rng.permutation(k) for _ in range(ids[-1] + 1)] if ids else []
    return np.array([per_segment[i] for i in ids], dtype=np.int64).reshape(n_units, k)


def recombine(models: Sequence[np.ndarray], units, perms: np.ndarray) -> np.ndarray:
    """ModelRecombine (the paper's §4.2): a new (K, P) float32 array whose row i takes every
    unit u from models[perms[u, i]]; slices are copied bit for bit, never mixed or moved."""
    models = list(models)
    k, size = len(models), models[0].size
    perms = np.asarray(perms)
    if perms.shape != (len(units), k) or any(sorted(p) != list(range(k)) for p in perms.tolist()):
        raise StrategyError(f"fedmr: need one permutation of {k} per unit ({len(units)} units), "
                            f"got an array of shape {perms.shape}")
    out = np.empty((k, size), dtype=np.float32)
    for unit, perm in zip(units, perms):
        for i, src in enumerate(perm):
            for offset, n in unit:
                out[i, offset:offset + n] = models[src][offset:offset + n]
    return out


# ---------------------------------------------------------------------------------------
# the strategy
# ---------------------------------------------------------------------------------------

@register("fedmr")
@dataclass(frozen=True)
class FedMR(Strategy):
    secure_sum = False
    secure_sum_refusal = "it recombines the clients' models layer by layer, so it needs each model"
    stage1_rounds: int = 0
    granularity: str = "tensor"
    seg_x: float = 0.0
    weighting: str = "uniform"
    # the test accuracy of each of the K models at every evaluation (member_accuracy in the
    # round records), to see whether the models or their mean fall behind FedAvg; K more
    # evaluations per evaluated round, so off unless asked for
    evaluate_models: bool = False

    def __post_init__(self):
        if isinstance(self.stage1_rounds, bool) or not isinstance(self.stage1_rounds, int) \
                or self.stage1_rounds < 0:
            raise StrategyError(f"strategy 'fedmr': stage1_rounds = {self.stage1_rounds!r} must "
                                f"be an integer >= 0 (rounds of FedAvg pre-training, the "
                                f"paper's two-stage scheme)")
        check_choice("fedmr", "granularity", self.granularity, GRANULARITIES)
        check_number("fedmr", "seg_x", self.seg_x, 0.0, 1.0,
                     why="0 = per-unit FedMR, x in (0, 1] = FedMR-p x segments, "
                         "1 = Indep")
        check_choice("fedmr", "weighting", self.weighting, WEIGHTINGS)
        if not isinstance(self.evaluate_models, bool):
            raise StrategyError(f"strategy 'fedmr': evaluate_models = {self.evaluate_models!r} "
                                f"must be true or false")

    def init(self, global_params, cfg):
        """L_m = K identical copies of the initial model (the paper's Algorithm 1 line 1 says
        only "K initial models"; the authors' code copies one), stored as "params" alone
        until the first recombination."""
        recombination_units(cfg.units, self.granularity, global_params.size)   # validate now
        return super().init(global_params, cfg)

    def configure(self, round, clients, state):
        """Slot i -> the i-th selected client: its own model in stage 2 (source "client"),
        else the one stage-1 model (source "global")."""
        setup = self.setup(state)
        clients = sorted(clients)
        if "models" not in state.buffers:
            shared = {"params": state.buffers["params"]}
            return {c: Task(round, shared, self.local_config(setup, round, c)) for c in clients}
        models = self.models(state)
        return {c: Task(round, {"params": models[i % len(models)]},
                        self.local_config(setup, round, c), source="client")
                for i, c in enumerate(clients)}

    def aggregate(self, round, updates, state):
        setup = self.setup(state)
        clients, weights = aggregation_weights(updates, self.weighting)
        params = average_updates(updates, "params", clients, weights)        # step 5: w_glb
        metrics = {"train_loss": mean_train_loss(updates), "slots": len(clients)}
        if round <= self.stage1_rounds:                                      # stage 1: FedAvg
            metrics["stage"] = 1
            return state.replace({"params": params}, round=round), metrics
        units = recombination_units(setup.units, self.granularity, params.size)
        perms = draw_permutations(setup.seed, round, len(units), len(clients), self.seg_x)
        models = recombine([updates[c].buffers["params"] for c in clients], units, perms)
        metrics.update({"stage": 2, "permutations": perms.tolist()})
        return state.replace({"params": params, "models": models.reshape(-1)},
                             round=round, slots=len(clients)), metrics

    def evaluated_members(self, state):
        """The K models L_m once recombination has started (with evaluate_models); in
        stage 1 they are copies of the global model and None is returned."""
        if not self.evaluate_models or "models" not in state.buffers:
            return None
        return self.models(state)

    @staticmethod
    def models(state) -> np.ndarray:
        """The model list L_m as a read-only (K, P) view of the "models" buffer."""
        flat = state.buffers["models"]
        return flat.reshape(int(state.meta["slots"]), -1)

    # ---------------------------------------------------------------- client half
    # ClientUpdate (Algorithm 1 line 5) is FedAvg's: local SGD from the received model,
    # momentum reset every round and never uploaded; the whole model goes up.
    train = FedAvg.train
