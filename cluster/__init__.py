"""Everything Ray Serve: ingress, engine deployment, router, configs, CLI.

Importing `cluster` imports nothing else (no Ray): each module pulls in what it needs.
"""
