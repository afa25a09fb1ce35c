"""KV cache managers, one class per kind, and the prefix caches behind them.

``paged.py`` (plain blocks, ref counts, a CPU swap pool), ``hashed.py`` with ``block_pool.py``
(vLLM's automatic prefix caching), ``radix_manager.py`` with ``radix.py`` (slots an SGLang/TGI
radix tree holds references on), ``prefix.py`` (the prefix-cache interface, keys and stats),
``spec.py`` (``KVSpec``: what a policy declares) and ``factory.py`` (``make_kv_cache``). Imports
nothing else of tailserve: ``core`` builds on it.
"""
