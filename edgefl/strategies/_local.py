"""The client's local round: one call into the C core from a private copy of the model the
task started from."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from .. import kernels
from ._types import LocalData, _copy


def local_round(data: LocalData, start: np.ndarray, cfg: Mapping,
                momentum: np.ndarray | None = None):
    """Train from a private copy of `start` for one local round (one C call); returns
    (params, momentum, result). A momentum buffer is copied from `momentum` if given
    (MFL carries it), else a fresh zero buffer is used when cfg momentum > 0 (FedAvg-style
    local momentum, reset every round: a buffer is never carried over or sent)."""
    params = _copy(start, "task params")
    mom = None
    if momentum is not None:
        mom = _copy(momentum, "task momentum")
    elif cfg["momentum"] > 0:
        mom = np.zeros_like(params)
    # `start` (read only) is the centre of FedProx's proximal term when cfg prox_mu > 0; with
    # prox_mu = 0 the kernel skips the term and never reads it
    result = kernels.train_samples(data.samples, params, cfg, momentum=mom, anchor=start,
                                   stop=data.stop)
    return params, mom, result
