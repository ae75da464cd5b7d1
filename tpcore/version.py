"""tpcore's version, in a leaf module that the console script reads without importing anything else."""

__version__ = "0.1.0"
