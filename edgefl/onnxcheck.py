"""Whether an ONNX file holds only what edgefl's exporter writes, read from its protobuf
bytes before onnxruntime sees them (docs/onnx.md, "Bad input"). onnxruntime builds and runs
whatever a file holds: weights read from another file (external data; for a model loaded
from bytes, resolved against the working directory), its contrib ops, custom ops,
model-local functions. edgefl.infer refuses such a file, from disk or received over MQTT,
by the name of what it holds. Stdlib only: a board has onnxruntime, not the `onnx` package.
"""
from __future__ import annotations

__all__ = ["EXPORTED_OPS", "Malformed", "NotExported", "check_model_bytes"]

# What edgefl's exporter writes (edgefl/export/onnx.py: fp32 graphs, and the int8 QDQ
# graphs of onnxruntime's quantize_static) and nothing else: ops of the default ONNX
# domain, weights inside the file, no functions or subgraphs. A model file is checked
# against it before onnxruntime sees it (check_model_bytes).
EXPORTED_OPS = frozenset({
    "Concat", "Conv", "DequantizeLinear", "Div", "Flatten", "Gemm", "Identity", "MaxPool",
    "Neg", "QuantizeLinear", "Relu", "Reshape", "Sigmoid", "Softmax", "Sub"})


class Malformed(ValueError):
    """Bytes that are not a well-formed protobuf message."""


class NotExported(ValueError):
    """A well-formed model holding what edgefl's exporter never writes; the message names it."""


def _fields(buf, start: int, end: int):
    """(field number, wire type, value) of one protobuf message in buf[start:end]: the value
    is an int (varint, fixed) or the (start, end) of a length-delimited field."""
    i = start
    while i < end:
        key, i = _varint(buf, i, end)
        number, wire = key >> 3, key & 7
        if number == 0:
            raise Malformed(f"field number 0 at byte {i}")
        if wire == 0:
            value, i = _varint(buf, i, end)
        elif wire == 1 or wire == 5:
            size = 8 if wire == 1 else 4
            if i + size > end:
                raise Malformed(f"field {number} runs past the end of its message")
            value, i = int.from_bytes(buf[i:i + size], "little"), i + size
        elif wire == 2:
            size, i = _varint(buf, i, end)
            if i + size > end:
                raise Malformed(f"field {number} of {size} bytes runs past the end of its "
                                 f"message (byte {end})")
            value, i = (i, i + size), i + size
        else:
            raise Malformed(f"field {number} has wire type {wire}")
        yield number, wire, value


def _varint(buf, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= end or shift > 63:
            raise Malformed(f"a varint is cut off or too long at byte {i}")
        b = buf[i]
        value |= (b & 0x7F) << shift
        i, shift = i + 1, shift + 7
        if b < 0x80:
            return value, i


def _text(buf, span) -> str:
    return bytes(buf[span[0]:span[1]]).decode("utf-8", "replace")


def check_model_bytes(data: bytes) -> None:
    """Refuse, by name and before onnxruntime loads it, a model holding anything edgefl's
    exporter never writes: a node outside EXPORTED_OPS or of another domain (onnxruntime's
    contrib ops, custom ops), a weight kept in an external file (onnxruntime would read it:
    a model loaded from bytes resolves the path against its working directory), a sparse
    initializer, an attribute holding a tensor or a subgraph, model-local functions or
    training info. Reads the protobuf directly: a board has onnxruntime, not `onnx`.
    Every occurrence of a field is checked (protobuf merges repeated message fields)."""
    buf = memoryview(data)
    functions = []
    graphs = []
    for number, wire, value in _fields(buf, 0, len(buf)):
        if wire != 2:
            continue
        if number == 7:                                       # ModelProto.graph
            graphs.append(value)
        elif number == 25:                                    # ModelProto.functions
            names = {n: _text(buf, v) for n, w, v in _fields(buf, *value) if w == 2
                     and n in (1, 10)}                        # name, domain
            functions.append(f"{names.get(10, '')} {names.get(1, '?')}".strip())
        elif number == 20:                                    # ModelProto.training_info
            raise NotExported("carries training info (a graph edgefl's exporter never "
                              "writes)")
    if functions:
        raise NotExported(f"defines {len(functions)} model-local function(s) "
                          f"({', '.join(functions)}), which edgefl's exporter never writes")
    index = 0
    for graph in graphs:
        for number, wire, value in _fields(buf, *graph):
            if wire != 2:
                continue
            if number == 1:                                   # GraphProto.node
                _check_node(buf, value, index)
                index += 1
            elif number == 5:                                 # GraphProto.initializer
                _check_tensor(buf, value, "initializer")
            elif number == 15:                                # GraphProto.sparse_initializer
                raise NotExported("has a sparse initializer, which edgefl's exporter never "
                                  "writes")


def _check_node(buf, span, index: int) -> None:
    op, domains, name, attributes = "?", [], "", []
    for number, wire, value in _fields(buf, *span):
        if wire != 2:
            continue
        if number == 4:
            op = _text(buf, value)
        elif number == 7:
            domains.append(_text(buf, value))
        elif number == 3:
            name = _text(buf, value)
        elif number == 5:
            attributes.append(value)
    foreign = [d for d in domains if d not in ("", "ai.onnx")]
    if foreign or op not in EXPORTED_OPS:
        label = f"{foreign[0]!r} {op}" if foreign else op
        raise NotExported(f"node {index} ({label}{f', named {name!r}' if name else ''}) "
                          f"is an op edgefl's exporter never writes (it writes "
                          f"{', '.join(sorted(EXPORTED_OPS))} of the default domain)")
    for attribute in attributes:
        fields = {n for n, _, _ in _fields(buf, *attribute)}
        # t, g, tensors, graphs, tp, type_protos, ref_attr_name, sparse_tensor(s)
        held = fields & {5, 6, 10, 11, 14, 15, 21, 22, 23}
        if held:
            attr = next((_text(buf, v) for n, w, v in _fields(buf, *attribute)
                         if n == 1 and w == 2), "?")
            raise NotExported(f"node {index} ({op}) attribute {attr!r} holds a tensor, "
                              "graph or reference, which edgefl's exporter never writes")


def _check_tensor(buf, span, kind: str) -> None:
    name, external, location = "?", False, None
    for number, wire, value in _fields(buf, *span):
        if number == 8 and wire == 2:
            name = _text(buf, value)
        elif number == 14 and wire == 0 and value != 0:       # data_location EXTERNAL
            external = True
        elif number == 13 and wire == 2:                       # external_data entry
            external = True
            entry = {n: _text(buf, v) for n, w, v in _fields(buf, *value) if w == 2}
            if entry.get(1) == "location":
                location = entry.get(2)
    if external:
        raise NotExported(f"{kind} {name!r} keeps its data in an external file "
                          f"({location!r}), which onnxruntime would read; an edgefl model "
                          "holds its weights inside the file")
