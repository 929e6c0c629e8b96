"""llmc's backends: emit a compiled plan as deployable artifacts (ONNX first)."""
