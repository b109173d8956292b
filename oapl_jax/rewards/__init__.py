"""Verifiable rewards that need more than string matching (e.g. running generated code)."""
