"""GPU placement: topology model, discovery, placement-group plans, dry run.

Kept import-free so ``python -m placement.discover`` runs on hosts with only
the Python standard library.
"""
