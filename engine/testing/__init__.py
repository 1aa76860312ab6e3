"""Hooks for the fault and reliability tests (never switched on by configuration)."""
