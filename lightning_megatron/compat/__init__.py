"""Workarounds for private or missing APIs of other projects, one module per project, each with its reason."""
