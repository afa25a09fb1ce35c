"""Sweeps, capacity search and recommended engine flags (``tailserve tune``).

- ``sweep.py``: independent simulation runs on a local process pool, serially or on Ray, with a
  results file that lets an interrupted sweep resume;
- ``capacity.py``: the highest arrival rate meeting an SLO, by bracketing and bisection;
- ``recommend.py``: capacity per policy, the budget / chunk-size sweep with its flat region, and
  the command lines to paste into vLLM, SGLang and TGI.
"""
