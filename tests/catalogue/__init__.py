"""The catalogue: the score and mask mods of attention-gym, ported to jax.numpy.

``mods.CATALOGUE`` holds one entry per mod; ``test_catalogue.py`` checks each
against its NumPy reference on a CPU and its plan for the fused path;
``tests/gpu/test_catalogue_gpu.py`` runs each fused on a GPU; ``docs.py``
writes ``docs/catalogue.md`` from the entries.
"""
