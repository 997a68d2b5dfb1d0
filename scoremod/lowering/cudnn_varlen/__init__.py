"""Segment (packed-document) masks on cuDNN's variable-length attention,
registered as the backend ``"cudnn-varlen"`` (tried before ``"cudnn"``).

    layout.py   the runs of the id arrays as ragged sequences (XLA, in the program)
    graph.py    ragged SDPA graphs, forward and backward
    backend.py  the Backend: the ragged route or the dense one, chosen at run time
"""
