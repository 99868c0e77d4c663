"""Export: model sources -> quantized weights -> ONNX graphs -> bundle (needs the export extra)."""

from edgeroute.export.pipeline import ExportOptions, ExportReport, export_bundle

__all__ = ["ExportOptions", "ExportReport", "export_bundle"]
