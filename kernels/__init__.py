"""Shared, model-agnostic kernel infrastructure: timing, statistics, device facts."""
