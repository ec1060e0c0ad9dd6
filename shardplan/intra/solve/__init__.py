"""The intra-operator ILP's solver: its input and results (types.py), exact reductions
(presolve.py), the HiGHS MIP (mip.py) and its LP relaxation (relaxation.py), CP-SAT
(cpsat.py), the lazy rows' driver (ilp.py) and the brute-force reference (brute_force.py)."""
