"""RNGs by kind: the adapters every source of RNG state is declared with.

The global ``random`` (:mod:`..python_random`), NumPy's global
``RandomState`` (:mod:`..numpy_global`) and the registered RNGs
(:mod:`..user_rngs`) say *which* objects they manage; how an object of each
kind is captured, seeded, restored and saved is here, once.  Each module
imports only those listed before it:

* :mod:`.layouts`: where RNG objects keep their state in memory, probed
  (the only module that touches RNG memory directly);
* :mod:`.persistence`: states as checkpoint data and back, checked;
* :mod:`.uncollected`: the NumPy and torch calls that hold a lock of their
  own while they allocate, made with garbage collections held off (a
  finalizer run there that takes the lock again would wait for ever);
* :mod:`.kinds`: one adapter per kind (``random.Random``, NumPy
  ``Generator`` and ``RandomState``, ``torch.Generator``, random-like
  objects): how it captures, seeds and restores an object, on its records
  where proven, its batch (``random.Random``'s), its fast paths declared,
  and which kind an object is;
* :mod:`.entries`: one RNG bound to its kind's functions, and runs of
  them made their kind's batch.
"""
