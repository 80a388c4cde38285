"""How stagewise's commands and the processes ``train`` launches log: the format of every line."""

LOG_FORMAT = "%(name)s: %(message)s"
"""A logger's name, then its message (rank 0's progress is printed, not logged)."""
