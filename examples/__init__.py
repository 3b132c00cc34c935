"""Examples that the docs point to (importable as ``examples.<name>`` from the repository root)."""
