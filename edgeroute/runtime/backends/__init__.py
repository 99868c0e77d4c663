"""The backends that run a bundle's models: ONNX Runtime (:mod:`.onnxruntime`), the native C
library (:mod:`.native`) and TensorRT (:mod:`.tensorrt`). Which one runs a model is decided in
:mod:`edgeroute.runtime.backend` (the interfaces and the factory)."""
