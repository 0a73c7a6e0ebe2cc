"""loom: train large language models with every form of parallelism on one device mesh."""

__version__ = "0.1.0"
