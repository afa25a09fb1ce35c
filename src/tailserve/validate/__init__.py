"""Differential validation: tailserve's policies against the engines' own scheduler code.

``workload`` describes a small deterministic workload, ``tailserve_side`` runs it through our
policy, ``peers`` runs it through an engine's scheduler in its own venv (``drivers/``), and
``trace`` compares the two step by step. See docs/validation.md.
"""
