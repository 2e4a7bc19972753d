"""Serve, cluster and routing configs, shipped as package data (`cairn serve` reads local.yaml from here)."""
