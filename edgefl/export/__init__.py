"""Model export: a LayerTable and its flat buffer to an ONNX graph (docs/onnx.md).

Building graphs needs the `onnx` package (the `export` extra), which a board does not: it
only runs the exported file with onnxruntime (`edgefl.infer`). So the names below (and the
pinned OPSET and IR_VERSION) come from `edgefl.export.onnx`, imported on first use;
ExportError lives in edgefl.errors, so catching it needs no onnx.

    export_onnx(model, params, path, norm_mean=..., norm_std=..., metadata={...})
    quantize_int8(src, dst, calibration)         static int8 (QDQ) via onnxruntime.quantization
    export_checkpoint(source, out, quantize=...)   what `edgefl export` runs
    export_run(run_from_params(model, params, ...), out)   a live round's model (no npz)
    model_payload(path)                           bytes + metadata the aggregator publishes
    ExportPolicy(every=5)                         which rounds a training run exports
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import ExportError
from .calibration import CALIBRATION_SAMPLES

QUANTIZE_CHOICES = ("none", "int8")


@dataclass(frozen=True)
class ExportPolicy:
    """When and how a training run (`edgefl simulate`, `edgefl aggregator`) exports its
    global model to ONNX: always after the last round, and also after every `every`-th round
    when every > 0 (0: the final model only). softmax: add the probabilities output;
    quantize: "none" or "int8" (static, calibrated on the run's training data). The
    aggregator publishes each export on the `onnx` topic (docs/protocol.md section 5.1)."""
    every: int = 0
    softmax: bool = True
    quantize: str = "none"

    def __post_init__(self):
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise ValueError(f"export every = {self.every!r}: need an integer >= 0 (rounds "
                             f"between exports; 0: the final model only)")
        if self.quantize not in QUANTIZE_CHOICES:
            raise ValueError(f"export quantize {self.quantize!r}; valid: "
                             f"{', '.join(QUANTIZE_CHOICES)}")
        if not isinstance(self.softmax, bool):
            raise ValueError(f"export softmax = {self.softmax!r}: need true or false")

    def due(self, round: int, rounds: int) -> bool:
        """Whether round `round` of `rounds` is exported."""
        return round == rounds or (self.every > 0 and round % self.every == 0)


_FROM_ONNX_MODULE = ("OPSET", "IR_VERSION", "export_onnx", "build_graph", "quantize_int8",
                     "export_checkpoint", "export_run", "run_from_params", "load_run",
                     "model_payload", "graph_metadata", "Run")
__all__ = ["CALIBRATION_SAMPLES", "IR_VERSION", "OPSET", "ExportError", "ExportPolicy", "Run",
           "build_graph",
           "export_checkpoint", "export_onnx", "export_run", "graph_metadata", "load_run",
           "model_payload", "quantize_int8", "run_from_params"]


def __getattr__(name):
    if name in _FROM_ONNX_MODULE:
        from . import onnx as impl
        return getattr(impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
