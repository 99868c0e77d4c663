"""The benchmark's measures, importable and unit-tested apart from the tools that run models."""
