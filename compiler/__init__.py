"""llmc: an ahead-of-time compiler for running decoder-only LLMs on phone NPUs.

Importing ``llmc`` is cheap and pulls in neither torch nor onnx: the runtime
(``llmc.runtime``) lives in this namespace and must load on machines without
the compiler's dependencies.
"""

__version__ = "0.1.0"
