"""The memory model: every buffer a device holds during the step, when it is live, and how
its size depends on the members' choices (model.py; the parts it is built from beside it)."""
