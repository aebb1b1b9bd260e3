"""kernel-workbench: tasks, isolated candidates, guards, verdicts with evidence."""

__version__ = "0.1.0"
