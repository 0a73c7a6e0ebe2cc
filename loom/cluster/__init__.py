"""Cluster tooling around a training job: the environment doctor, host facts, NCCL variables, the communication
benchmark, and multi-host launchers with their manifests."""
