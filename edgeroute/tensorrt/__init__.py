"""TensorRT: what its ONNX parser takes (``lint``) and engines built from a bundle (``engines``)."""
