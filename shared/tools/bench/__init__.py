"""Benchmark helpers for `tsukimi bench` (roofline, transformers baseline); not imported by services."""
