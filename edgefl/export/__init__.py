"""Model export: a LayerTable and its flat buffer to an ONNX graph (DESIGN.md "ONNX").

Building graphs needs the `onnx` package (the `export` extra), which a board does not: it
only runs the exported file with onnxruntime (`edgefl.infer`). So the names below come from
`edgefl.export.onnx`, imported on first use.

    export_onnx(model, params, path, norm_mean=..., norm_std=..., metadata={...})
    quantize_int8(src, dst, calibration)         static int8 (QDQ) via onnxruntime.quantization
    export_checkpoint(source, out, quantize=...)   what `edgefl export` runs
    model_payload(path)                           bytes + metadata ready to publish (MQTT hook)
"""
from __future__ import annotations

OPSET = 17        # pinned: onnxruntime >= 1.13 runs it (pyproject asks for >= 1.16)
IR_VERSION = 8    # the IR that goes with opset 17; newer IRs do not load in older runtimes


class ExportError(ValueError):
    """An export that cannot be done; the message names the file, layer or key at fault."""


_FROM_ONNX_MODULE = ("export_onnx", "build_graph", "quantize_int8", "export_checkpoint",
                     "load_run", "model_payload", "graph_metadata", "Run")
__all__ = ["IR_VERSION", "OPSET", "ExportError", "Run", "build_graph", "export_checkpoint",
           "export_onnx", "graph_metadata", "load_run", "model_payload", "quantize_int8"]


def __getattr__(name):
    if name in _FROM_ONNX_MODULE:
        from . import onnx as impl
        return getattr(impl, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
