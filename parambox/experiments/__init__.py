"""Experiments: presets, benchmarks, sweeps and studies. Nothing in the library imports this package."""
