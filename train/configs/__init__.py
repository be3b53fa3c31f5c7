"""Experiment configurations (ml_collections), one ``get_config(arg)`` per file."""
