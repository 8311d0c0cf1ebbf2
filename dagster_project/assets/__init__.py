"""One module per stage; each holds its asset(s) and the checks that sit beside them.

Reads and writes nothing itself: each module's docstring says what its stage reads and writes.
"""
