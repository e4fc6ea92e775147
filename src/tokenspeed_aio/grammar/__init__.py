"""Structured output: grammar compilation and matchers (xgrammar)."""
