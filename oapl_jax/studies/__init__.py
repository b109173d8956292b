"""Experiments built from the public API (runs, reports, plots)."""
