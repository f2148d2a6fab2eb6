"""The embedded torch engine behind the ``Backend`` protocol: ``engine`` (``EmbeddedEngine``:
one request at a time), ``batch`` (``BatchEngine``: the scheduler), ``backend``
(``EmbeddedBackend``), ``model`` (the transformer and its KV cache), ``weights``, ``families``,
``rope`` and ``tokenizer`` (checkpoints), ``prefix_cache`` and ``profile_cache`` (caches),
``threads`` (the thread governor)."""
