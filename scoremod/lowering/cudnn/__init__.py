"""The fused cuDNN path: one package, registered as the backend ``"cudnn"``.

    table.py    per op of the op table: its cuDNN node, its rewrite, or its refusal
    rules.py    IR-level support check and canonical forms (the measured cuDNN rules)
    masks.py    pure band masks recognized for cuDNN's native mask
    split.py    band-masked mods split into query blocks
    graph.py    canonical IR -> cuDNN frontend SDPA graphs; the graph cache
    plan.py     the plan of a call: blocks, their graphs and input tensors
    backend.py  the Backend: refusals, forward and backward through XLA FFI
"""
