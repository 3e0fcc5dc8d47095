"""How many training samples an int8 export calibrates on (the first ones, in the source's
order): read by the export (`onnx.py`) and by `edgefl simulate`, which keeps those samples
for its final export when it lets its training set go."""

CALIBRATION_SAMPLES = 512
