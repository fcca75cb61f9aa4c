"""The public library API: ``parambox.train`` (run.py) and the worker entry every local run spawns
(worker.py). ``parambox/__init__.py`` exposes it lazily, so ``import parambox`` stays light."""
